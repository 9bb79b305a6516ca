"""tpcheck diff --pp: each point taken from the stage that computes it and unsharded within that stage's TP group;
clean pipelined impl passes (propagated and local pass, with decode); a bad --pp is exit 2, a stage that reported
nothing exit 3 naming it."""
from __future__ import annotations

import re

import pytest
import torch

from diff_runs import LAYERS, run_diff
from impl.placements import Replicate
from tpcheck.capture.points import point_names, stage_handoffs
from tpcheck.cli import fault_matrix as M
from tpcheck.engines.impl.faults import FAULTS
from tpcheck.cli.app import main
from impl.pipeline import layer_partition
from tpcheck.engines.impl.adapter import point_stage, stage_points
from tpcheck.judge.coverage import CoverageError

STAGES = ((0, 1), (1, 2))  # tiny (2 layers) at pp 2


def test_point_stage():
    assert [point_stage(n, STAGES) for n in ("embed", "layers.0.attn.q", "layers.0.kv.k", "layers.1.out",
                                             "final_norm", "logits")] == [0, 0, 0, 1, 1, 1]
    assert point_stage("layers.0.handoff", STAGES) == 1  # the boundary's point lives where it was received
    assert stage_handoffs((3, 1)) == (2,) and stage_handoffs((1, 2, 1)) == (0, 2) and stage_handoffs((4,)) == ()


def test_vllm_stage_of_a_point_and_its_pipeline_faults():
    """vLLM (no vLLM needed): the output of a stage's last layer is computed, and reported, by the next stage's fused
    add + RMSNorm, so it is taken from there, the rest as impl's; a pipeline fault away from every boundary is
    refused naming its layer and the boundaries."""
    from tpcheck.capture.points import fused_out_stage
    from tpcheck.engines.vllm.pp import check_pp_faults
    stages = ((0, 2), (2, 3), (3, 4))
    assert [fused_out_stage(n, stages) for n in ("embed", "layers.1.out", "layers.1.handoff", "layers.1.mlp.out",
                                                  "layers.0.out", "layers.2.out", "layers.3.out", "logits")] == \
        [0, 1, 1, 0, 0, 2, 2, 2]
    # the local pass's teacher of a boundary layer's output is the next stage's: both ranks' stage 1 points
    s0, s1 = ["embed", "layers.1.handoff"], ["layers.1.handoff", "layers.1.out", "layers.2.out"]
    pts = stage_points([_rank(s0, 0), _rank(s1, 1), _rank(["logits"], 2)], 1, stages, owner=fused_out_stage)
    assert [pts[n][1][0][0, 0].item() for n in ("embed", "layers.1.handoff", "layers.1.out")] == [0, 1, 1]
    check_pp_faults([("pp-residual-dropped", 1, 0), ("pp-positions-shifted", 2, 0), ("o-proj-partial", 0, 1)],
                    stages)
    with pytest.raises(ValueError, match=r"pp-residual-dropped at layer 0: .* boundaries are after layer\(s\) "
                                         r"\[1, 2\]"):
        check_pp_faults([("pp-residual-dropped", 0, 0)], stages)
    with pytest.raises(ValueError, match="none \\(one stage\\)"):
        check_pp_faults([("pp-positions-shifted", 0, 0)], None)


def test_vllm_split_must_be_tpcheck_partition(monkeypatch):
    """vLLM's own split (what its ranks hold) is checked against tpcheck's partition: equal passes, another (a
    ``VLLM_PP_LAYER_PARTITION`` of the user's) is exit 2's ConfigError with both lists."""
    from impl.config import ConfigError
    from tpcheck.engines.vllm.pp import check_stages
    check_stages(((0, 1), (1, 3), (3, 4)), 4, 3, None)  # vLLM's rule: 1,2,1
    check_stages(((0, 3), (3, 4)), 4, 2, "3,1")
    check_stages(None, 4, 1, None)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    with pytest.raises(ConfigError, match=r"--pp 2: vLLM split the 4 layers \[1, 3\] per stage, tpcheck's partition "
                                          r"is \[2, 2\] \(VLLM_PP_LAYER_PARTITION='1,3', --pp-partition None\)"):
        check_stages(((0, 1), (1, 4)), 4, 2, None)


def _rank(names: list[str], value: float) -> dict:
    return {n: (Replicate(), torch.full((1, 2), value)) for n in names}


