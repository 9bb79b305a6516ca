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
from tpcheck.engines.impl import variants
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure.own_attention import written
from tpcheck.pipeline.diff import compare_engine
from tpcheck.pipeline.kv_history import KvHistory
from tpcheck.reference.reductions import Reductions


def _points(first: int, rows: int, layers=(0,)) -> dict[str, torch.Tensor]:
    """Rows numbered from ``first`` (k) and their negatives (v): a row's value says which position wrote it."""
    k = torch.arange(first, first + rows, dtype=torch.float32)[:, None].repeat(1, 4)
    return {n: t for i in layers for n, t in ((f"layers.{i}.attn.k_rope", k), (f"layers.{i}.attn.v", -k))}


def _kv(step: dict, names=("layers.0.kv.k", "layers.0.kv.v", "layers.1.kv.k", "layers.1.kv.v")) -> dict:
    """The made-up cache a step's points give (built on lookup; a KeyError where there is none)."""
    out = {}
    for n in names:
        try:
            out[n] = step[n]
        except KeyError:
            pass
    return out


def _step(h: KvHistory, batch: StepBatch, points: dict) -> dict:
    engine, replicas = h.step(batch, points, {})
    assert replicas == {}  # no rank's keys differ: no rank keeps its own
    return engine


def test_each_request_reads_the_keys_it_and_its_prefix_donor_wrote():
    h = KvHistory(num_layers=2)
    a, both = [1, 2, 3, 4], (0, 1)
    first = _step(h, StepBatch(["a"], [a], [0]), _points(0, 4, both))
    assert set(first) == set(_points(0, 4, both)) and len(_kv(first)) == 4
    assert torch.equal(first[written("layers.0.kv.k")], first["layers.0.kv.k"])  # the cache's op: the same history
    # a decodes position 4; b starts at position 3 on a's first three tokens (a prefix-cache hit)
    b = StepBatch(["a", "b"], [[5], [9, 9]], [4, 3], prompts={"b": [1, 2, 3, 9, 9]})
    kv = _kv(_step(h, b, _points(100, 3, both)))
    assert kv["layers.0.kv.k"][:, 0].tolist() == [0, 1, 2, 3, 100] + [0, 1, 2, 101, 102]  # a's 0..4; a's 0..2, b's
    assert torch.equal(kv["layers.0.kv.v"], -kv["layers.0.kv.k"])
    # a cache the engine reported is not made up, but what its keys wrote is (the cache's op)
    cache = torch.zeros(7, 4)
    step = _step(h, StepBatch(["a", "b"], [[6], [7]], [5, 5]), {**_points(200, 2, both), "layers.1.kv.k": cache})
    assert step["layers.1.kv.k"] is cache
    assert step[written("layers.1.kv.k")][:, 0].tolist() == [0, 1, 2, 3, 100, 200] + [0, 1, 2, 101, 102, 201]
    # a step whose keys are not every row of the step, or that holds other layers' than the first: none from here
    assert _kv(_step(h, StepBatch(["a"], [[8]], [6]), {"layers.0.attn.k_rope": torch.zeros(3, 4),
                                                        "layers.0.attn.v": torch.zeros(3, 4)})) == {}
    assert _kv(_step(h, StepBatch(["a"], [[8]], [6]), _points(300, 1))) == {}


def test_a_request_on_a_prefix_nobody_ran_has_no_history():
    h = KvHistory(num_layers=1)
    _step(h, StepBatch(["a"], [[1, 2]], [0]), _points(0, 2))
    lost = StepBatch(["a", "c"], [[3], [8]], [2, 2], prompts={"c": [7, 7, 8]})
    assert _kv(_step(h, lost, _points(10, 2))) == {}
    assert _kv(_step(h, StepBatch(["c"], [[9]], [3]), _points(20, 1))) == {}  # nor later: its earlier rows unknown


def test_a_local_pass_prefix_starts_the_history():
    """The local pass gives each prompt's first positions as a cache prefix (the golden's keys and values, rounded):
    the history starts with what was given."""
    h = KvHistory(num_layers=1)
    first = StepBatch(["a", "b"], [[4, 5], [7]], [3, 0], prompts={"a": [1, 2, 3, 4, 5], "b": [7]})
    given = {0: (torch.full((3, 4), -5.0), torch.full((3, 4), 5.0))}
    h.seed(first, [3, 0], given)
    kv = _kv(_step(h, first, _points(10, 3)))
    assert kv["layers.0.kv.k"][:, 0].tolist() == [-5, -5, -5, 10, 11] + [12]


