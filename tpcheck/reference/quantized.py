"""The reference models of a quantized checkpoint (``impl.quant``: INT8 W8A8, ``impl.quant_fp8``: FP8 W8A8,
compressed-tensors; 4-bit GPTQ / AWQ W4A16, ``impl.quant_gptq`` / ``impl.quant_awq``: dequantized weights only,
``tpcheck.reference.gptq``):
a golden that means what the checkpoint means.

FP8 reads the same way with ``q_x = e4m3(clamp(x / s_x, -448, 448))``, ``s_x = max|x_t| / 448`` (the format's
rule, read by ``tpcheck.reference.formats``, not by impl's code, in float64) and e4m3 weights; with per-tensor scales, each fused group (q/k/v,
gate/up) is first re-quantized to its maximum scale, as the engine fuses and re-quantizes it at load.

A W8A8 linear computes ``y = s_x s_w (q_x W_q^T)`` with ``q_x = clamp(round(x / s_x), -128, 127)`` per token. The
golden is Hugging Face's own model with every quantized linear's weight **dequantized** (``W_q * s_w``, exact in
float64) and its input **fake-quantized** by a forward pre-hook (``x -> q_x * s_x``, the rounding rule, scale and
clamp of the engine): in float64 its output is that formula with exact integer products, so it differs from a
correct engine only by the engine's float rounding of the scales and the cast of the result, and by activations
that sit within float noise of a rounding boundary (a near tie: one quantization step apart, legitimately).

The noise-floor references are the same model at the run's dtype: dequantized weights rounded to the dtype, the
input scale computed in float32 from the dtype's activations (as the engines do) and the fake-quantized input cast
back to the dtype. They are one correct implementation among many (the fake-quant one), with their own near ties,
so the floor admits what quantizing noisy activations does.

transformers cannot build these models itself without the ``compressed-tensors`` package (and would run its own
kernels if it could): the model is built from its config with ``quantization_config`` removed, and its state dict
is read tensor by tensor from the safetensors files (never pickle)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from impl.config import load_config, parse_dtype
from impl.loader import checkpoint_files
from tpcheck.reference.formats import E4M3 as FP8
from tpcheck.reference.formats import quantize_activation, requantize_to_max
from tpcheck.reference.attention_fn import ATTN_NAME, register_attention
from tpcheck.reference.build import meta_model
from tpcheck.reference.gptq import dequantized_state, is_gptq

if TYPE_CHECKING:  # the scheme's type only: the formats are read by tpcheck.reference.formats, not impl.quant
    from impl.quant import Int8Scheme

#: the projections a compressed-tensors ``Linear`` target quantizes in a decoder layer (HF's names)
QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")


def fake_quant(x: torch.Tensor, scheme: Int8Scheme, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``q_x * s_x`` in ``x``'s dtype: per token (``s_x = max|x_t| / 127``, a zero row kept zero) or with the static
    ``input_scale``; float64 end to end for the golden, else the scale and rounding in float32 (as an engine
    quantizes its bf16 / fp16 / fp32 activations) and the product cast back."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    q, s = quantize_activation(x, scheme.num_type, work, None if scheme.dynamic_input else input_scale.to(x.device))
    return (q * s).to(x.dtype)


#: the projections an engine fuses into one layer (FP8 per-tensor scales: re-quantized to their maximum)
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def _requantize_fused(raw: dict[str, torch.Tensor], scheme: Int8Scheme) -> None:
    """FP8 per-tensor scales: each fused group's e4m3 weights re-quantized to the group's maximum scale in float64
    (``tpcheck.reference.formats.requantize_to_max``, what vLLM and impl do at load), in ``raw``, in place. What a checkpoint
    with one scale per projection means to the engine that fuses them."""
    if scheme.num_type != "float" or scheme.weight_strategy != "tensor":
        return
    prefixes = sorted({n.rsplit(".", 3)[0] for n in raw if n.endswith("_proj.weight_scale")})
    for pre in prefixes:  # model.layers.{i}
        for group in FUSED:
            names = [f"{pre}.{g}.weight" for g in group]
            if not all(n in raw for n in names):
                continue
            scales = torch.cat([raw[n + "_scale"].reshape(1) for n in names])
            parts, s_max = requantize_to_max([raw[n] for n in names], scales)
            for n, w in zip(names, parts):
                raw[n], raw[n + "_scale"] = w, s_max.clone()


def _state_dict(model_dir: str | Path, dtype: torch.dtype,
                scheme: Int8Scheme) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint in ``dtype`` with each int8 / e4m3 ``weight`` dequantized by its
    ``weight_scale`` (in float64, then cast; FP8 fused per-tensor groups re-quantized to their maximum scale
    first); and the static ``input_scale`` of each layer that has one."""
    raw: dict[str, torch.Tensor] = {}
    for fname, names in checkpoint_files(model_dir).items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                raw[name] = f.get_tensor(name)
    if is_gptq(raw):  # W4A16 (GPTQ, AWQ): dequantized weights only (tpcheck.reference.gptq)
        return dequantized_state(raw, dtype, str(model_dir), scheme), {}
    _requantize_fused(raw, scheme)
    state, input_scales = {}, {}
    for name, t in raw.items():
        if name.endswith((".weight_scale", ".self_attn.k_scale", ".self_attn.v_scale")):
            continue  # KV-cache scales: read by _fake_quant_kv
        if name.endswith(".input_scale"):
            input_scales[name.removesuffix(".input_scale")] = t.float().reshape(1)
            continue
        if t.dtype in (torch.int8, FP8):
            scale = raw.get(name + "_scale")
            if scale is None:
                raise ValueError(f"{model_dir}: {t.dtype} tensor {name!r} has no {name}_scale")
            t = t.double() * scale.double().reshape(-1, 1) if scale.numel() > 1 else t.double() * scale.double()
        state[name] = t.to(dtype)
    if scheme.num_type == "float":  # a fused layer quantizes its one input with its parts' largest static scale
        for pre in sorted({n.rsplit(".", 2)[0] for n in input_scales}):  # model.layers.{i}
            for group in FUSED:
                names = [f"{pre}.{g}" for g in group if f"{pre}.{g}" in input_scales]
                top = max((input_scales[n] for n in names), key=float, default=None)
                for n in names:
                    input_scales[n] = top
    return state, input_scales


