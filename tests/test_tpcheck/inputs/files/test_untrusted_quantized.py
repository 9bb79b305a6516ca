"""Untrusted quantized checkpoints and the runs over them: a broken scale, zero point or index, a tensor of the wrong
dtype, a layer no stage owns, a quantization fault with nothing to act on: each exit 2 naming the tensor (or the
fault), the rule and the value found, before any engine starts; never a verdict about the engine (exit 1) or an
internal error (exit 3)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from impl.config import load_config
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import FAULTS
from tpcheck.inputs.files.quant_check import QuantTensorError, check_quantized_checkpoint
from tpcheck.inputs.models.presets import QUANTIZED

Q = "model.layers.0.self_attn.q_proj."
NAN, INF = float("nan"), float("inf")


def _edited(src, tmp_path, name: str, change) -> str:
    """A copy of checkpoint ``src`` with tensor ``name`` changed (``change(t)``)."""
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(f))
    return str(d)


@pytest.mark.parametrize("preset", sorted(QUANTIZED))
def test_every_quantized_preset_passes_the_checks(ckpt, preset):
    d = ckpt(preset)
    check_quantized_checkpoint(d, load_config(d))


@pytest.mark.parametrize("preset,name,change,needle", [
    ("small-w8a8", Q + "weight_scale", lambda t: t.to(torch.int8), "weight_scale: a weight scale must be float64 or "
                                                                   "float32 or float16 or bfloat16, found int8"),
    ("small-w8a8", Q + "weight_scale", lambda t: t * 0, "weight_scale: a weight scale must be positive and finite, "
                                                        "found 0.0 at [0, 0]"),
    ("small-w8a8", Q + "weight_scale", lambda t: -t, "weight_scale: a weight scale must be positive and finite, found -"),
    ("small-w8a8", Q + "weight_scale", lambda t: t * NAN, "must be positive and finite, found nan"),
    ("small-w8a8", Q + "weight", lambda t: t.float(), "q_proj.weight: an INT8 W8A8 weight (the loader would cast it, "
                                                      "the golden would not) must be int8, found float32"),
    ("small-w8a8-tensor", Q + "weight_scale", lambda t: t.reshape(1, 1),
     "a tensor weight scale must have shape [1] or [], found [1, 1]"),
    ("small-fp8", Q + "weight", lambda t: t.to(torch.bfloat16), "must be float8_e4m3fn, found bfloat16"),
    ("small-fp8-static", Q + "input_scale", lambda t: t * INF, "input_scale: an input scale must be positive and "
                                                               "finite, found inf"),
    ("small-gptq-act", Q + "g_idx", lambda t: t + 100, "g_idx: every g_idx must be a group in [0, 4) (scales has 4 "
                                                               "rows), found 102 at [0]"),
    ("small-gptq-act", Q + "g_idx", lambda t: t - 1, "g_idx: every g_idx must be a group in [0, 4) (scales has 4 "
                                                              "rows), found -1"),
    ("small-gptq", Q + "qzeros", lambda t: t + 1, "qzeros: symmetric GPTQ (sym: true) fixes every zero point at 8"),
    ("small-gptq", Q + "scales", lambda t: -t, "scales: a GPTQ scale must be positive and finite"),
    ("small-gptq", Q + "qweight", lambda t: t.to(torch.int64), "qweight: a GPTQ qweight (eight 4-bit values packed "
                                                               "per word) must be int32, found int64"),
    ("small-awq", Q + "scales", lambda t: t[0], "AWQ scales must be 2-D [groups, out], found [128]"),
    ("small-w8a8", Q + "weight_scale", lambda t: t.reshape(1, -1), "a channel weight scale must have shape [out, 1], "
                                                                   "found [1, 128]"),
    ("small-awq", Q + "scales", lambda t: t * 0, "scales: an AWQ scale must be positive and finite, found 0.0"),
    ("small-fp8-kv-head", "model.layers.0.self_attn.k_scale", lambda t: t * NAN,
     "k_scale: an FP8 KV-cache scale must be positive and finite, found nan at [0, 0, 0]"),
    ("small-fp8-kv", "model.layers.1.self_attn.v_scale", lambda t: t.reshape(1, 1),
     "must have shape [1] or [], found [1, 1]"),
])
def test_a_broken_quantized_tensor_is_named(ckpt, tmp_path, preset, name, change, needle):
    d = _edited(ckpt(preset), tmp_path, name, change)
    with pytest.raises(QuantTensorError) as e:
        check_quantized_checkpoint(d, load_config(d))
    assert needle in str(e.value), str(e.value)
    assert str(e.value).startswith(f"model.safetensors: {name}: ")


def _no_engine(monkeypatch):
    import tpcheck.engines.impl.adapter as impl_engine
    monkeypatch.setattr(impl_engine, "start", lambda *a, **k: pytest.fail("an engine started"))


@pytest.mark.parametrize("preset,name,change,needle", [
    ("small-w8a8", Q + "weight_scale", lambda t: -t, "weight_scale: a weight scale must be positive and finite"),
    ("small-w8a8", Q + "weight", lambda t: t.float(), "must be int8, found float32"),
    ("small-gptq-act", Q + "g_idx", lambda t: t + 100, "g_idx: every g_idx must be a group in [0, 4)"),
])
def test_a_broken_quantized_checkpoint_is_refused_before_any_engine(ckpt, tmp_path, capsys, monkeypatch, preset,
                                                                   name, change, needle):
    _no_engine(monkeypatch)
    d = _edited(ckpt(preset), tmp_path, name, change)
    code = main(["diff", "--model", d, "--tp", "2", "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("preset,fault,needle", [
    ("tiny", "qkv_scale_k_v_swapped", "acts on an INT8 / FP8 W8A8 checkpoint's weight scales (weight_scale), and "
                                      "--model is a float checkpoint (no quantization_config)"),
    ("small-w8a8", "gptq_every_rank_rank0_qweight", "acts on a GPTQ checkpoint's packed tensors"),
    ("small-w8a8", "fp8_input_scale_rank0_only", "acts on static W8A8 input scales"),
    ("small-w8a8-tensor", "row_scale_sharded_by_output", "acts on per-channel W8A8 weight scales"),
    ("small-fp8-kv", "kv_head_scales_rank0", "acts on an FP8 KV cache's per-head scales"),
])
def test_a_quantization_fault_with_nothing_to_act_on_is_refused(ckpt, capsys, monkeypatch, preset, fault, needle):
    _no_engine(monkeypatch)
    code = main(["diff", "--model", str(ckpt(preset)), "--tp", "2", "--dtype", "bfloat16", "--inject", fault])
    err = capsys.readouterr().err
    assert code == 2 and f"--inject {fault} {needle}" in err, err


def test_every_quantization_fault_declares_what_it_needs():
    quant = [n for n, f in FAULTS.items() if f.patch.__module__.startswith("tpcheck.engines.impl.faults.quant")]
    assert len(quant) >= 16 and all(FAULTS[n].needs is not None for n in quant)


@pytest.mark.parametrize("extra,pp,needle", [
    ("model.layers.7.mlp.extra.weight", 1, "layer 7 is past the model's 2 layers"),
    ("model.layers.2.input_layernorm.weight", 2, "layer 2 is past the model's 2 layers"),
    ("model.layers.x.mlp.weight", 1, "its layer index 'x' is not a number"),
])
def test_a_layer_no_stage_owns_is_refused(ckpt, tmp_path, capsys, extra, pp, needle):
    d = _edited(ckpt("tiny"), tmp_path, "model.norm.weight", lambda t: t)
    tensors = load_file(f"{d}/model.safetensors")
    tensors[extra] = torch.zeros(4)
    save_file(tensors, f"{d}/model.safetensors")
    code = main(["diff", "--model", d, "--tp", "1", "--pp", str(pp), "--decode-steps", "0", "--seq-len", "4",
                 "--batch", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"unexpected tensor {extra!r} in model.safetensors" in err and needle in err, err
    assert "internal error" not in err