def test_stage_points_take_the_owning_stage():
    """pp 2 x tp 2: ranks 0-1 are stage 0, 2-3 stage 1; a point a stage does not compute (stage 1 reporting
    layer 0's) is not taken."""
    s0, s1 = ["embed", "layers.0.out"], ["layers.1.out", "logits", "layers.0.out"]
    pts = stage_points([_rank(s0, 0), _rank(s0, 1), _rank(s1, 2), _rank(s1, 3)], 2, STAGES)
    assert sorted(pts) == ["embed", "layers.0.out", "layers.1.out", "logits"]
    assert [t[0, 0].item() for t in pts["layers.0.out"][1]] == [0, 1]
    assert [t[0, 0].item() for t in pts["logits"][1]] == [2, 3]


def test_handoff_sent_against_received():
    """A boundary's handoff is taken from the receiving stage and held, TP rank by TP rank, to what the sending
    stage sent: equal is no finding; one changed element names the boundary, the stages, the rank and the part."""
    sent = torch.arange(8.0).reshape(2, 4)  # [hidden_states | residual], hidden 2
    ranks = [{"layers.0.handoff": (Replicate(), sent.clone())} for _ in range(4)]
    notes: dict[str, str] = {}
    pts = stage_points(ranks, 2, STAGES, notes=notes)
    assert notes == {} and pts["layers.0.handoff"][1][0].equal(sent)
    ranks[3]["layers.0.handoff"][1][1, 3] += 1  # TP rank 1 of stage 1 received a residual element changed
    stage_points(ranks, 2, STAGES, notes=notes)
    assert re.fullmatch(r"stage boundary 0->1 \(after layer 0\): TP rank 1 of stage 1 received other values than "
                        r"stage 0 sent: 1 of 8 elements \(first at row 1, residual; max \|diff\| 1\)",
                        notes["layers.0.handoff"]), notes
    notes.clear()
    stage_points([{}, {}] + ranks[2:], 2, STAGES, ("layers.1.out",), notes)  # the sender reported none
    assert notes["layers.0.handoff"] == "stage boundary 0->1 (after layer 0): stage 0 reported no hand-off it sent"


def test_silent_stage_is_a_coverage_error():
    expected = ("embed", "layers.0.out", "layers.1.out", "logits")
    with pytest.raises(CoverageError, match=r"pipeline stage 1 \(layers 1-1, ranks 2-3\) reported no point"):
        stage_points([_rank(["embed", "layers.0.out"], 0)] * 2 + [{}, {}], 2, STAGES, expected)
    # a selection that keeps none of stage 1's points expects nothing of it
    assert sorted(stage_points([_rank(["layers.0.out"], 0)] * 2 + [{}, {}], 2, STAGES, ("layers.0.out",))) == [
        "layers.0.out"]


