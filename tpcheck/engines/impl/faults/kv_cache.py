"""Faults that strike in the paged KV cache: what a rank stores there, and where a decode token lands."""
from __future__ import annotations

import torch

from impl.context import get_context
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault


def _kv_heads_repeatable(cfg, plan, dtype) -> bool:
    return plan.heads > plan.kv_heads  # local query heads over local KV heads


def _allocate_repeated(runner) -> None:
    """Make ``runner.allocate_kv_cache`` give layers marked with ``_tpcheck_kv_repeat`` a cache of the
    repeated head count (once per runner)."""
    if getattr(runner, "_tpcheck_alloc_patched", False):
        return
    prev_alloc = runner.allocate_kv_cache

    def allocate_kv_cache(num_blocks, block_size):
        prev_alloc(num_blocks, block_size)
        for a in runner.attention_layers():
            if getattr(a, "_tpcheck_kv_repeat", 1) > 1:
                shape = (num_blocks, block_size, a.num_heads, a.head_dim)
                a.k_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
                a.v_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)

    runner.allocate_kv_cache = allocate_kv_cache
    runner._tpcheck_alloc_patched = True


@fault(5, "gqa_cache_repeated_heads",
       "KV cache stores K/V heads repeated to the local query-head count (numerically harmless, "
       "heads/kv_heads times the memory)",
       shows_when="decode (KV cache in use), where local query heads > local KV heads",
       expected_origin="layers.{layer}.kv.k", decode_only=True, shows=_kv_heads_repeatable)
def gqa_cache_repeated_heads(runner, i, layer):
    attn = layer.self_attn.attn
    rep = attn.num_heads // attn.num_kv_heads
    if rep <= 1 or not mark(attn, "gqa_cache_repeated_heads"):
        return  # nothing to repeat (MHA, or one query head per KV head on this rank)
    prev = attn.forward
    attn._tpcheck_kv_repeat = rep

    def forward(q, k, v):
        return prev(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))

    attn.num_kv_heads = attn.num_heads  # cache writes and decode reads now view the repeated heads
    attn.forward = forward
    _allocate_repeated(runner)
    # re-allocate now with the current layout (the engine allocated its cache at load)
    k0 = runner.attention_layers()[0].k_cache
    if k0.dim() == 4 and k0.numel():
        runner.allocate_kv_cache(*k0.shape[:2])


@fault(18, "slot_mapping_off_by_one_at_block_boundary",
       "a decode token that opens a new KV block is written one slot early, over the previous token's "
       "K/V, leaving its own slot empty",
       shows_when="decode only, when a sequence crosses a block boundary", expected_origin="layers.{layer}.kv.k",
       decode_only=True, origin_step="block_boundary")
def slot_mapping_off_by_one_at_block_boundary(runner, i, layer):
    attn = layer.self_attn.attn
    if not mark(attn, "slot_mapping_off_by_one_at_block_boundary"):
        return
    prev = attn.forward

    def forward(q, k, v):
        ctx = get_context()
        if not ctx.is_decode or ctx.slot_mapping is None or not attn.k_cache.numel():
            return prev(q, k, v)
        bs = attn.k_cache.shape[1]
        pos = torch.tensor(ctx.seq_lens_k, device=ctx.slot_mapping.device) - 1  # one new token per sequence
        opens_block = (pos % bs == 0) & (pos > 0)
        good = ctx.slot_mapping
        ctx.slot_mapping = good - opens_block.to(good.dtype)  # the bug: one slot short at the boundary
        try:
            return prev(q, k, v)
        finally:
            ctx.slot_mapping = good

    attn.forward = forward
