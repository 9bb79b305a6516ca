"""Faults that strike in attention: the causal mask, and the rotary embedding (layout, theta, positions)."""
from __future__ import annotations

import torch

from impl.context import get_context
from impl.layers.attention import block_slots
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault

DEFAULT_ROPE_THETA = 10000.0     # what a config reader falls back to when it misses rope_theta


def _nan_mask_prefill(attn, q, k, v, ctx):
    """impl's prefill attention with an explicit softmax and an additive ``triu(ones) * -inf`` mask."""
    out = torch.empty_like(q)
    start = 0
    for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
        qs = q[start:start + lq]
        if ctx.block_tables is None:
            ks, vs = k[start:start + lq], v[start:start + lq]
        else:
            slots = block_slots(ctx.block_tables[i:i + 1], attn.k_cache.shape[1], lk)[0]
            ks = attn.k_cache.view(-1, attn.num_kv_heads, attn.head_dim)[slots]
            vs = attn.v_cache.view(-1, attn.num_kv_heads, attn.head_dim)[slots]
        rep = attn.num_heads // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * attn.scale
        if lq > 1:
            mask = torch.triu(torch.ones(lq, lk, device=q.device), diagonal=1 + lk - lq) * float("-inf")
            scores = scores + mask  # the bug: the zeros below the diagonal become NaN
        out[start:start + lq] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs.float()).to(q.dtype)
        start += lq
    return out


@fault(1, "nan_causal_mask",
       "causal mask built as triu(ones, 1) * -inf and added to the scores: 0 * -inf = NaN everywhere",
       shows_when="always (a prefill of >= 2 tokens)", expected_origin="layers.{layer}.attn.context")
def nan_causal_mask(runner, i, layer):
    attn = layer.self_attn.attn
    if not mark(attn, "nan_causal_mask"):
        return
    prev = attn.forward

    def forward(q, k, v):
        out = prev(q, k, v)  # writes the KV cache; in a prefill its output is replaced by the faulty one
        ctx = get_context()
        if ctx.is_decode:
            return out
        return _nan_mask_prefill(attn, q, k, v, ctx).reshape(out.shape)

    attn.forward = forward


def _no_rope(positions, q, k):
    return q, k


@fault(3, "rope_skipped", "RoPE not applied: rotary_emb returns q and k unchanged",
       shows_when="always (any position > 0)", expected_origin="layers.{layer}.attn.q_rope")
def rope_skipped(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if mark(rot, "rope_skipped"):
        rot.forward = _no_rope


@fault(10, "decode_position_off_by_one", "decode steps pass position p + 1 instead of p to RoPE",
       shows_when="decode only", expected_origin="layers.{layer}.attn.q_rope",
       decode_only=True, origin_step="decode")
def decode_position_off_by_one(runner, i, layer):
    sa = layer.self_attn
    if not mark(sa, "decode_position_off_by_one"):
        return
    prev = sa.forward

    def forward(positions, x):
        if get_context().is_decode:
            positions = positions + 1
        return prev(positions, x)

    sa.forward = forward


def _rope_interleaved(rot):
    """``RotaryEmbedding.forward`` in the GPT-J layout: pairs (x[2i], x[2i+1]) rotated by angle i."""

    def forward(positions, q, k):
        freqs = positions.to(torch.float32)[:, None] * rot.inv_freq.to(torch.float32)[None, :]  # [T, d/2]
        cos, sin = freqs.cos().to(q.dtype)[:, None, :], freqs.sin().to(q.dtype)[:, None, :]

        def rotate(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

        return rotate(q), rotate(k)

    return forward


@fault(12, "rope_wrong_layout",
       "RoPE rotates interleaved pairs (GPT-J: x[2i], x[2i+1]) where Qwen2 rotates halves (neox: x[i], x[i+d/2])",
       shows_when="always (any position > 0)", expected_origin="layers.{layer}.attn.q_rope")
def rope_wrong_layout(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if mark(rot, "rope_wrong_layout"):
        rot.forward = _rope_interleaved(rot)


def _rope_theta_not_default(cfg, plan, dtype) -> bool:
    return cfg.rope_theta != DEFAULT_ROPE_THETA


def _layer_theta_not_default(cfg, layer: int) -> bool:
    """Layer ``layer`` rotates with a base other than 10000 (Gemma 3's sliding layers use their local 1e4)."""
    return cfg.layer_rope_theta(layer) != DEFAULT_ROPE_THETA


@fault(17, "rope_theta_default", "rope_theta silently defaulted to 10000 when the checkpoint's config says otherwise",
       shows_when="checkpoints with rope_theta != 10000 (any position > 0), on a layer that uses it (not a Gemma 3 "
                  "sliding layer)",
       expected_origin="layers.{layer}.attn.q_rope", shows=_rope_theta_not_default, in_layer=_layer_theta_not_default)
def rope_theta_default(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if mark(rot, "rope_theta_default"):
        d = rot.head_dim
        rot.inv_freq = 1.0 / (DEFAULT_ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)).to(
            rot.inv_freq.device)
