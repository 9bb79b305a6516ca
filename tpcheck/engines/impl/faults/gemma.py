"""Faults of Gemma 3's own arithmetic: what an engine written for Llama-style models gets wrong when it runs Gemma 3
(its norms' ``1 + w`` scale, its two RoPE bases, its sliding window's edge).

Each shows only on a Gemma 3 model (``shows``); the fault matrix runs them on ``tiny-gemma3`` / ``small-gemma3``."""
from __future__ import annotations

import torch

from impl.layers.rotary import default_inv_freq
from tpcheck.engines.impl.faults.families import _has_window, _smallest_window
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault


def _gemma(cfg, plan, dtype) -> bool:
    return getattr(cfg, "gemma", None) is not None


def _gemma_windowed(cfg, plan, dtype) -> bool:
    return _gemma(cfg, plan, dtype) and _has_window(cfg, plan, dtype)


def _scale_by_w(norm):
    """Llama's RMSNorm arithmetic on a Gemma weight: scaled by ``w`` where Gemma scales by ``1 + w``."""
    def forward(x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (h * norm.weight.to(torch.float32)).to(x.dtype)
    return forward


@fault(56, "gemma_norm_without_offset",
       "Gemma's RMSNorms scaled by their stored weight w instead of 1 + w (Llama's norm run on a Gemma checkpoint; "
       "the layer's four norms)",
       shows_when="Gemma 3 models (their norm weights are offsets from 1)",
       expected_origin="layers.{layer}.input_norm", shows=_gemma)
def gemma_norm_without_offset(runner, i, layer):
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        norm = getattr(layer, name, None)
        if norm is not None and mark(norm, "gemma_norm_without_offset"):
            norm.forward = _scale_by_w(norm)


@fault(57, "local_rope_global_base",
       "Gemma 3's sliding (local) layers rotated with the global layers' RoPE base (rope_theta, 1e6) instead of "
       "their own (rope_local_base_freq, 1e4)",
       shows_when="Gemma 3's sliding layers, any position > 0 (on a global layer the fault does nothing)",
       expected_origin="layers.{layer}.attn.q_rope", shows=_gemma_windowed)
def local_rope_global_base(runner, i, layer):
    sa = layer.self_attn
    cfg = runner.model.cfg
    if sa.attn.sliding_window is None or not mark(sa.rotary_emb, "local_rope_global_base"):
        return
    rot = sa.rotary_emb
    rot.inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_theta).to(rot.inv_freq.device)


@fault(58, "sliding_window_off_by_one",
       "the sliding window one key too wide: a query sees the W keys before it as well as itself (HF's window is the "
       "token and the W - 1 before it)",
       shows_when="Gemma 3's sliding layers, once a sequence is longer than the window",
       expected_origin="layers.{layer}.attn.context", shows=_gemma_windowed, longer_than=_smallest_window)
def sliding_window_off_by_one(runner, i, layer):
    attn = layer.self_attn.attn
    if attn.sliding_window is not None and mark(attn, "sliding_window_off_by_one"):
        attn.sliding_window += 1
