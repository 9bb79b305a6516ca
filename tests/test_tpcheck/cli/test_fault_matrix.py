"""tpcheck.cli.fault_matrix: every fault, on the smallest configuration where it shows, is caught by its check
(``tpcheck diff`` at the expected origin and step; the memory check for the memory fault), and clean runs
of every configuration used raise no alarm in float32 and bfloat16."""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest

from tpcheck.cli import fault_matrix as M
from tpcheck.cli import fault_matrix_command
from tpcheck.engines.impl.faults import FAULTS, get_fault


# the smallest configuration of each fault: (preset, tp, dtype, decode layout?)
SMALLEST = {
    "nan_causal_mask": ("tiny", 1, "float32", False),
    "qkv_shard_dim1": ("tiny", 2, "float32", False),
    "rope_skipped": ("tiny", 1, "float32", False),
    "qkv_bias_missing": ("tiny", 1, "float32", False),
    "gqa_cache_repeated_heads": ("tiny", 1, "float32", True),
    "kv_replica_index": ("tiny", 4, "float32", False),
    "row_bias_every_rank": ("tiny", 2, "float32", False),
    "gate_up_swapped": ("tiny", 1, "float32", False),
    "skip_o_proj_allreduce": ("tiny", 2, "float32", False),
    "decode_position_off_by_one": ("tiny", 1, "float32", True),
    "untied_lm_head": ("tiny", 1, "float32", False),
    "rope_wrong_layout": ("tiny", 1, "float32", False),
    "full_state_dict_every_rank": ("tiny", 2, "float32", False),
    "vocab_ids_not_masked": ("tiny", 2, "float32", False),
    "every_rank_loads_rank0_shard": ("tiny", 2, "float32", False),
    "rmsnorm_weight_before_cast": ("tiny", 1, "bfloat16", False),
    "rope_theta_default": ("tiny-mqa", 1, "float32", False),  # tiny's rope_theta is the default 10000
    "slot_mapping_off_by_one_at_block_boundary": ("tiny", 1, "float32", True),
    "allreduce_low_precision": ("tiny", 2, "float32", False),
    "residual_gain": ("tiny", 1, "float32", False),
}
# decode faults: the step of the origin (gqa: the prefill's cache readback already holds repeated heads;
# slot mapping: prompts of 6 and 14 tokens, block 8, cross a block boundary at decode step 3)
STEP = {"gqa_cache_repeated_heads": 0, "decode_position_off_by_one": 1, "slot_mapping_off_by_one_at_block_boundary": 3}

# the family faults (tpcheck.engines.impl.faults.families) run on the other families' presets: tests/test_tpcheck/engines/impl/test_family_presets.py
# (the MoE faults on the MoE presets: tests/test_tpcheck/judge/test_routing.py; the quantization faults on the quantized
# presets: tests/test_tpcheck/reference/test_quantized.py, test_quantized_gptq.py, test_quantized_awq.py and
# test_quantized_kv.py; the pipeline
# faults at --pp 2: tests/test_tpcheck/pipeline/test_pipeline_diff.py; Gemma 3's own on its presets: tests/test_tpcheck/engines/impl/test_gemma3.py;
# the invariance faults by tpcheck invariance: tests/test_tpcheck/pipeline/test_invariance.py)
CATALOG = [n for n, f in FAULTS.items() if f.patch.__module__ not in (
    "tpcheck.engines.impl.faults.families", "tpcheck.engines.impl.faults.moe", "tpcheck.engines.impl.faults.quant", "tpcheck.engines.impl.faults.gemma",
    "tpcheck.engines.impl.faults.quant_gptq", "tpcheck.engines.impl.faults.quant_awq", "tpcheck.engines.impl.faults.quant_kv",
    "tpcheck.engines.impl.faults.pipeline", "tpcheck.engines.impl.faults.invariance")]
DIFF_FAULTS = [n for n in CATALOG if FAULTS[n].check == "diff"]
# the check expected to flag each origin (the rest: the noise floor)
BY = {"nan_causal_mask": "NaN", "rmsnorm_weight_before_cast": "exact ops", "gqa_cache_repeated_heads": "shape",
      "kv_replica_index": "ranks disagree", "skip_o_proj_allreduce": "ranks disagree",
      "residual_gain": "exact ops"}  # its float32 gain is 1e5 roundings; its bfloat16 one: test_gain_runs.py


