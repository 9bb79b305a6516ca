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
metadata.

With an FP8 KV cache (``kv_quant``: the checkpoint's ``kv_cache_scheme`` strategy, ``impl.quant_kv``) the cache is
float8_e4m3fn: each new key (after RoPE) and value is quantized with the layer's static ``k_scale`` / ``v_scale``
(one, or one per local KV head) when it is written, and every read dequantizes it (``q * scale``, cast to the
activation dtype). A prefill attends over the rounded keys and values too, as the engine's cache would give them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import batch_invariant
from impl.context import Context, get_context
from impl.placements import Shard
from impl.quant_kv import CACHE_DTYPE, dequantize_kv, kv_scale_count, load_kv_scale, quantize_kv


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
                 sliding_window: int | None = None, kv_quant: str | None = None, total_kv_heads: int = 0,
                 first_kv_head: int = 0):
        """``num_heads`` / ``num_kv_heads`` are this rank's; ``sliding_window`` None = full causal attention.
        ``kv_quant``: an FP8 KV cache's scale strategy ("tensor" / "attn_head"), None for a cache in the activation
        dtype; a per-head scale is sliced from the model's ``total_kv_heads`` at this rank's ``first_kv_head``."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.k_cache = self.v_cache = torch.tensor([])  # allocated by the model runner
        self.output_placement = Shard(-1)
        self.kv_quant, self.total_kv_heads, self.first_kv_head = kv_quant, total_kv_heads, first_kv_head
        if kv_quant is not None:  # NaN until the checkpoint fills them (a missing one is a load error, never 1.0)
            n = kv_scale_count(kv_quant, num_kv_heads)
            for name in ("k_scale", "v_scale"):
                p = nn.Parameter(torch.full((n,), float("nan")), requires_grad=False)
                p.weight_loader = self.kv_scale_loader
                setattr(self, name, p)

    def checkpoint_tensors(self, mname: str) -> tuple[dict[str, tuple[str, None]], set[str]]:
        """The checkpoint names of the KV-cache scales (``...self_attn.k_scale``, vLLM's and compressed-tensors'
        spelling, one level above this module) -> this module's parameters."""
        if self.kv_quant is None:
            return {}, set()
        parent = mname.rsplit(".", 1)[0]
        return {f"{parent}.{n}": (f"{mname}.{n}", None) for n in ("k_scale", "v_scale")}, set()

    def kv_scale_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        load_kv_scale(param, loaded, self.kv_quant, self.total_kv_heads, self.first_kv_head)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What this layer's cache holds for a model run in ``dtype``."""
        return dtype if self.kv_quant is None else CACHE_DTYPE

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_scale``, ``v_scale`` shaped to broadcast over ``[..., kv_heads, d]``."""
        return self.k_scale.view(-1, 1), self.v_scale.view(-1, 1)

    def cached(self, which: str, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[*slots.shape, kv_heads, d]`` keys (``which`` "k") or values ("v") read from the cache, dequantized
        to ``dtype`` when the cache is FP8."""
        cache = self.k_cache if which == "k" else self.v_cache
        rows = cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
        if self.kv_quant is None:
            return rows
        return dequantize_kv(rows, self.kv_scales()["kv".index(which)], dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: ``[T, heads, d]``; k, v: ``[T, kv_heads, d]`` (after RoPE). Returns ``[T, heads * d]``."""
        ctx = get_context()
        if self.kv_quant is not None:  # the cache's rounding, for the cache and this step's own attention alike
            (ks, vs), dt = self.kv_scales(), k.dtype
            k, v = quantize_kv(k, ks), quantize_kv(v, vs)
            if ctx.slot_mapping is not None and self.k_cache.numel():
                self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = k
                self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = v
            k, v = dequantize_kv(k, ks, dt), dequantize_kv(v, vs, dt)
        elif ctx.slot_mapping is not None and self.k_cache.numel():
            self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = k
            self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[ctx.slot_mapping] = v
        if batch_invariant.enabled():  # each query alone over exactly its own keys (impl.batch_invariant)
            out = self._per_query(q, k, v, ctx)
        else:
            out = self._decode(q, ctx) if ctx.is_decode else self._prefill(q, k, v, ctx)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _sdpa(self, q, k, v, mask):
        """q ``[B, Lq, H, d]``, k/v ``[B, Lk, K, d]``, mask broadcastable to ``[B, H, Lq, Lk]``."""
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2)

    def seq_keys(self, q, k, v, ctx: Context, i: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``i``'s keys and values ``[seq_lens_k[i], kv_heads, d]`` (its new tokens start at row ``start``
        of ``k``, ``v``): those new tokens when there is no cache, else every position read from its blocks."""
        lq, lk = ctx.seq_lens_q[i], ctx.seq_lens_k[i]
        if ctx.block_tables is None:  # no cached prefix: keys are this sequence's new tokens
            return k[start:start + lq], v[start:start + lq]
        slots = block_slots(ctx.block_tables[i:i + 1], self.k_cache.shape[1], lk)[0]
        return self.cached("k", slots, q.dtype), self.cached("v", slots, q.dtype)

    def _prefill(self, q, k, v, ctx: Context) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
            qs = q[start:start + lq]
            ks, vs = self.seq_keys(q, k, v, ctx, i, start)
            # one query over all its keys needs no mask, unless a window hides the oldest of them
            w = self.sliding_window
            mask = causal_mask(lq, lk, q.device, w) if lq > 1 or (w is not None and lk > w) else None
            out[start:start + lq] = self._sdpa(qs[None], ks[None], vs[None], mask)[0]
            start += lq
        return out

    def _per_query(self, q, k, v, ctx: Context) -> torch.Tensor:
        """Batch-invariant attention: every query of every sequence attends alone, unmasked, over exactly the keys it
        sees (``0..p``, within the window): one SDPA shape per (position, window), whatever the batch, whether the
        position is prefilled whole, in chunks, after a cached prefix or decoded."""
        out = torch.empty_like(q)
        start, w = 0, self.sliding_window
        for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
            ks, vs = self.seq_keys(q, k, v, ctx, i, start)
            for j in range(lq):
                p = lk - lq + j
                lo = 0 if w is None else max(0, p - w + 1)
                out[start + j] = self._sdpa(q[None, start + j:start + j + 1], ks[None, lo:p + 1], vs[None, lo:p + 1],
                                            None)[0, 0]
            start += lq
        return out

    def _decode(self, q, ctx: Context) -> torch.Tensor:
        """One new token per sequence: gather each sequence's keys into a padded ``[B, Lmax]`` batch."""
        lens = torch.tensor(ctx.seq_lens_k, device=q.device)
        slots = block_slots(ctx.block_tables, self.k_cache.shape[1], int(lens.max()))
        k, v = self.cached("k", slots, q.dtype), self.cached("v", slots, q.dtype)
        j = torch.arange(slots.shape[1], device=q.device)[None, :]
        mask = j < lens[:, None]  # the query sits at position len - 1
        if self.sliding_window is not None:
            mask = mask & (j >= lens[:, None] - self.sliding_window)
        mask = mask[:, None, None, :]
        return self._sdpa(q[:, None], k, v, mask)[:, 0]
