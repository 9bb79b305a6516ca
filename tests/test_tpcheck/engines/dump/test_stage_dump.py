"""A pipelined engine's dump (``DIR/stage{s}/``, ``tpcheck.engines.dump.stages``) read back as one engine: each point
from the stage that computed it, the hand-off held to what was sent, and a dump whose stages do not make one run
refused naming the stage and the file. No engine runs: the stages are written with ``DumpWriter``."""
from __future__ import annotations

import json

import pytest
import torch

from impl.placements import Replicate
from tpcheck.capture.dump import DumpError, DumpWriter
from tpcheck.capture.stages import write_stage
from tpcheck.engines.dump.stages import PipelineDumpAdapter, is_pipeline_dump, open_dump

TOKENS = [[3, 4, 5], [6, 7]]


def _stage(root, s: int, layers: tuple[int, int], points: dict[str, float], engine: str = "vllm",
           tokens=TOKENS) -> None:
    write_stage(root, s, 2, layers)
    w = DumpWriter(root / f"stage{s}", 0, 1, "float32", engine)
    w.write(0, tokens, [0, 0], {n: (Replicate(), torch.full((5, 4), v)) for n, v in points.items()})


def test_pipeline_dump_replayed_as_one_engine(tmp_path):
    """vLLM's stage 1 reports layer 0's output (its fused add computed it from what it received) and the hand-off
    it received; stage 0's copy of the hand-off is what was sent: equal, no finding; changed, a finding naming the
    boundary."""
    _stage(tmp_path, 0, (0, 1), {"embed": 0.0, "layers.0.mlp.out": 0.0, "layers.0.handoff": 1.0})
    _stage(tmp_path, 1, (1, 2), {"layers.0.handoff": 1.0, "layers.0.out": 1.0, "layers.1.mlp.out": 1.0,
                                 "logits": 1.0})
    assert is_pipeline_dump(tmp_path) and not is_pipeline_dump(tmp_path / "stage0")
    dump, engine, stages = open_dump(tmp_path, lambda tp: None)
    assert isinstance(engine, PipelineDumpAdapter) and stages == ((0, 1), (1, 2)) and dump.tp == 1
    engine.begin(engine.prompts, engine.decode_steps)
    points = engine.step(TOKENS, None, False)
    assert {n: t[0][0, 0].item() for n, (_, t) in points.items()} == {
        "embed": 0, "layers.0.mlp.out": 0, "layers.0.handoff": 1, "layers.0.out": 1, "layers.1.mlp.out": 1,
        "logits": 1}
    assert engine.point_notes == {}
    assert engine.lacking(["layers.0.out", "layers.1.attn.q"]) == {"layers.1.attn.q": 0}  # from stage 1's record

    f = tmp_path / "stage0" / "rank0" / "step0.safetensors"  # what stage 0 sent, rewritten other than received
    other = tmp_path.parent / f"{tmp_path.name}-sent"
    _stage(other, 0, (0, 1), {"embed": 0.0, "layers.0.mlp.out": 0.0, "layers.0.handoff": 2.0})
    f.write_bytes((other / "stage0" / "rank0" / "step0.safetensors").read_bytes())
    f.with_suffix(".json").write_text((other / "stage0" / "rank0" / "step0.json").read_text())
    _, engine, _ = open_dump(tmp_path, lambda tp: None)
    engine.begin(engine.prompts, engine.decode_steps)
    engine.step(TOKENS, None, False)
    assert engine.point_notes["layers.0.handoff"].startswith(
        "stage boundary 0->1 (after layer 0): TP rank 0 of stage 1 received other values than stage 0 sent")


@pytest.mark.parametrize("case, message", [
    ("gap", r"stage1/stage.json: layers \[2, 3\) do not follow the stage before \(next layer 1\)"),
    ("missing", r"pp=3 \(.*stage0/stage.json\) but stage directories \[0, 1\]"),
    ("tokens", r"stage1: requests and tokens differ from stage 0's \(stages of different runs\)"),
    ("named", r"stage1/stage.json: must name stage 1"),
])
def test_pipeline_dump_that_is_not_one_run_is_refused(tmp_path, case, message):
    _stage(tmp_path, 0, (0, 1), {"embed": 0.0})
    _stage(tmp_path, 1, (2, 3) if case == "gap" else (1, 2), {"logits": 1.0},
           tokens=[[3, 4, 5], [6, 8]] if case == "tokens" else TOKENS)
    if case == "missing":
        (tmp_path / "stage0" / "stage.json").write_text(json.dumps({"stage": 0, "pp": 3, "layers": [0, 1]}))
    if case == "named":
        (tmp_path / "stage1" / "stage.json").write_text(json.dumps({"stage": 0, "pp": 2, "layers": [1, 2]}))
    with pytest.raises(DumpError, match=message):
        open_dump(tmp_path, lambda tp: None)


def test_stages_claiming_layers_the_model_lacks_name_the_stage_file(tmp_path, ckpt, capsys):
    from tpcheck.cli.app import main
    _stage(tmp_path, 0, (0, 1), {"embed": 0.0})
    _stage(tmp_path, 1, (1, 3), {"logits": 1.0})  # the tiny model has 2 layers
    code = main(["compare", str(tmp_path), "--model", str(ckpt("tiny"))])
    err = capsys.readouterr().err
    assert code == 2 and "stage1/stage.json: the stages' layers end at layer 3, but --model" in err, err
    assert "has 2 layers" in err and "--pp-partition" not in err
