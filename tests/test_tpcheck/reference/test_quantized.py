"""tpcheck on quantized checkpoints (INT8 and FP8 W8A8, compressed-tensors; ``impl.quant``, ``tpcheck.reference.quantized``):
clean runs pass, each quantization fault is found at its origin (with the figure of docs/measured/quantized.md), and what is not
supported yet is refused with the reason (exit 2)."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

import tpcheck
from tpcheck.cli import fault_matrix as M
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import FAULTS, get_fault

QUANT_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant"]
#: GPTQ's and AWQ's (tests/test_tpcheck/reference/test_quantized_gptq.py, test_quantized_awq.py check them); docs/measured/quantized.md's
#: table lists them all
GPTQ_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ in ("tpcheck.engines.impl.faults.quant_gptq",
                                                                      "tpcheck.engines.impl.faults.quant_awq")]
#: the FP8 KV cache's (tests/test_tpcheck/reference/test_quantized_kv.py)
KV_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_kv"]


@pytest.mark.parametrize("preset,tp,dtype", [("small-w8a8", 2, "bfloat16"), ("small-w8a8-tensor", 4, "float16"),
                                              ("small-fp8", 2, "bfloat16"), ("small-fp8-tensor", 2, "bfloat16"),
                                              ("small-fp8-static", 2, "bfloat16")])
def test_clean_quantized_run_passes(preset, tp, dtype, ckpt, engines):
    r = tpcheck.diff(model=str(ckpt(preset)), tp=tp, dtype=dtype, decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert r.table["point"].str.endswith("attn.q").any()  # the quantized linears' outputs are compared


def readme_quant_excess() -> dict[str, float]:
    """The quantization fault table of docs/measured/quantized.md: {fault: its excess over threshold}."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "measured" / "quantized.md").read_text()
    table = text[text.index("| quantization fault | config | origin | flagged by | excess |"):]
    out = {}
    for line in table.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = float(re.fullmatch(r"([\d.]+)x", cells[-1]).group(1))
    return out


def test_readme_table_lists_every_quantization_fault():
    assert set(readme_quant_excess()) == set(QUANT_FAULTS + GPTQ_FAULTS + KV_FAULTS) and len(QUANT_FAULTS) >= 4


@pytest.mark.parametrize("name", QUANT_FAULTS)
def test_quantization_fault_found_at_its_origin(name, ckpt, engines):
    row = M.fault_row(name, engines, ckpt)
    assert row["detected"] and row["ok"], row
    assert (row["origin_point"], row["origin_step"]) == (get_fault(name).origin(0), 0), row
    assert M.smallest_config(name, ckpt)["dtype"] == "bfloat16"  # float32 quantized runs are refused
    assert math.isclose(row["excess"], readme_quant_excess()[name], rel_tol=0.03), row["excess"]


def test_float32_quantized_run_refused_with_the_reason(ckpt, capsys):
    assert main(["diff", "--model", str(ckpt("small-w8a8")), "--tp", "1", "--dtype", "float32"]) == 2
    assert "near tie" in capsys.readouterr().err


def test_unsupported_quantization_refused_naming_the_field(ckpt, tmp_path, capsys):
    d = tmp_path / "bnb"
    shutil.copytree(ckpt("small-w8a8"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["diff", "--model", str(d), "--tp", "1", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "quant_method = 'bitsandbytes'" in err and "compressed-tensors" in err


def test_float_config_with_quantized_tensors_names_the_reason(ckpt, tmp_path, capsys):
    d = tmp_path / "noconfig"
    shutil.copytree(ckpt("small-w8a8"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["diff", "--model", str(d), "--tp", "1", "--dtype", "bfloat16"]) == 2
    assert "quantization_config" in capsys.readouterr().err
