"""tpcheck's own reading of the quantized formats (``tpcheck.reference.formats``, the golden's) against impl's
(``impl.quant*``, the engine's), on every scheme's preset tensors and on drawn activations: equal to the bit, so a
bug in either reader shows here; and a reader that gets the format wrong (AWQ's interleaved order ignored, GPTQ's
zero point without its +1, rounding down) differs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from impl import quant, quant_awq, quant_fp8, quant_gptq, quant_kv
from tpcheck.reference import formats as F

LAYERS = [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]


def _tensors(ckpt, preset) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ckpt(preset)) / "model.safetensors"))


@pytest.mark.parametrize("preset", ["small-gptq", "small-gptq-act"])
def test_gptq_read_as_impl_reads_it(ckpt, preset):
    t = _tensors(ckpt, preset)
    for m in LAYERS:
        parts = [t[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")]
        assert torch.equal(F.gptq_weight(*parts), quant_gptq.dequantize(*parts, dtype=torch.float64)), m


def test_awq_read_as_impl_reads_it_and_not_in_sequential_order(ckpt):
    t = _tensors(ckpt, "small-awq")
    for m in LAYERS:
        parts = [t[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales")]
        mine = F.awq_weight(*parts)
        assert torch.equal(mine, quant_awq.dequantize(*parts, dtype=torch.float64)), m
        q, z = quant_gptq.unpack_cols(parts[0]), quant_gptq.unpack_cols(parts[1])  # the interleave ignored
        g = torch.arange(q.shape[0]) // (q.shape[0] // parts[2].shape[0])
        assert not torch.equal(mine, parts[2].double()[g] * (q - z[g]).double()), m


def test_gptq_v1_zero_is_stored_minus_one(ckpt):
    t = _tensors(ckpt, "small-gptq")
    m = LAYERS[0]
    parts = [t[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")]
    q = quant_gptq.unpack_rows(parts[0])
    z = quant_gptq.unpack_cols(parts[1])  # without the +1: off by one scale everywhere
    assert not torch.equal(F.gptq_weight(*parts), parts[2].double()[parts[3].long()] * (q - z[parts[3].long()]))


def _activations(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 64, generator=g, dtype=torch.float64) * 3
    x[2] = 0  # a zero row: scale 1
    x[3, :5] = torch.tensor([0.5, 1.5, -2.5, 127.5, 1000.0]) * (x[3].abs().max() / 127)  # ties near the grid
    return x


@pytest.mark.parametrize("work", [torch.float64, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_activations_quantized_as_impl_quantizes_them(work, dtype):
    x = _activations().to(dtype)
    scale = torch.tensor([0.02], dtype=torch.float32)
    for num_type, per_token, static in (("int", quant.quantize_per_token, quant.quantize_static),
                                        ("float", quant_fp8.quantize_fp8_per_token, quant_fp8.quantize_fp8_static)):
        q, s = F.quantize_activation(x, num_type, work)
        q_impl, s_impl = per_token(x, work)
        assert torch.equal(q, q_impl) and torch.equal(s, s_impl), num_type
        q, _ = F.quantize_activation(x, num_type, work, scale)
        assert torch.equal(q, static(x, scale, work)), num_type
    floor = torch.floor(x.to(work) / s_impl).clamp(-128, 127)  # rounding down: another reading, caught
    assert not torch.equal(F.quantize_activation(x, "int", work)[0], floor)


def test_fp8_requantize_to_max_and_kv_cache_as_impl(ckpt):
    t = _tensors(ckpt, "small-fp8-tensor")
    for i in (0, 1):
        names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        scales = torch.cat([t[n + "_scale"].reshape(1) for n in names])
        mine, s_mine = F.requantize_to_max([t[n] for n in names], scales)
        theirs, s_theirs = quant_fp8.requantize_to_max([t[n] for n in names], scales, torch.float64)
        assert torch.equal(s_mine, s_theirs)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(mine, theirs))
    x = _activations(1).reshape(9, 4, 16)
    s = torch.tensor([0.01, 0.02, 0.005, 0.04]).reshape(1, 4, 1)
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        assert torch.equal(F.fake_quant_kv(x.to(dtype), s), quant_kv.fake_quant_kv(x.to(dtype), s)), dtype
