"""Static activation scales for a quantized checkpoint (``w8a8-fp8-static``): the float model run on calibration
prompts, each quantized linear's input observed.

``input_scale = float32(max |x| / 448)`` over every token of every calibration prompt (compressed-tensors'
``static_minmax`` observer: the running min / max of the whole calibration set, symmetric), one number per linear
(``...q_proj.input_scale`` ``[1]``). q/k/v share one input and so one scale, as gate/up do. The prompts are fixed:
4 of 32 token ids drawn from ``random.Random(0)`` over the vocabulary, so the same source gives the same scales.
The float model is Hugging Face's (``AutoModelForCausalLM``, no remote code), in float32, built in memory (a calibration needs the whole model; this is for
checkpoints that fit)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from impl.quant_fp8 import FP8_MAX

PROMPTS, TOKENS = 4, 32


def input_scales(src: str | os.PathLike, weights: list[str]) -> dict[str, torch.Tensor]:
    """``{"<linear>.input_scale": float32 [1]}`` for each quantized linear weight name in ``weights``
    (``model.layers.{i}.self_attn.q_proj.weight`` ...), from the float checkpoint ``src``."""
    model = _float_model(src)
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for w in weights:
        mod = model.get_submodule(w.removesuffix(".weight"))

        def observe(_m, args, name=w.removesuffix("weight") + "input_scale"):
            a = args[0].detach().abs().amax().to(torch.float64)
            absmax[name] = torch.maximum(absmax.get(name, a), a)
        hooks.append(mod.register_forward_pre_hook(observe))
    try:
        _run_prompts(model)
    finally:
        for h in hooks:
            h.remove()
    missing = [w for w in weights if w.removesuffix("weight") + "input_scale" not in absmax]
    if missing:
        raise ValueError(f"{src}: calibration never reached {missing[:4]}")
    out = {}
    for name, a in absmax.items():
        if not a > 0:
            raise ValueError(f"{src}: calibration input of {name.removesuffix('.input_scale')} is all zero")
        out[name] = (a / FP8_MAX).to(torch.float32).reshape(1)
    return out


def _float_model(src: str | os.PathLike):
    # lazy: transformers (seconds to import) is needed by a calibrated scheme only
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(Path(src))).float().eval()


def _run_prompts(model) -> None:
    """The calibration prompts through ``model``, one forward each."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for _ in range(PROMPTS):
            model(torch.tensor([[rng.randrange(vocab) for _ in range(TOKENS)]]))


KV_ATTENTION = "tpcheck_kv_calibration"
_KV_ABSMAX: dict[str, torch.Tensor] = {}  # what the attention function below observes (one calibration at a time)
_KV_PER_HEAD: list[bool] = [False]


def _observe_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, after recording max |k| (after RoPE) and max |v| of each layer: over the
    whole tensor, or per KV head (``key`` / ``value``: ``[batch, kv_heads, tokens, head_dim]``)."""
    for which, t in (("k", key), ("v", value)):
        a = t.detach().abs().to(torch.float64)
        a = a.amax(dim=(0, 2, 3)) if _KV_PER_HEAD[0] else a.amax().reshape(1)
        name = f"model.layers.{module.layer_idx}.self_attn.{which}_scale"
        _KV_ABSMAX[name] = torch.maximum(_KV_ABSMAX.get(name, a), a)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # submodule: loaded on first call
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def kv_scales(src: str | os.PathLike, strategy: str) -> dict[str, torch.Tensor]:
    """``{"model.layers.{i}.self_attn.k_scale": float32, ...}`` (and ``v_scale``) of an FP8 KV cache from the float
    checkpoint ``src``: ``max |k| / 448`` over the calibration prompts' keys after RoPE (values: ``max |v|``), as
    compressed-tensors' ``static_minmax`` observer of the KV cache; ``[1]`` for ``strategy`` "tensor",
    ``[kv_heads, 1, 1]`` (llm-compressor's shape) for "attn_head"."""
    from transformers import AttentionInterface  # transformers >= 4.51
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # transformers >= 4.53
    AttentionInterface.register(KV_ATTENTION, _observe_kv)
    AttentionMaskInterface.register(KV_ATTENTION, sdpa_mask)
    model = _float_model(src)
    model.config._attn_implementation = KV_ATTENTION
    _KV_ABSMAX.clear()
    _KV_PER_HEAD[0] = strategy == "attn_head"
    _run_prompts(model)
    out = {}
    for name, a in sorted(_KV_ABSMAX.items()):
        if not bool((a > 0).all()):
            raise ValueError(f"{src}: calibration gave {name.removesuffix('_scale')} an all-zero head or tensor")
        scale = (a / FP8_MAX).to(torch.float32)
        out[name] = scale.reshape(1) if strategy == "tensor" else scale.reshape(-1, 1, 1)
    _KV_ABSMAX.clear()
    return out
