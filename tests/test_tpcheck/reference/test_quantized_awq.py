"""tpcheck on 4-bit AWQ checkpoints (``impl.quant_awq``, ``tpcheck.inputs.models.quantize_awq``, ``tpcheck.reference.gptq``):
the quantizer writes AutoAWQ's GEMM layout, clean runs pass, each AWQ fault is found at its origin with the figure of
docs/measured/quantized.md, bad checkpoints are refused naming the tensor or field (exit 2)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tpcheck
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import FAULTS
from tpcheck.inputs.models.quantize_awq import quantize_any
from test_quantized_gptq import found_at_its_origin

AWQ_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_awq"]
P = "model.layers.0.mlp.down_proj."  # [out 128, in 256]


def test_quantizer_writes_the_awq_layout(ckpt):
    d = ckpt("small-awq")
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["zero_point"], qc["version"]) == \
        ("awq", 4, 32, True, "gemm")
    with safe_open(d / "model.safetensors", framework="pt") as f:
        assert P + "weight" not in set(f.keys()) and P + "g_idx" not in set(f.keys())
        t = {n: f.get_tensor(P + n) for n in ("qweight", "qzeros", "scales")}
    assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (256, 16))  # packed along the output
    assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (8, 16))
    assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (8, 128))


@pytest.mark.parametrize("tp,dtype", [(4, "float16")])  # the rest: docs/measured/quantized.md's sweep
def test_clean_awq_run_passes(tp, dtype, ckpt, engines):
    r = tpcheck.diff(model=str(ckpt("small-awq")), tp=tp, dtype=dtype, decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert r.table["point"].str.endswith("attn.out").any()


@pytest.mark.parametrize("name", AWQ_FAULTS)
def test_awq_fault_found_at_its_origin(name, ckpt, engines):
    found_at_its_origin(name, ckpt, engines)


def test_row_shard_straddling_a_group_refused_naming_the_layer(ckpt, tmp_path, capsys):
    """small-hd32's o_proj (input 128) at tp 4 with group 64: 32 rows a rank."""
    d = quantize_any(ckpt("small-hd32"), tmp_path / "g64", "awq-w4g64")
    assert main(["diff", "--model", str(d), "--tp", "4", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.o_proj" in err and "32 input rows" in err and "group_size 64" in err


def _edited(src, dst, tensors=None, qc=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if qc is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"].update(qc)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("what,edit,qc,message", [
    ("qweight in GPTQ's shape", lambda s: s.update({P + "qweight": s[P + "qweight"].reshape(32, 128)}), None,
     [f"tensor '{P}qweight'", "[32, 128] != expected [256, 16]"]),
    ("no qzeros", lambda s: s.pop(P + "qzeros"), None, ["lacks 1 tensor", f"{P}qzeros"]),
    ("zero_point false", None, {"zero_point": False}, ["zero_point = False"]),
    ("group size 48", None, {"group_size": 48}, ["group_size = 48"]),
])
def test_bad_awq_checkpoint_refused_naming_it(what, edit, qc, message, ckpt, tmp_path, capsys):
    d = _edited(ckpt("small-awq"), tmp_path / "bad", edit, qc)
    assert main(["diff", "--model", str(d), "--tp", "2", "--dtype", "bfloat16"]) == 2, what
    err = capsys.readouterr().err
    assert all(m in err for m in message), err[-2000:]