def test_each_rank_keeps_the_keys_it_wrote_from_the_first_step_they_differ():
    """Rank 1's replica of the keys differs from step 1 on: its history is rank 0's before and its own after, given
    as that rank's replica of the cache (and of what the cache should hold)."""
    h = KvHistory(num_layers=1)
    _step(h, StepBatch(["a"], [[1, 2]], [0]), _points(0, 2))
    p = _points(10, 1)
    other = {"layers.0.attn.k_rope": {1: p["layers.0.attn.k_rope"] + 0.5}}
    engine, replicas = h.step(StepBatch(["a"], [[3]], [2]), p, other)
    for n in ("layers.0.kv.k", written("layers.0.kv.k")):
        assert engine[n][:, 0].tolist() == [0, 1, 10]
        assert replicas[n].get(1)[:, 0].tolist() == [0, 1, 10.5] and replicas[n].get(0, "first") == "first"
    assert replicas[written("layers.0.kv.v")].get(1)[:, 0].tolist() == [0, -1, -10]  # its values: the first's
    engine, replicas = h.step(StepBatch(["a"], [[4]], [3]), _points(20, 1), {})
    assert replicas["layers.0.kv.k"].get(1)[:, 0].tolist() == [0, 1, 10.5, 20]  # the same as the first's from here


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
        monkeypatch.setattr(KvHistory, "step", lambda self, batch, engine, replicas: (engine, replicas))
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


def test_a_cache_holding_the_keys_it_was_given_passes_as_inherited(ckpt, engines):
    """A live engine's KV cache (``kv.k`` / ``kv.v``, read back) holds this step's keys and values and the earlier
    steps': at a prefill exactly ``attn.k_rope`` / ``attn.v``, the same error against the same threshold. So a key
    row over its threshold that passes as inherited (its op right on the inputs it had) must pass in the cache that
    stores it: the cache's own op is the history of keys and values the run wrote (``KvHistory``). Judged under a
    bound no rounding meets at the keys and values and the cache, each goes over; the keys and values pass as
    inherited, and so does the cache at every step, in the local pass too, whose prefix (the golden's keys and
    values, given) the cache's history starts with."""
    tight = {k: {"rel_max": {"*": 1e-12}} for k in ("attn.k_rope", "attn.v", "kv.k", "kv.v")}
    r = tpcheck.diff(model=str(ckpt("tiny")), tp=2, dtype="bfloat16", prompts=[[3, 9, 27, 81, 5], [2, 4, 8]],
                     decode_steps=2, pool=engines, tolerances=Tolerances(kinds=tight), local_rows=2)
    t = r.table
    assert r.meta["local_rows"] == 2  # the local pass gave the 5-token prompt a 3-position prefix
    kv = t[t["kind"].isin(["kv.k", "kv.v"])]
    assert len(kv) and (kv["rel_err"] > 1e-12).all() and kv["inherited"].all(), \
        kv[["point", "step", "mode", "rel_err", "own_err", "passed"]]
    assert (kv["own_err"] == 0).all() and r.passed, r.summary()


def test_each_ranks_cache_holds_the_keys_that_rank_wrote(ckpt, engines):
    """One KV head replicated over 4 ranks whose inputs differ (vLLM's all-reduce adds in each rank's order: the
    keys' replicas differ by 0.45% in bfloat16 here): each rank's cache holds what that rank wrote, and is judged
    on it (each rank's history, from the first step its replica differs). Against rank 0's history the other ranks'
    caches erred by 0.0016-0.0021 as their own, and failed under this bound."""
    model = str(ckpt("tiny-mqa"))
    llm = engines.get(model, 4, "bfloat16")
    tight = {k: {"rel_max": {"*": 1e-12}} for k in ("attn.k_rope", "attn.v", "kv.k", "kv.v")}
    try:
        llm.call(variants.apply, ["rank_order_allreduce"])
        r = tpcheck.diff(model=model, tp=4, dtype="bfloat16", prompts=[[3, 9, 27, 81, 5, 7, 11, 13, 17]],
                         decode_steps=2, pool=engines, tolerances=Tolerances(kinds=tight))
    finally:
        llm.reload()
    t = r.table
    kv = t[t["kind"].isin(["kv.k", "kv.v"]) & t["replica_own_err"].notna()]
    assert len(kv) and (kv["rank_spread"] > 1e-3).all() and (kv["replica_own_err"] == 0).all(), \
        kv[["point", "step", "mode", "rank_spread", "own_err", "replica_own_err"]]
    assert r.passed, r.summary()