def test_every_fault_has_a_smallest_config(ckpt):
    assert set(SMALLEST) == set(CATALOG)
    for name, (preset, tp, dtype, decode) in SMALLEST.items():
        c = M.smallest_config(name, ckpt)
        assert (c["preset"], c["tp"], c["dtype"]) == (preset, tp, dtype), name
        assert c == dict(preset=preset, tp=tp, dtype=dtype, **(M.DECODE if decode else M.PREFILL)), name
        assert M.expected_step(get_fault(name), c) == STEP.get(name, 0), name
    # 5 distinct layouts (tiny tp 1/2/4 prefill, tiny tp 1 decode, tiny-mqa tp 1), each clean in float32 and bfloat16
    layouts = M.clean_configs([M.smallest_config(n, ckpt) for n in CATALOG])
    assert len(layouts) == 2 * 5 and {c["dtype"] for c in layouts} == {"float32", "bfloat16"}


def readme_excess() -> dict[str, list[float]]:
    """The fault catalog table of docs/measured/faults.md: {fault: its excess over threshold} where the figure is a
    number; a cell of two (``8.40e5x / 8.71e5x``) holds the figures of two CPUs (that page: their kernels round
    differently)."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "measured" / "faults.md").read_text()
    table = text[text.index("| fault | config | detected | origin found | flagged by | excess over threshold |"):]
    out = {}
    for line in table.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        figs = [re.fullmatch(r"([\d.]+)(?:e(\d+))?x", f) for f in cells[-1].split(" / ")]
        if all(figs):
            out[cells[0]] = [float(m.group(1)) * 10 ** int(m.group(2) or 0) for m in figs]
    return out


README_EXCESS = readme_excess()


def test_readme_fault_table_is_read():
    # the parser must see the figures (one that found none would check nothing)
    assert set(DIFF_FAULTS) - {"nan_causal_mask", "gqa_cache_repeated_heads"} <= set(README_EXCESS)


@pytest.mark.parametrize("name", DIFF_FAULTS)
def test_fault_detected_at_expected_origin(name, ckpt, engines):
    row = M.fault_row(name, engines, ckpt)
    assert row["expected_point"] == get_fault(name).origin(0)
    assert row["expected_step"] == STEP.get(name, 0)
    assert row["detected"], f"{name}: tpcheck diff passed ({row['note']})"
    assert (row["origin_point"], row["origin_step"]) == (row["expected_point"], row["expected_step"]), row
    assert row["ok"]
    assert row["by"] == BY.get(name, "noise floor"), row
    if name in README_EXCESS:  # docs/measured/faults.md's figure (tpcheck faults matrix) still holds, within its stated 3%
        assert any(math.isclose(row["excess"], f, rel_tol=0.03) for f in README_EXCESS[name]), \
            (row["excess"], README_EXCESS[name])


def test_memory_fault_flagged_by_memory_check_not_by_diff(ckpt, engines):
    row = M.fault_row("full_state_dict_every_rank", engines, ckpt)
    assert row["check"] == "memory" and row["detected"] and row["ok"], row["note"]
    assert "diff passes" in row["note"]  # the numerics are untouched
    llm = engines.get(ckpt("tiny"), 2)
    m = M.memory_check(llm, ["full_state_dict_every_rank"])
    assert not M.memory_check(llm)["flagged"]  # the engine was restored
    assert m["share_over_checkpoint"] == pytest.approx(0.5, abs=0.05)
    for clean, bad in zip(m["clean"], m["ranks"]):  # each rank: its share clean, share + checkpoint faulty
        assert clean["tensor_bytes"] <= M.MEM_FACTOR * m["share_bytes"]
        assert bad["tensor_bytes"] >= clean["tensor_bytes"] + m["checkpoint_bytes"]
        assert bad["param_bytes"] == clean["param_bytes"]


CLEAN = M.clean_configs([dict(preset=p, tp=tp, dtype=d, **(M.DECODE if dec else M.PREFILL))
                         for p, tp, d, dec in SMALLEST.values()])


@pytest.mark.parametrize("config", CLEAN, ids=[f"{c['preset']}-tp{c['tp']}-{c['dtype']}-{c['decode_steps']}steps"
                                               for c in CLEAN])
def test_clean_config_no_false_alarm(config, ckpt, engines):
    row = M.clean_row(config, engines, ckpt)
    assert not row["detected"] and row["ok"], row["note"]


def test_cli_matrix_table_exit_codes_and_json(ckpt, engines, tmp_path, capsys, monkeypatch):
    ap = argparse.ArgumentParser()
    fault_matrix_command.register(ap.add_subparsers(dest="action"))
    out = tmp_path / "m.json"
    args = ap.parse_args(["matrix", "--faults", "rope_skipped,vocab_ids_not_masked", "--json", str(out)])
    assert fault_matrix_command.run(args, pool=engines, ckpt=ckpt) == 0
    text = capsys.readouterr().out
    assert "layers.0.attn.q_rope @ step 0" in text and "embed @ step 0" in text and "PASS: 2/2 faults" in text
    data = json.loads(out.read_text())
    assert data["passed"]
    assert [r["fault"] for r in data["rows"]] == ["rope_skipped", "vocab_ids_not_masked"] + ["(clean)"] * 4
    # an undetected fault makes the matrix fail: without exact ops, the RMSNorm cast order passes the gate
    args = ap.parse_args(["matrix", "--faults", "rmsnorm_weight_before_cast", "--no-clean"])
    assert fault_matrix_command.run(args, pool=engines, ckpt=ckpt) == 0
    assert "exact ops" in capsys.readouterr().out
    monkeypatch.setattr(M, "EXACT_OPS", False)
    assert fault_matrix_command.run(args, pool=engines, ckpt=ckpt) == 1
    assert "MISS" in capsys.readouterr().out
    with pytest.raises(ValueError, match="known faults"):
        fault_matrix_command.run(ap.parse_args(["matrix", "--faults", "nope"]), pool=engines, ckpt=ckpt)


def test_depth_axis_finds_each_fault_in_the_layer_it_was_injected(ckpt, engines):
    """``tpcheck faults matrix --depth``: a per-layer fault injected into the first, the middle and the last layer
    is found in that layer, and each row notes the propagated pass's excess there."""
    from tpcheck.cli.fault_depth import depth_layers, run_depth
    assert depth_layers(24) == [0, 12, 23] and depth_layers(4) == [0, 2, 3] and depth_layers(1) == [0]
    df = run_depth(["qkv_bias_missing", "gate_up_swapped", "untied_lm_head"], pool=engines, ckpt=ckpt,
                   presets=["small"], tps=[2], dtypes=["bfloat16"])
    assert len(df) == 6 and df["ok"].all(), df[["fault", "config", "origin", "note"]]  # untied_lm_head: not per layer
    assert sorted(df["inject_layer"]) == [0, 0, 2, 2, 3, 3]
    assert all(p.startswith(f"layers.{i}.") for p, i in zip(df["origin_point"], df["inject_layer"]))
    assert df["note"].str.contains("propagated pass there: ").all()


