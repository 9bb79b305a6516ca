"""A dump's KV cache as its own keys and values wrote it (``tpcheck.pipeline.kv_history``): each request's history
over the steps, a prefix-cache hit's positions from the request that ran them, and, through ``compare``, a decode
step's context that errs only through its inputs passing as inherited where the dump holds no ``kv.k`` / ``kv.v``."""
from __future__ import annotations

import math

import pytest
import torch

import tpcheck
from tpcheck.capture.batches import StepBatch
from tpcheck.engines.dump.replay import DumpAdapter, read_dump
from tpcheck.judge.tolerances import Tolerances
from tpcheck.pipeline.diff import compare_engine
from tpcheck.pipeline.kv_history import KvHistory
from tpcheck.reference.reductions import Reductions


def _points(first: int, rows: int, layers=(0,)) -> dict[str, torch.Tensor]:
    """Rows numbered from ``first`` (k) and their negatives (v): a row's value says which position wrote it."""
    k = torch.arange(first, first + rows, dtype=torch.float32)[:, None].repeat(1, 4)
    return {n: t for i in layers for n, t in ((f"layers.{i}.attn.k_rope", k), (f"layers.{i}.attn.v", -k))}


def _kv(step: dict) -> dict[str, torch.Tensor]:
    """The made-up cache a step's points give (built on lookup; a KeyError where there is none)."""
    out = {}
    for n in ("layers.0.kv.k", "layers.0.kv.v", "layers.1.kv.k", "layers.1.kv.v"):
        try:
            out[n] = step[n]
        except KeyError:
            pass
    return out


def test_each_request_reads_the_keys_it_and_its_prefix_donor_wrote():
    h = KvHistory(num_layers=2)
    a = [1, 2, 3, 4]
    first = h.step(StepBatch(["a"], [a], [0]), _points(0, 4))
    assert set(first) == set(_points(0, 4)) and set(_kv(first)) == {"layers.0.kv.k", "layers.0.kv.v"}
    # a decodes position 4; b starts at position 3 on a's first three tokens (a prefix-cache hit)
    b = StepBatch(["a", "b"], [[5], [9, 9]], [4, 3], prompts={"b": [1, 2, 3, 9, 9]})
    kv = _kv(h.step(b, _points(100, 3)))
    assert kv["layers.0.kv.k"][:, 0].tolist() == [0, 1, 2, 3, 100] + [0, 1, 2, 101, 102]  # a's 0..4; a's 0..2, b's
    assert torch.equal(kv["layers.0.kv.v"], -kv["layers.0.kv.k"])
    # a layer whose cache the engine reported is not made up; nor is one whose keys are not every row of the step
    cache = torch.zeros(7, 4)
    reported = {**_points(200, 2, (0, 1)), "layers.1.kv.k": cache}
    kv = _kv(h.step(StepBatch(["a", "b"], [[6], [7]], [5, 5]), reported))
    assert set(kv) == {"layers.0.kv.k", "layers.0.kv.v", "layers.1.kv.k"} and kv["layers.1.kv.k"] is cache
    assert _kv(h.step(StepBatch(["a"], [[8]], [6]), {"layers.0.attn.k_rope": torch.zeros(3, 4),
                                                     "layers.0.attn.v": torch.zeros(3, 4)})) == {}


def test_a_request_on_a_prefix_nobody_ran_has_no_history():
    h = KvHistory(num_layers=1)
    h.step(StepBatch(["a"], [[1, 2]], [0]), _points(0, 2))
    lost = StepBatch(["a", "c"], [[3], [8]], [2, 2], prompts={"c": [7, 7, 8]})
    assert _kv(h.step(lost, _points(10, 2))) == {}
    assert _kv(h.step(StepBatch(["c"], [[9]], [3]), _points(20, 1))) == {}  # nor later: its earlier rows unknown


@pytest.mark.parametrize("history", [True, False])
def test_a_decode_steps_context_passes_as_inherited_without_the_kv_cache(ckpt, engines, tmp_path, monkeypatch,
                                                                        history):
    """A clean impl dump without ``kv.k`` / ``kv.v`` (as vLLM's plugin writes one), judged under a bound on the
    context no rounding meets: every row of it goes over, and passes only as inherited, which at a decode step needs
    the context recomputed from the cache: the one its keys and values wrote (without it, NaN, and a fail)."""
    model = str(ckpt("tiny"))
    d = tmp_path / "d"
    tpcheck.diff(model=model, tp=2, dtype="bfloat16", prompts=[[3, 9, 27, 81, 5], [2, 4, 8]], decode_steps=2,
                 pool=engines, dump=str(d), dump_points=r"(?!.*\.kv\.).*")
    if not history:
        monkeypatch.setattr(KvHistory, "step", lambda self, batch, engine: engine)
    engine = DumpAdapter(read_dump(d), Reductions(2))
    r = compare_engine(engine, model, engine.prompts, "bfloat16", engine.decode_steps,
                       tolerances=Tolerances(kinds={"attn.context": {"rel_max": {"*": 1e-12}}}))
    t = r.table[r.table["point"].str.endswith(".attn.context")]
    assert not t["point"].str.contains("kv").any() and len(t) and (t["rel_err"] > 1e-12).all()
    decode = t[t["step"] > 0]
    assert len(decode) and (decode["own_err"].notna().all() if history else decode["own_err"].isna().all())
    assert decode["passed"].all() if history else not decode["passed"].any()
    assert t[t["step"] == 0]["passed"].all()  # a prefill reads the step's own keys either way
    assert r.passed is history
    assert all(math.isfinite(x) for x in decode["own_err"]) is history


def test_a_cache_written_to_the_wrong_slot_fails_at_the_context_of_a_dump_without_the_cache(ckpt, engines, tmp_path):
    """The made-up cache is what the keys and values say was written, not what the engine reads: a decode step that
    writes its key one slot off (at a block's first slot: position 16 of a 15-token prompt, block 16) reads another
    history than the one its own keys make, so the context's own error is the bug's, and it fails there (its origin
    where the dump holds no ``kv.k``), at the step that wrote it."""
    model = str(ckpt("tiny"))
    d = tmp_path / "d"
    tpcheck.diff(model=model, tp=2, dtype="float32", prompts=[list(range(3, 18))], decode_steps=2, pool=engines,
                 dump=str(d), dump_points=r"(?!.*\.kv\.).*", inject=["slot_mapping_off_by_one_at_block_boundary"],
                 inject_layer=1)
    engine = DumpAdapter(read_dump(d), Reductions(2))
    r = compare_engine(engine, model, engine.prompts, "float32", engine.decode_steps)
    fd = r.first_divergence
    assert not r.passed and (fd["point"], fd["step"]) == ("layers.1.attn.context", 2), fd
    row = r.table[(r.table["point"] == fd["point"]) & (r.table["step"] == 2) & (r.table["mode"] == fd["mode"])]
    assert float(row["own_err"].iloc[0]) > 100 * float(row["threshold"].iloc[0])  # the op's own error, not inherited
