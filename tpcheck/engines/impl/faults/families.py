"""Faults of the families beyond Qwen2: an engine that runs Llama / Mistral / Qwen3 through Qwen2's code and
forgets what the family adds (Qwen3's per-head q/k norms and where they sit, Llama 3's RoPE frequency remap,
which projections have biases, Mistral's sliding window).

Each shows only on a model of its family (``shows``), so the fault matrix runs it on the first preset of
``tpcheck.cli.fault_matrix.PRESET_ORDER`` that has the option: ``tiny-qwen3``, ``tiny-llama``, ``tiny-mistral``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.layers.rotary import default_inv_freq, llama3_inv_freq
from tpcheck.engines.impl.faults.patching import mark, seeded_randn
from tpcheck.engines.impl.faults.registry import fault


# ---- Qwen3: q/k norm after RoPE instead of before ------------------------------------------------------------

def _qk_norm(cfg, plan, dtype) -> bool:
    return cfg.qk_norm


def _no_norm(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k


@fault(20, "qk_norm_after_rope",
       "Qwen3's per-head q_norm / k_norm applied after RoPE instead of before (RoPE is a rotation, so the RMS "
       "is the same: only the per-dimension norm weight lands on rotated coordinates)",
       shows_when="models with per-head q/k norms (Qwen3), any position > 0",
       expected_origin="layers.{layer}.attn.q_norm", shows=_qk_norm)
def qk_norm_after_rope(runner, i, layer):
    """The norms' own modules still run (so their output is what the engine calls ``q_norm``), on rotated
    q and k: the first point that differs is ``attn.q_norm`` itself (rows at position 0 agree, RoPE is the
    identity there), then everything after it."""
    sa = layer.self_attn
    if not hasattr(sa, "q_norm"):
        return  # no q/k norm in this model: nothing to misplace
    if not mark(sa, "qk_norm_after_rope"):
        return
    rot = sa.rotary_emb
    rotate = rot.forward
    sa.norm_qk = _no_norm

    def forward(positions, q, k):
        q, k = rotate(positions, q, k)
        return sa.q_norm(q), sa.k_norm(k)

    rot.forward = forward


# ---- Llama 3: the RoPE frequency remap not applied ----------------------------------------------------------

def _llama3_remap_matters(cfg, plan, dtype) -> bool:
    """A llama3 ``rope_scaling`` whose remap changes some frequency of this head_dim / theta (a remap whose
    wavelengths are all below ``original / high_freq_factor`` is the identity)."""
    if cfg.rope_scaling is None:
        return False
    base = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    return not torch.equal(llama3_inv_freq(base, cfg.rope_scaling), base)


@fault(21, "llama3_scaling_ignored",
       "rope_type llama3 read as the default RoPE: the frequency remap (low frequencies / factor, a smooth band "
       "between) not applied",
       shows_when="llama3 rope_scaling that changes a frequency (Llama 3.1+), any position > 0",
       expected_origin="layers.{layer}.attn.q_rope", shows=_llama3_remap_matters)
def llama3_scaling_ignored(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if mark(rot, "llama3_scaling_ignored"):
        rot.inv_freq = default_inv_freq(rot.head_dim, runner.cfg.rope_theta).to(rot.inv_freq.device)


# ---- a q/k/v bias the model does not have ----------------------------------------------------------------------

def _no_qkv_bias(cfg, plan, dtype) -> bool:
    return not cfg.qkv_bias


@fault(22, "bias_where_none",
       "q/k/v projection built with a bias (Qwen2's habit) for a model whose config has none: the parameter, "
       "never loaded, holds noise",
       shows_when="models without q/k/v biases (Llama without attention_bias, Mistral, Qwen3)",
       expected_origin="layers.{layer}.attn.q", shows=_no_qkv_bias)
@torch.no_grad()
def bias_where_none(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if qkv.bias is not None or not mark(qkv, "bias_where_none"):
        return  # the model has the bias: nothing stray to add
    w = qkv.weight
    # one full stray bias per projection (the same on every TP size), each rank taking its heads' slice, so
    # ranks holding a replicated KV head agree: the bug is the bias, not the sharding
    full = {s: seeded_randn((qkv.totals[s],), 3000 + 3 * i + j, w.dtype, w.device) * 0.5
            for j, s in enumerate(("q", "k", "v"))}
    kv_rank = qkv.tp_rank // qkv.kv_replicas
    local = torch.cat([full["q"][qkv.tp_rank * qkv.q_size:(qkv.tp_rank + 1) * qkv.q_size],
                       full["k"][kv_rank * qkv.kv_size:(kv_rank + 1) * qkv.kv_size],
                       full["v"][kv_rank * qkv.kv_size:(kv_rank + 1) * qkv.kv_size]])

    def forward(x):
        return F.linear(x, qkv.weight, local)

    qkv.forward = forward


# ---- Mistral: the sliding window not applied -------------------------------------------------------------------

def _has_window(cfg, plan, dtype) -> bool:
    return any(w is not None for w in cfg.sliding_windows)


def _smallest_window(cfg) -> int | None:
    windows = [w for w in cfg.sliding_windows if w is not None]
    return min(windows) if windows else None


@fault(23, "sliding_window_ignored",
       "sliding-window attention run as full causal attention: every key of the sequence attended, not the "
       "window's most recent ones",
       shows_when="sliding-window models (Mistral; Qwen3's sliding layers), once a sequence is longer than the "
                  "window (a longer prompt: at the prefill)",
       expected_origin="layers.{layer}.attn.context", shows=_has_window, longer_than=_smallest_window)
def sliding_window_ignored(runner, i, layer):
    attn = layer.self_attn.attn
    if attn.sliding_window is not None and mark(attn, "sliding_window_ignored"):
        attn.sliding_window = None