@pytest.mark.parametrize("argv,match", [
    (["--preset", "tiny", "--pp", "3"], "pp_size=3 exceeds num_hidden_layers=2"),
    (["--preset", "small", "--pp", "2", "--pp-partition", "3,2"], r"sums to 5 layers.*num_hidden_layers=4"),
    (["--preset", "small", "--pp", "2", "--pp-partition", "1,2"], r"sums to 3 layers.*num_hidden_layers=4"),
    (["--preset", "small", "--pp", "2", "--pp-partition", "4,0"], r"pp_partition \[4, 0\]: every stage needs"),
    (["--preset", "small", "--pp", "2", "--engine", "hf-tp"], "--pp 2 applies to --engine impl and vllm only"),
])
def test_bad_pp_is_exit_2(argv, match, capsys):
    assert main(["diff", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


CLEAN = [("tiny", 2, 2, "bfloat16", 2, True, None), ("small", 4, 1, "float32", 2, False, None),
         ("small", 2, 1, "float32", 1, False, "3,1")]


@pytest.mark.parametrize("preset,pp,tp,dtype,steps,isolate,partition", CLEAN,
                         ids=["-".join(map(str, c)) for c in CLEAN])
def test_clean_pipelined_impl_passes(preset, pp, tp, dtype, steps, isolate, partition, ckpt, engines):
    r = run_diff(ckpt, engines, preset, tp, dtype, steps, isolate, pp=pp, pp_partition=partition)
    assert r.passed, r.summary() + "\n" + r.table[~r.table.passed].to_string()
    handoffs = stage_handoffs(layer_partition(LAYERS[preset], pp, partition))
    per_step = len(point_names(LAYERS[preset], with_kv=steps > 0, handoffs=handoffs))
    assert len(r.table) == per_step * (steps + 1) * (2 if isolate else 1)  # every stage's points, every step
    assert sorted(set(r.table.point[r.table.kind == "handoff"])) == [f"layers.{i}.handoff" for i in handoffs]
    # each row names the stage that reported its point; the saved document carries it
    assert r.table.stage.tolist() == [point_stage(p, r.meta["stages"]) for p in r.table.point]
    assert {row["stage"] for row in r.to_document()["rows"]} == set(range(pp))
    assert r.meta["pp"] == pp and sum(e - s for s, e in r.meta["stages"]) == LAYERS[preset]


PIPELINE_FAULTS = [n for n, f in FAULTS.items() if f.pp > 1]
ORIGIN = {"pp_residual_not_sent": ("layers.1.input_norm", 0), "pp_final_norm_mid_stage": ("layers.0.handoff", 0),
          "pp_lm_head_untied": ("logits", 0), "pp_stage_relative_positions": ("layers.1.attn.q_rope", 1),
          "pp_boundary_layer_twice": ("layers.1.input_norm", 0), "pp_kv_global_layer_id": ("layers.1.kv.k", 0)}
# a wrong stage input is first caught by --exact-ops (the fault matrix's mode): layer 1's input norm is not what
# HF's norm makes of layer 0's output, the value stage 0 computed; a wrong hand-off (the final norm applied to what
# stage 0 sends) is caught at the boundary's own point, by the noise floor
BY = {"pp_lm_head_untied": "noise floor", "pp_stage_relative_positions": "noise floor",
      "pp_kv_global_layer_id": "noise floor", "pp_final_norm_mid_stage": "noise floor"}


@pytest.mark.parametrize("name", PIPELINE_FAULTS)
def test_pipeline_fault_found_at_its_origin(name, ckpt, engines):
    """Each pipeline fault on its fault-matrix configuration (tiny, tp 1, pp 2: stage 1 starts at layer 1) fails
    the diff first where the faulty stage's work meets the stream; the engine is clean again afterwards."""
    config = M.smallest_config(name, ckpt)
    assert (config["preset"], config["tp"], config["pp"]) == ("tiny", 1, 2)
    row = M.fault_row(name, engines, ckpt)
    assert (row["expected_point"], row["expected_step"]) == ORIGIN[name]
    assert row["ok"] and (row["origin_point"], row["origin_step"]) == ORIGIN[name], row
    assert row["by"] == BY.get(name, "exact ops") and row["excess"] > 1e4, row


def test_pipeline_fault_silent_without_stages(ckpt, engines):
    r = run_diff(ckpt, engines, "tiny", 1, inject=["pp_residual_not_sent"])
    assert r.passed
    assert r.meta["inject_silent"] == {"pp_residual_not_sent": "acts between pipeline stages: shows only with "
                                                               "--pp >= 2, and --pp is 1"}


@pytest.mark.parametrize("name,origin", [("vocab_ids_not_masked", "embed"), ("untied_lm_head", "logits")])
def test_embedding_and_head_faults_land_on_their_stage(name, origin, ckpt, engines):
    """A fault of the embedding (stage 0's) or of the LM head (the last stage's) is applied where the module is
    and skipped on the stages that hold its placeholder: found at its origin, no rank fails."""
    r = run_diff(ckpt, engines, "tiny", 2, inject=[name], pp=2)
    assert not r.passed and r.first_divergence["point"] == origin, r.first_divergence


def test_a_hand_off_passes_on_what_its_stage_sent(ckpt, engines):
    """The hand-off is a copy of the stage's last MLP output and residual stream: judged under a bound no rounding
    meets at both, the MLP output passes as inherited, and so does the copy (before it had no op, and failed)."""
    import tpcheck
    from tpcheck.judge.tolerances import Tolerances
    tight = {k: {"rel_max": {"*": 1e-12}} for k in ("mlp.out", "handoff")}
    r = tpcheck.diff(model=str(ckpt("tiny")), tp=1, pp=2, dtype="bfloat16", prompts=[[3, 9, 27, 81, 5]],
                     decode_steps=1, pool=engines, tolerances=Tolerances(kinds=tight))
    h = r.table[r.table["kind"] == "handoff"]
    assert len(h) == 4 and (h["rel_err"] > 1e-12).all() and h["inherited"].all() and (h["own_err"] == 0).all()
    assert r.passed, r.summary()
