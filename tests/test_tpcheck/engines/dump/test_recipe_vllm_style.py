"""The torchrun recipe for a vLLM-style engine: ``examples/vllm_style_tp.py`` (vLLM's module names, fused
qkv / gate_up, fused add + RMSNorm, in-place RoPE, vocab-parallel embedding and logits processor) launched by
torchrun dumps through ``tpcheck.capture.from_env(model, VLLM_MAP, ...)``; ``tpcheck compare`` judges the dump.
A clean engine passes with every VLLM_MAP point compared; an injected TP bug (``--bug``, test-only) fails with
its origin where the bug is."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from impl.placements import Shard
from tpcheck.capture.maps import VLLM_MAP
from tpcheck.cli.app import main
from tpcheck.engines.dump.replay import read_dump
from tpcheck.result.table import load_result

ROOT = Path(__file__).resolve().parents[4]
EXAMPLE = ROOT / "examples" / "vllm_style_tp.py"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]  # different lengths: per-sequence attention and KV cache
DECODE_STEPS = 2


def run_recipe(model_dir, out: Path, tp: int, *args: str) -> tuple[Path, list[list[int]]]:
    """``TPCHECK_DUMP=out/dump torchrun ... examples/vllm_style_tp.py``: the dump and the generated ids."""
    dump = out / "dump"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPCHECK_DUMP")}
    env.update(TPCHECK_DUMP=str(dump), OMP_NUM_THREADS="1")
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(tp), str(EXAMPLE), "--model", str(model_dir),
           "--decode-steps", str(DECODE_STEPS), *args]
    for p in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("generated "))
    return dump, ast.literal_eval(line.removeprefix("generated ").split(" (tp=")[0])


def compare(dump: Path, model_dir, out: Path):
    """``tpcheck compare DUMP --model CKPT --json ...``: the exit code and the result."""
    rc = main(["--quiet", "compare", str(dump), "--model", str(model_dir), "--json", str(out / "result.json")])
    return rc, load_result(out / "result.json")


@pytest.mark.parametrize("preset,tp,dtype", [("tiny", 2, "float32"), ("tiny", 4, "float32"), ("small", 2, "bfloat16")],
                         ids=["tiny-tp2", "tiny-tp4-kv-replicas", "small-tp2-bf16"])
def test_clean_vllm_style_engine_passes_on_every_vllm_point(preset, tp, dtype, ckpt, tmp_path):
    d = ckpt(preset)
    dump, generated = run_recipe(d, tmp_path, tp, "--dtype", dtype)
    rc, result = compare(dump, d, tmp_path)
    assert rc == 0 and result.passed, result.summary()

    # what was dumped: the steps' tokens (the engine's own greedy ids), the fused outputs with their layout
    recorded = read_dump(dump)
    assert recorded.tp == tp and recorded.dtype == dtype and recorded.engine == "vllm-style"
    assert recorded.tokens[0] == PROMPTS
    assert [recorded.tokens[s] for s in (1, 2)] == [[[g[s - 1]] for g in generated] for s in (1, 2)]
    assert recorded.starts == [[0, 0], [7, 3], [8, 4]]
    qkv, _ = recorded.points(0)["layers.0.attn."]
    replicas = max(1, tp // 2)  # tiny and small have 2 KV heads
    assert [(name, sub) for name, _, sub in qkv.parts] == \
        [("q", Shard(-1)), ("k", Shard(-1, replicas)), ("v", Shard(-1, replicas))]
    logits = recorded.points(1)["logits"][1]  # gathered to rank 0 only, padding stripped
    assert logits[0].shape[1] == {"tiny": 250, "small": 1000}[preset] and all(t is None for t in logits[1:])

    # what was compared: every VLLM_MAP point at every step (q/k/v and gate/up split from the fused
    # outputs, the residual stream from the fused norms' second output), logits at the decode steps only
    # (vLLM computes them for the sampled rows: at the prefill one row per prompt, dropped)
    layers = {"tiny": 2, "small": 4}[preset]
    reported = VLLM_MAP.reports(layers)
    t = result.table
    for step in range(DECODE_STEPS + 1):
        got = t[(t["step"] == step) & (t["mode"] == "propagated")]["point"].tolist()
        assert got == [p for p in reported if step > 0 or p != "logits"], step
    assert {"layers.0.attn.q", "layers.0.attn.k_rope", "layers.0.mlp.up", "layers.0.attn.residual",
            f"layers.{layers - 1}.out"} <= set(t["point"])
    assert result.meta["coverage"]["not_reported"] == [f"layers.{i}.kv.{kv}" for i in range(layers) for kv in "kv"]


@pytest.mark.parametrize("bug,origin", [("swap-q-shards", "layers.0.attn.q"),
                                        ("skip-o-proj-allreduce", "layers.0.attn.out")])
def test_a_tp_bug_in_the_engine_fails_at_its_origin(bug, origin, ckpt, tmp_path):
    d = ckpt("tiny")
    dump, _ = run_recipe(d, tmp_path, 2, "--bug", bug)
    rc, result = compare(dump, d, tmp_path)
    assert rc == 1 and not result.passed
    first = result.first_divergence
    assert (first["point"], first["step"]) == (origin, 0), result.summary()


def test_the_example_refuses_to_run_without_torchrun(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("vllm_style_tp", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        example.main(["--model", "unused", "--prompt-ids", "1,2,3"])
    assert e.value.code == 2 and "run me under torchrun (WORLD_SIZE is not set)" in capsys.readouterr().err
