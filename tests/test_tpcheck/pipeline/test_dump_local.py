"""A dump's local pass (``tpcheck.pipeline.forced``): the golden and the noise-floor references run each layer on
the engine's recorded input of it. impl's clean dump passes both passes (the local pass on by default); a fault injected into the last layer is
found at its origin by the dump's local pass with about the live local pass's excess; a dump without every layer's
``out`` is judged by the propagated pass alone and says which points it lacks."""
from __future__ import annotations

import json

import pytest
import torch

import tpcheck
from tpcheck.capture.batches import StepBatch
from tpcheck.engines.dump.replay import DumpAdapter, read_dump
from tpcheck.cli.app import main
from tpcheck.pipeline.diff import compare_engine
from tpcheck.pipeline.forced import RecordedInputs
from tpcheck.reference.reductions import Reductions

PROMPTS = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]


def _compare(root, model, dtype, isolate=None):
    engine = DumpAdapter(read_dump(root), Reductions(2))
    return compare_engine(engine, model, engine.prompts, dtype, engine.decode_steps, isolate)


def _origin_excess(r, point, mode):
    return float(r.table[(r.table["point"] == point) & (r.table["mode"] == mode)]["excess"].max())


def test_a_fault_in_the_last_layer_is_found_by_the_dumps_local_pass(ckpt, engines, tmp_path):
    model = str(ckpt("tiny"))
    clean = tmp_path / "clean"
    tpcheck.diff(model=model, tp=2, dtype="bfloat16", prompts=PROMPTS, decode_steps=1, pool=engines, dump=str(clean))
    r = _compare(clean, model, "bfloat16")  # on by default where the dump has every layer's out
    assert r.passed and r.meta["isolate"] and set(r.table["mode"]) == {"propagated", "isolated"}
    faulty = tmp_path / "faulty"
    live = tpcheck.diff(model=model, tp=2, dtype="bfloat16", prompts=PROMPTS, decode_steps=1, pool=engines,
                        dump=str(faulty), inject=["qkv_bias_missing"], inject_layer=1)
    r = _compare(faulty, model, "bfloat16", isolate=True)
    assert not r.passed and (r.first_divergence["point"], r.first_divergence["step"]) == ("layers.1.attn.q", 0)
    live_local, dump_local = (_origin_excess(x, "layers.1.attn.q", "isolated") for x in (live, r))
    # the same bug on (nearly) the same input: the golden's input rounded to bfloat16, or the engine's own
    assert dump_local > 3 and 0.8 < dump_local / live_local < 1.25, (dump_local, live_local)


def test_a_dump_without_every_layers_out_is_judged_by_the_propagated_pass(ckpt, engines, tmp_path, capsys):
    model = str(ckpt("tiny"))
    d = tmp_path / "d"
    tpcheck.diff(model=model, tp=2, prompts=[[1, 2, 3]], pool=engines, dump=str(d), isolate=False,
                 dump_points=r"logits|layers\.\d+\.attn\.q|layers\.0\.out")
    out = tmp_path / "r.json"
    model = [model, "--require-points", "logits"]  # the default requires every layer's out
    assert main(["compare", str(d), "--model", *model, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["isolate"] is False
    assert any("the dump lacks layers.1.out (step 0)" in n for n in doc["meta"]["notes"])
    assert main(["compare", str(d), "--model", *model, "--isolate"]) == 2
    assert "--isolate: the dump lacks layers.1.out (step 0)" in capsys.readouterr().err
    assert main(["compare", str(d), "--model", *model, "--no-isolate", "--json", str(out)]) == 0
    assert not json.loads(out.read_text())["meta"].get("notes")  # no note: the run asked for one pass


def test_recorded_inputs_follow_each_request_and_fill_a_cached_prefix():
    rows = lambda n, at: {1: torch.arange(at, at + n, dtype=torch.float64)[:, None]}  # noqa: E731
    rec = RecordedInputs()
    assert rec.add(StepBatch(["p"], [[5, 6, 7, 8, 9, 10]], [0]), rows(6, 0)) == {}
    # q starts on p's first 4 positions; its sibling r too, in the same step
    step = StepBatch(["r", "q"], [[77, 78], [77, 78]], [4, 4], prompts={"q": [5, 6, 7, 8, 77, 78],
                                                                         "r": [5, 6, 7, 8, 77, 78]})
    gaps = rec.add(step, rows(4, 100))
    assert set(gaps) == {"q", "r"} and gaps["q"][1].flatten().tolist() == [0, 1, 2, 3]
    assert rec.inputs["r"][1].flatten().tolist() == [0, 1, 2, 3, 100, 101]
    rec.add(StepBatch(["p"], [[7, 8]], [2]), rows(2, 200))  # p recomputed from position 2
    assert rec.inputs["p"][1].flatten().tolist() == [0, 1, 200, 201]
    with pytest.raises(ValueError, match="request 's' starts on 3 cached positions that no request"):
        rec.add(StepBatch(["s"], [[1]], [3], prompts={"s": [9, 9, 9, 1]}), rows(1, 0))
