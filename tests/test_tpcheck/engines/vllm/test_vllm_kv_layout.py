"""vLLM's paged KV cache read back (``tpcheck.engines.vllm.worker.paged_kv_rows``, ``probe_cpu_index``): pure, no
vLLM needed, on synthetic caches in the CPU backend's layout (plain and tiled) and flash-attention's."""
from __future__ import annotations

import pytest
import torch

from tpcheck.engines.vllm.worker import paged_kv_rows, probe_cpu_index


def _seq(n: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


@pytest.mark.parametrize("layout", ["cpu", "cpu-tiled", "flash"])
def test_paged_kv_rows_reads_each_sequence_back(layout):
    nb, bs, heads, d = 6, 4, 2, 8
    seqs = {(1, 4, 0): 7, (5, 2): 5}  # block table -> tokens
    g = torch.Generator().manual_seed(1)
    # a tiled key layout: a fixed permutation of each (block, head)'s [bs, d] elements, as the vec ISA has
    perm = torch.randperm(bs * d, generator=g) if layout == "cpu-tiled" else torch.arange(bs * d)
    index = (perm.view(bs, d), torch.arange(bs * d).view(bs, d))
    cache = torch.full((2, nb, bs, heads, d), float("nan")) if layout == "flash" else \
        torch.full((nb, heads, bs, 2 * d), float("nan"))
    want = {}
    for s, (table, n) in enumerate(seqs.items()):
        k, v = _seq(n, heads, d, s)
        want[table] = (k, v)
        for p in range(n):
            b, o = table[p // bs], p % bs
            if layout == "flash":
                cache[0, b, o], cache[1, b, o] = k[p], v[p]
            else:
                for h in range(heads):
                    flat = cache[b, h].view(2, bs * d)
                    flat[0, perm.view(bs, d)[o]] = k[p, h]
                    flat[1, o * d:(o + 1) * d] = v[p, h]
    for table, n in seqs.items():
        k, v = paged_kv_rows(cache, "flash" if layout == "flash" else "cpu", list(table), n,
                             index if layout == "cpu-tiled" else None)
        assert torch.equal(k, _flat(want[table][0])) and torch.equal(v, _flat(want[table][1]))


def test_paged_kv_rows_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        paged_kv_rows(torch.zeros(2, 3, 4, 1, 8), "flash", [0], 5)
    with pytest.raises(ValueError, match="layout"):
        paged_kv_rows(torch.zeros(2, 3, 4, 1, 8), "paged", [0], 1)


def test_probe_cpu_index_learns_a_kernel_layout():
    """A stand-in for vLLM's CPU write kernel that stores keys transposed ([d, bs]) and values row-major."""
    bs, d = 4, 70  # d > 64: the high digit of the probe matters

    def write(k, v, kc, vc, slots):
        for s in slots.tolist():
            kc[0, 0].reshape(-1)[torch.arange(d) * bs + s] = k[s, 0]  # a view: writes through
            vc[0, 0, s] = v[s, 0]
    k_idx, v_idx = probe_cpu_index(write, bs, d, torch.bfloat16)
    assert torch.equal(k_idx, (torch.arange(d).view(1, d) * bs + torch.arange(bs).view(bs, 1)))
    assert torch.equal(v_idx, torch.arange(bs * d).view(bs, d))