def load_quantized_hf(model_dir: str | Path, dtype: str | torch.dtype, config_cls: type, model_cls: type) -> nn.Module:
    """HF's model of a quantized checkpoint in ``dtype``: dequantized weights, fake-quantized linear inputs."""
    scheme, td = load_config(model_dir).quant, parse_dtype(dtype)
    config = config_cls.from_pretrained(str(model_dir))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers would look for its own compressed-tensors quantizer
    model = meta_model(model_dir, td, config, model_cls)
    state, input_scales = _state_dict(model_dir, td, scheme)
    tied = bool(config.tie_word_embeddings)
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: the quantized checkpoint does not match {model_cls.__name__}: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if scheme.quantizes_activations:  # not W4A16 (GPTQ)
        _fake_quant_inputs(model, scheme, input_scales)
    if getattr(scheme, "kv_cache", None) is not None:
        _fake_quant_kv(model, model_dir)
    return model.eval()


def _fake_quant_kv(model: nn.Module, model_dir: str | Path) -> None:
    """An FP8 KV cache (``impl.quant_kv``): each attention module gets ``kv_cache_scales`` (``k_scale``, ``v_scale``
    shaped ``[kv_heads or 1, 1, 1]`` against HF's ``[batch, kv_heads, tokens, head_dim]``), which tpcheck's
    attention function (``tpcheck.reference.hf``) applies to the new keys (after RoPE) and values before attention,
    in the cache itself, so later steps and the ``kv.k`` / ``kv.v`` points read the rounded values, as the
    engine's cache holds them. The scales are read as stored (float32), whole: the golden is one device."""
    names = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(len(model.model.layers)) for w in "kv"]
    found: dict[str, torch.Tensor] = {}
    for fname, present in checkpoint_files(model_dir).items():
        with safe_open(fname, framework="pt") as f:
            found.update({n: f.get_tensor(n) for n in names if n in present})
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{model_dir}: the FP8 KV cache (kv_cache_scheme) has no scale tensor {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    register_attention()  # the rounding lives in tpcheck's attention function: the model uses it from here on
    model.config._attn_implementation = ATTN_NAME
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_cache_scales = tuple(found[f"model.layers.{i}.self_attn.{w}_scale"].float().reshape(-1, 1, 1)
                                                for w in "kv")


def _fake_quant_inputs(model: nn.Module, scheme: Int8Scheme, input_scales: dict[str, torch.Tensor]) -> None:
    """Each quantized linear's ``forward`` fake-quantizes its input first. Inside ``forward``, not a pre-hook:
    the capture reads ``attn.context`` / ``mlp.act`` from o_proj's / down_proj's input with a pre-hook, and must
    see the activation as the engine's point does, before its quantization (a pre-hook installed at load runs
    before the capture's: the golden's points were the quantized activations, 1.7% off the engine's at
    ``mlp.act``, with a gain of their own from the int8 grid). The quantization is also the module's
    ``input_quant``: a forward that replaces this one (``tpcheck.reference.hf.HFCapture``'s row-parallel
    emulation of o_proj / down_proj) applies it first."""
    for i, layer in enumerate(model.model.layers):
        for rel in QUANTIZED:
            mod = layer.get_submodule(rel)
            scale = input_scales.get(f"model.layers.{i}.{rel}")
            if not scheme.dynamic_input and scale is None:
                raise ValueError(f"model.layers.{i}.{rel}: a static activation scheme with no input_scale")
            mod.input_quant = functools.partial(_input_quant, scheme, scale)
            mod.forward = functools.partial(_quantized_forward, mod.forward, mod.input_quant)


def _input_quant(scheme: Int8Scheme, scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return fake_quant(x, scheme, scale)


def _quantized_forward(forward, input_quant, x: torch.Tensor) -> torch.Tensor:
    return forward(input_quant(x))
