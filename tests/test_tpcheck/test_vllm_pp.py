"""Real vLLM (the CPU build) under pipeline parallelism: ``tpcheck diff --engine vllm --pp 2`` on one engine of two
stages (tp 1), clean, then with a pipeline fault seeded inside vLLM's ranks, found at its origin. Skipped without
vLLM (the main venv); ``.ci/vllm`` runs it. The stage bookkeeping that needs no vLLM is tested in
``test_pipeline_diff.py``."""
from __future__ import annotations

import pytest

from test_vllm import PROMPTS, ckpt, vllm_env  # noqa: F401 - the vLLM environment and small-hd32 fixtures


@pytest.fixture(scope="module")
def pool(vllm_env):  # noqa: F811
    from tpcheck.engines.pool import EnginePool
    p = EnginePool()
    yield p
    p.close()  # stops vLLM's workers


def test_engine_vllm_pp2_clean_each_point_from_its_stage(pool, ckpt):  # noqa: F811
    """pp 2 x tp 1, float32, 2 decode steps: every point within the noise floor, each from the stage holding its
    layer (vLLM's split of small-hd32's 2 layers: [0, 1), [1, 2)); the hand-off after layer 0 judged at every step
    of both passes, and layer 0's output taken from stage 1, whose fused norm computes it from what it received."""
    import tpcheck
    r = tpcheck.diff(str(ckpt), tp=1, pp=2, dtype="float32", prompts=PROMPTS, decode_steps=2, engine="vllm",
                     pool=pool)
    assert r.passed, r.summary()
    assert r.meta["pp"] == 2 and r.meta["stages"] == [[0, 1], [1, 2]]
    t = r.table
    stage = dict(zip(t["point"], t["stage"]))
    assert (stage["embed"], stage["layers.0.kv.k"], stage["layers.0.handoff"], stage["layers.0.out"],
            stage["layers.1.kv.v"], stage["logits"]) == (0, 0, 1, 1, 1, 1)
    assert len(t[t["point"] == "layers.0.handoff"]) == 6  # 3 steps, 2 passes
    assert set(t["mode"]) == {"propagated", "isolated"}  # the local pass forces each stage's own norms


@pytest.mark.parametrize("fault, origin", [
    ("pp-residual-dropped", "layers.0.handoff"),    # stage 0 sends hidden_states without its residual
    ("pp-positions-shifted", "layers.1.attn.q_rope"),  # stage 1's RoPE one position late
])
def test_engine_vllm_pp2_finds_a_pipeline_fault_at_its_origin(pool, ckpt, fault, origin):  # noqa: F811
    """A pipeline fault seeded in vLLM's ranks at the boundary after layer 0: found at its origin, by the noise
    floor, far over its threshold; everything before the boundary passes."""
    from tpcheck.engines.vllm import start
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.pipeline.plan import RunPlan
    from tpcheck.result.meta import RunOrigin
    opts = DiffOptions.of(model=str(ckpt), prompts=PROMPTS, decode_steps=2, pp=2)
    adapter = start(pool, RunPlan.of(opts))  # the engine the clean test started (the same lengths)
    adapter.faults = [(fault, 0, 0)]
    try:
        r = compare(adapter, opts, origin=RunOrigin(tp=1, stages=adapter.stages, engine="vllm", command="test"))
    finally:
        adapter.faults = []
    assert not r.passed
    assert f"origin: {origin} (step 0" in r.summary(), r.summary()
    t = r.table
    worst = t[t["point"] == origin]["excess"].max()
    print(f"{fault}: origin {origin}, excess {worst:.3g}x")
    assert worst > 100, worst
    assert t[t["point"].str.startswith("layers.0.") & (t["point"] != "layers.0.handoff")
             & (t["point"] != "layers.0.out")]["passed"].all()
