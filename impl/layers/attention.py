"""Causal GQA attention over a ragged batch, reading keys/values through a paged KV cache.

The cache of one layer on one rank is ``k_cache, v_cache: [num_blocks, block_size, kv_heads_local, head_dim]``
and holds only this rank's KV heads, never heads repeated to the query count. Token t of a sequence lives
in slot ``block_table[t // block_size] * block_size + t % block_size``. Query head h reads KV head
``h // (heads / kv_heads)`` (GQA), done by SDPA's ``enable_gqa`` without materialising repeated heads.

Masks are boolean (``True`` = may attend): a query at offset i of ``Lq`` new tokens over ``Lk`` keys sits at
position ``p = i + Lk - Lq`` and sees keys ``j <= p``; with a sliding window ``W`` (Mistral, Qwen3's sliding
layers) only ``p - W < j <= p`` (HF's ``kv_idx > q_idx - sliding_window``: the token itself and the
``W - 1`` before it). The paged cache keeps every token of a sequence; the window is applied by the mask
alone, in prefill (with or without a cached prefix) and in decode alike. No ``0 * -inf`` arithmetic
anywhere. This is pure torch; a GPU kernel would replace ``_prefill`` / ``_decode`` behind the same
metadata."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl.context import Context, get_context
from impl.placements import Shard


def causal_mask(q_len: int, k_len: int, device=None, window: int | None = None) -> torch.Tensor:
    """``[q_len, k_len]``: the last ``q_len`` of ``k_len`` tokens attend causally (within ``window``)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    pos = i + (k_len - q_len)
    mask = j <= pos
    return mask if window is None else mask & (j > pos - window)


def block_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """``[B, length]`` cache slots of token positions ``0..length-1`` of each sequence."""
    pos = torch.arange(length, device=block_tables.device)
    return block_tables[:, pos // block_size] * block_size + pos % block_size


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        """``num_heads`` / ``num_kv_heads`` are this rank's; ``sliding_window`` None = full causal attention."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.tensor([])  # allocated by the model runner
        self.output_placement = Shard(-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: ``[T, heads, d]``; k, v: ``[T, kv_heads, d]`` (after RoPE). Returns ``[T, heads * d]``."""
        ctx = get_context()
        if ctx.slot_mapping is not None and self.k_cache.numel():
            self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = k
            self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = v
        out = self._decode(q, ctx) if ctx.is_decode else self._prefill(q, k, v, ctx)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _sdpa(self, q, k, v, mask):
        """q ``[B, Lq, H, d]``, k/v ``[B, Lk, K, d]``, mask broadcastable to ``[B, H, Lq, Lk]``."""
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2)

    def _prefill(self, q, k, v, ctx: Context) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
            qs = q[start:start + lq]
            if ctx.block_tables is None:  # no cached prefix: keys are this sequence's new tokens
                ks, vs = k[start:start + lq], v[start:start + lq]
            else:
                slots = block_slots(ctx.block_tables[i:i + 1], self.k_cache.shape[1], lk)[0]
                ks = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
                vs = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
            # one query over all its keys needs no mask, unless a window hides the oldest of them
            w = self.sliding_window
            mask = causal_mask(lq, lk, q.device, w) if lq > 1 or (w is not None and lk > w) else None
            out[start:start + lq] = self._sdpa(qs[None], ks[None], vs[None], mask)[0]
            start += lq
        return out

    def _decode(self, q, ctx: Context) -> torch.Tensor:
        """One new token per sequence: gather each sequence's keys into a padded ``[B, Lmax]`` batch."""
        lens = torch.tensor(ctx.seq_lens_k, device=q.device)
        slots = block_slots(ctx.block_tables, self.k_cache.shape[1], int(lens.max()))
        k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
        v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
        j = torch.arange(slots.shape[1], device=q.device)[None, :]
        mask = j < lens[:, None]  # the query sits at position len - 1
        if self.sliding_window is not None:
            mask = mask & (j >= lens[:, None] - self.sliding_window)
        mask = mask[:, None, None, :]
        return self._sdpa(q[:, None], k, v, mask)[:, 0]