def test_a_moe_fault_goes_to_the_sparse_layers_only(ckpt, engines):
    """``tiny-qwen2-moe``'s layer 1 is dense (``mlp_only_layers``): a MoE fault cannot show there, so the depth axis
    injects it into the first, middle and last *sparse* layer, and a diff that puts it into layer 1 says why it
    must pass."""
    from impl.config import load_config
    from tpcheck.cli.fault_depth import depth_layers, run_depth
    from tpcheck.inputs.models.checkpoints import preset_available
    from tpcheck.engines.impl.faults import get_fault
    if not preset_available("tiny-qwen2-moe"):
        pytest.skip("the MoE presets need transformers 5 (tpcheck.inputs.models.presets.preset_available)")
    cfg = load_config(ckpt("tiny-qwen2-moe"))
    fault = get_fault("moe_wrong_combine_weights")
    assert [fault.shows_in_layer(cfg, i) for i in range(3)] == [True, False, True]
    assert depth_layers(3, lambda i: fault.shows_in_layer(cfg, i)) == [0, 2]
    assert "layer 1 of this model is dense" in fault.silent_because(cfg, 1, "float32", 0, False, layer=1)
    df = run_depth(["moe_wrong_combine_weights"], pool=engines, ckpt=ckpt)
    assert sorted(df["inject_layer"]) == [0, 2] and df["ok"].all(), df[["fault", "config", "origin", "note"]]
