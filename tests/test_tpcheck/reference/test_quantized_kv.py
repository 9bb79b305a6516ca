"""tpcheck on FP8 KV-cache checkpoints (``impl.quant_kv``; the golden rounds keys and values through e4m3 with the
checkpoint's scales, ``tpcheck.reference.quantized``): clean runs with decode pass, each KV-scale fault is found at
its origin with the figure of docs/measured/quantized.md, float32 is refused with the reason."""
from __future__ import annotations

import math

import pytest

import tpcheck
from test_quantized import KV_FAULTS, readme_quant_excess  # docs/measured/quantized.md's quantization fault table
from tpcheck.cli import fault_matrix as M
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import get_fault


@pytest.mark.parametrize("preset,tp,dtype", [("small-fp8-kv-head", 4, "float16")])  # per head, replicated, decode
def test_clean_kv_cache_run_passes(preset, tp, dtype, ckpt, engines):
    r = tpcheck.diff(model=str(ckpt(preset)), tp=tp, dtype=dtype, decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert r.table["point"].str.endswith("kv.v").any()  # the cache's dequantized values are compared


@pytest.mark.parametrize("name", KV_FAULTS)
def test_kv_scale_fault_found_at_its_origin(name, ckpt, engines):
    row = M.fault_row(name, engines, ckpt)
    assert row["detected"] and row["ok"], row
    assert (row["origin_point"], row["origin_step"]) == (get_fault(name).origin(0), 0), row
    assert math.isclose(row["excess"], readme_quant_excess()[name], rel_tol=0.03), row["excess"]


def test_float32_kv_cache_run_refused_with_the_reason(ckpt, capsys):
    assert main(["diff", "--model", str(ckpt("small-fp8-kv")), "--tp", "1", "--dtype", "float32"]) == 2
    assert "near tie" in capsys.readouterr().err
