"""tpcheck on 4-bit GPTQ checkpoints (``impl.quant_gptq``, ``tpcheck.inputs.models.quantize_gptq``,
``tpcheck.reference.gptq``): the quantizer writes vLLM's layout, clean runs pass (with and without act-order), each
GPTQ fault is found at its origin with the figure of docs/measured/quantized.md."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tpcheck
from tpcheck.cli import fault_matrix as M
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import FAULTS, get_fault
from tpcheck.inputs.models.quantize_gptq import quantize_any

GPTQ_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_gptq"]


def readme_quant_excess() -> dict[str, float]:
    """docs/measured/quantized.md's quantization fault table (INT8 and GPTQ rows): {fault: its excess over threshold}."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "measured" / "quantized.md").read_text()
    table = text[text.index("| quantization fault | config | origin | flagged by | excess |"):]
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in table.split("\n\n", 1)[0].splitlines()[2:])
    return {c[0]: float(re.fullmatch(r"([\d.]+)x", c[-1]).group(1)) for c in rows}


def test_quantizer_writes_the_gptq_layout(ckpt):
    d = ckpt("small-gptq-act")
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == ("gptq", 4, 32, True, True)
    with safe_open(d / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.mlp.down_proj."  # [out 128, in 256]
        assert p + "weight" not in keys
        t = {n: f.get_tensor(p + n) for n in ("qweight", "qzeros", "scales", "g_idx")}
        g_q, g_k = (f.get_tensor(f"model.layers.0.self_attn.{s}_proj.g_idx") for s in "qk")
    assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (32, 128))
    assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (8, 16))
    assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (8, 128))
    assert t["qzeros"].eq(0x77777777).all()  # zero 8, stored minus one
    counts = torch.bincount(t["g_idx"].long())
    assert counts.tolist() == [32] * 8 and not torch.equal(t["g_idx"].long(), torch.arange(256) // 32)
    assert torch.equal(g_q, g_k)  # one input, one permutation


@pytest.mark.parametrize("preset,tp,dtype", [("small-gptq", 2, "bfloat16"), ("small-gptq-act", 4, "float16"),
                                             ("small-gptq", 2, "float32")])  # W4A16: float32 allowed
def test_clean_gptq_run_passes(preset, tp, dtype, ckpt, engines):
    r = tpcheck.diff(model=str(ckpt(preset)), tp=tp, dtype=dtype, decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert r.table["point"].str.endswith("attn.out").any()


def found_at_its_origin(name: str, ckpt, engines) -> None:
    """The fault matrix's row of a 4-bit fault: found at its origin in layer 0, docs/measured/quantized.md's excess within 3%."""
    row = M.fault_row(name, engines, ckpt)
    assert row["detected"] and row["ok"], row
    assert (row["origin_point"], row["origin_step"]) == (get_fault(name).origin(0), 0), row
    assert math.isclose(row["excess"], readme_quant_excess()[name], rel_tol=0.03), row["excess"]


@pytest.mark.parametrize("name", GPTQ_FAULTS)
def test_gptq_fault_found_at_its_origin(name, ckpt, engines):
    found_at_its_origin(name, ckpt, engines)


def test_row_shard_not_whole_groups_refused_naming_the_layer(ckpt, tmp_path, capsys):
    """small-hd32's o_proj (input 128) at tp 4 with group 64: 32 rows a rank."""
    d = quantize_any(ckpt("small-hd32"), tmp_path / "g64", "gptq-w4g64")
    assert main(["diff", "--model", str(d), "--tp", "4", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.o_proj" in err and "32 input rows" in err and "group_size 64" in err
