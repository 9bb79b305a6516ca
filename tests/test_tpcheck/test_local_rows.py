"""The local pass on each prompt's last rows (``tpcheck.pipeline.local_rows``): a prefix of keys and values
written into a cache stands for the forward of those positions (in HF's cache and in impl's paged one, partitioned
or replicated KV heads), the diff runs only the last rows teacher-forced, and still finds a fault at its origin."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from impl.config import load_config
from tpcheck.capture.batches import StepBatch
from tpcheck.engines.impl import ImplAdapter
from tpcheck.measure.unshard import unshard
from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run
from tpcheck.pipeline.local_rows import LastRows, prefix_lens, split_golden, suffix_batch
from tpcheck.reference.cache import hf_capture
from tpcheck.reference.hf import fill_cache, new_cache

PROMPT = [(7 * i + 3) % 1000 for i in range(40)]


def test_prefix_lens_and_suffix_batch():
    assert prefix_lens([[1] * 40, [2] * 10], 32) == [8, 0]
    assert prefix_lens([[1] * 40], 0) is None and prefix_lens([[1] * 30], 32) is None
    b = suffix_batch(StepBatch.of_prompts([[1, 2, 3, 4], [5, 6]]), [3, 0])
    assert b.tokens == [[4], [5, 6]] and b.starts == [3, 0] and b.prompts == {"0": [1, 2, 3, 4], "1": [5, 6]}


def test_split_golden_keeps_the_last_rows_and_whole_caches():
    gold = {"layers.0.attn.k_rope": torch.arange(6.)[:, None], "layers.0.attn.v": -torch.arange(6.)[:, None],
            "layers.0.kv.k": torch.zeros(9, 1), "logits": torch.arange(6.)[:, None]}
    rows, kv = split_golden(gold, [4, 2], [3, 1], 1)
    assert rows["logits"].flatten().tolist() == [3., 5.] and rows["layers.0.kv.k"].shape == (9, 1)
    assert kv[0][0].flatten().tolist() == [0., 1., 2., 4.] and kv[0][1].flatten().tolist() == [0., -1., -2., -4.]
    with pytest.raises(ValueError, match="lacks"):
        split_golden({"logits": gold["logits"]}, [4, 2], [3, 1], 1)


def test_every_row_runs_where_a_prefix_cannot_be_given():
    class Held:  # a GoldenCache's held steps
        def __init__(self, step0):
            self.steps = {0: step0}

    gold = {f"layers.{i}.{k}": torch.zeros(40, 4) for i in range(2) for k in ("attn.k_rope", "attn.v")}
    ctx = SimpleNamespace(prompts=[PROMPT], local_rows=16, sparse=False, handoffs=(), num_layers=2,
                          engine=SimpleNamespace(takes_prefix=True), local_rows_ran=False)
    assert LastRows(ctx, Held(gold)).lens == [24] and ctx.local_rows_ran
    for why in ({"sparse": True}, {"handoffs": (1,)}, {"engine": SimpleNamespace()}, {"local_rows": 0}):
        assert LastRows(SimpleNamespace(**{**vars(ctx), **why}), Held(gold)).lens is None, why
    assert LastRows(ctx, None).lens is None  # the golden not held for the local pass
    assert LastRows(ctx, Held({k: v for k, v in gold.items() if k != "layers.1.attn.v"})).lens is None


def _points(step_points: dict) -> dict[str, torch.Tensor]:
    """The unsharded tensor of every point of an engine step."""
    out = {}
    for name, (placement, per_rank) in step_points.items():
        out.update({u.name: u.tensor for u in unshard(name, placement, per_rank)})
    return out


def test_a_prefix_in_hf_cache_is_the_forward_of_those_positions(ckpt):
    model = str(ckpt("small"))
    golden = hf_capture(model, "float64")
    full = golden.step([PROMPT], [new_cache(golden.model)], [0])
    n = 24
    cache = new_cache(golden.model)
    kv = {i: (full[f"layers.{i}.attn.k_rope"][:n], full[f"layers.{i}.attn.v"][:n]) for i in range(4)}
    fill_cache(cache, kv, load_config(model).head_dim, torch.float64)
    rest = golden.step([PROMPT[n:]], [cache], [n])
    for name, t in rest.items():
        assert torch.allclose(t, full[name][n:], rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("tp", [2, 4])  # small's 2 KV heads: partitioned at tp 2, replicated at tp 4
def test_a_prefix_in_impls_paged_cache_is_the_forward_of_those_positions(engines, ckpt, tp):
    llm = engines.get(str(ckpt("small")), tp, "float32")
    adapter = ImplAdapter(llm)
    adapter.begin([PROMPT], 1)
    full = _points(adapter.step([PROMPT], None, False))
    adapter.close()
    n = 24
    adapter.begin([PROMPT], 1)
    adapter.take_prefix([n], {i: (full[f"layers.{i}.attn.k_rope"][:n], full[f"layers.{i}.attn.v"][:n])
                              for i in range(4)})
    rest = _points(adapter.step([PROMPT[n:]], None, True))
    adapter.close()
    for name, t in rest.items():
        if ".kv." in name:  # the whole cache: the prefix as written, then the rows this step stored
            want = full[f"layers.{name.split('.')[1]}.attn.{'k_rope' if name.endswith('k') else 'v'}"]
            assert torch.equal(t[:n], want[:n]), name
            assert torch.allclose(t[n:], want[n:], rtol=1e-4, atol=1e-5), name
            continue
        # a GEMM of fewer rows may pick another kernel (another summation order): float32 rounding apart
        assert torch.allclose(t, full[name][n:], rtol=1e-4, atol=1e-5), name


def _diff(engines, ckpt, prompts, **kw):
    return run(DiffOptions(model=str(ckpt("deep-sink")), tp=2, dtype="bfloat16", prompts=prompts, decode_steps=1,
                           **kw), pool=engines)


def test_the_local_pass_runs_the_last_rows_and_finds_a_fault_at_its_origin(engines, ckpt):
    prompts = [PROMPT[:40], PROMPT[:12]]  # the second no longer than local_rows: it runs whole
    clean = _diff(engines, ckpt, prompts, local_rows=16)
    assert clean.passed, clean.summary()
    assert clean.meta["local_rows"] == 16
    assert "local_rows" not in _diff(engines, ckpt, prompts, local_rows=0).meta
    bad = _diff(engines, ckpt, prompts, local_rows=16, inject=("skip_o_proj_allreduce",), inject_layer=12)
    assert not bad.passed
    t = bad.table
    at = t[(t["point"] == "layers.12.attn.out") & (t["mode"] == "isolated") & (t["step"] == 0)]
    assert float(at["excess"].iloc[0]) >= 10, bad.summary()
    assert bad.first_divergence["point"] == "layers.12.attn.out", bad.summary()


def test_hf_tp_takes_a_prefix_too(engines, ckpt):
    r = run(DiffOptions(model=str(ckpt("small")), tp=2, dtype="bfloat16", prompts=[PROMPT], decode_steps=1,
                        engine="hf-tp", local_rows=16), pool=engines)
    assert r.passed, r.summary()
    assert r.meta["local_rows"] == 16 and "local pass: the last 16 positions" in r.summary()


def test_local_rows_is_validated():
    with pytest.raises(ValueError, match="--local-rows must be an integer >= 0"):
        DiffOptions(local_rows=-1).validate(type("C", (), {"max_position": 64, "num_layers": 2})())
