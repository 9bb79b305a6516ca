"""The local pass on each prompt's last rows (``tpcheck.pipeline.local_rows``): a prefix of keys and values
written into a cache stands for the forward of those positions (in HF's cache and in impl's paged one, partitioned
or replicated KV heads), the diff runs only the last rows teacher-forced, and still finds a fault at its origin."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from impl.config import load_config
from tpcheck.capture.batches import StepBatch
from tpcheck.engines.impl.adapter import ImplAdapter
from tpcheck.measure.unshard import unshard
from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run
from tpcheck.pipeline.local_rows import LastRows, planned_prefix, prefix_lens, split_golden, suffix_batch
from tpcheck.pipeline.steps import GoldenCache
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
    engine = SimpleNamespace(takes_prefix=True)
    assert planned_prefix(engine, [PROMPT], 16, False, ()) == [24]
    assert planned_prefix(engine, [PROMPT], 16, True, ()) is None  # MoE: routes follow the engine's row by row
    assert planned_prefix(engine, [PROMPT], 16, False, (1,)) is None  # pipeline stages
    assert planned_prefix(SimpleNamespace(), [PROMPT], 16, False, ()) is None  # an adapter without take_prefix
    assert planned_prefix(engine, [PROMPT], 0, False, ()) is None and planned_prefix(engine, [PROMPT], 40, False, ()) is None
    ctx = SimpleNamespace(local_rows_ran=False)
    assert LastRows(ctx, None).lens is None and not ctx.local_rows_ran  # the golden not held for the local pass


def test_the_golden_cache_holds_the_first_step_as_the_local_pass_reads_it():
    gold = {f"layers.{i}.{k}": torch.randn(40, 8, dtype=torch.float64) for i in range(2)
            for k in ("attn.k_rope", "attn.v", "out", "mlp.gate")}
    cache = GoldenCache(prefix=[24], row_lens=[40], num_layers=2)
    cache.put(0, gold)
    cache.put(1, {n: t[:1] for n, t in gold.items()})
    rows, kv = cache.take(0)
    assert rows["layers.1.out"].shape == (16, 8) and torch.equal(rows["layers.1.out"], gold["layers.1.out"][24:])
    assert torch.equal(kv[1][0], gold["layers.1.attn.k_rope"][:24]) and torch.equal(kv[0][1], gold["layers.0.attn.v"][:24])
    assert cache.nbytes == (8 * 16 + 4 * 24 + 8) * 8 * 8  # the rows it reads, the prefix's keys and values, step 1
    ctx = SimpleNamespace(local_rows_ran=False)
    assert LastRows(ctx, cache).lens == [24] and ctx.local_rows_ran
    lacking = GoldenCache(prefix=[24], row_lens=[40], num_layers=2)  # a replayed golden without a layer's values
    lacking.put(0, {n: t for n, t in gold.items() if n != "layers.1.attn.v"})
    assert lacking.prefix is None and isinstance(lacking.take(0), dict)
    assert LastRows(SimpleNamespace(local_rows_ran=False), lacking).lens is None


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
    fill_cache(cache, kv, load_config(model).head_dim, torch.float64, "cpu")
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
