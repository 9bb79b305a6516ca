"""Faults that strike in the RMSNorms and the residual adds: arithmetic in another order than HF's, and a
systematic gain far below one element's rounding."""
from __future__ import annotations

import torch

from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault


def _half_precision(cfg, plan, dtype) -> bool:
    """Half precision on a model whose norms cast back before scaling (Gemma 3's scale first, as this fault does)."""
    return dtype in ("bfloat16", "float16") and getattr(cfg, "gemma", None) is None


def _norm_weight_before_cast(norm):
    def forward(x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (norm.weight * h).to(dtype)  # HF: norm.weight * h.to(dtype)

    return forward


@fault(16, "rmsnorm_weight_before_cast",
       "RMSNorm multiplies by its weight in float32 and casts back after (HF casts back, then multiplies)",
       shows_when="half precision only (bfloat16, float16), and only with --exact-ops: it is closer to float64 "
                  "than HF, so the noise-floor gate passes it",
       expected_origin="layers.{layer}.input_norm", shows=_half_precision, needs_exact_ops=True)
def rmsnorm_weight_before_cast(runner, i, layer):
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if mark(norm, "rmsnorm_weight_before_cast"):
            norm.forward = _norm_weight_before_cast(norm)


RESIDUAL_GAIN = 1 + 2**-7  # residual_gain's factor: 2 ulp at most of a bfloat16 element, 1/128 relative


@fault(30, "residual_gain",
       "the attention residual add scaled by 1 + 2^-7 (a residual multiplier read as 1.0078 instead of 1): in "
       "bfloat16 each element moves by 1-2 ulp, below the rounding the noise floor admits",
       shows_when="always; in bfloat16 / float16 only the gain statistic sees it (rel_err reads it as rounding)",
       expected_origin="layers.{layer}.attn.residual")
def residual_gain(runner, i, layer):
    if not mark(layer, "residual_gain"):
        return

    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: its attention output is normalised before the add
        def forward(positions, x):
            h = (x + layer.post_attention_layernorm(layer.self_attn(positions, layer.input_layernorm(x)))) * RESIDUAL_GAIN
            return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    else:
        def forward(positions, x):
            h = (x + layer.self_attn(positions, layer.input_layernorm(x))) * RESIDUAL_GAIN
            return h + layer.mlp(layer.post_attention_layernorm(h))

    layer.forward = forward
