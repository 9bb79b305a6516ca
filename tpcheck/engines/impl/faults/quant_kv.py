"""Faults of an FP8 KV cache's scales under TP (``impl.quant_kv``: the checkpoint's ``k_scale`` / ``v_scale``, bug
class E): a scale silently left at 1.0 (vLLM's fallback when a checkpoint lacks it; SGLang's when it is not loaded),
the k and v scales swapped, per-head scales sliced for the wrong rank. Each patch rewrites a rank's ``k_scale`` /
``v_scale`` after loading (the checkpoint's tensors read as stored); the cache then quantizes and dequantizes with
the wrong scale, consistently, so the error is what e4m3's range does with it: values above ``448 s`` clamp, values
below ``2^-6 s`` lose bits. They show on checkpoints whose k and v scales differ (``small-fp8-kv*``:
``tpcheck.inputs.models.kv_recipe``), in the dtypes a quantized run is judged in (not float32)."""
from __future__ import annotations

import torch

from tpcheck.engines.impl.faults.patching import mark, read_tensors
from tpcheck.engines.impl.faults.registry import Needs, fault


def _kv_scheme(cfg) -> bool:
    return getattr(getattr(cfg, "quant", None), "kv_cache", None) is not None


def _kv_head_scheme(cfg) -> bool:
    return _kv_scheme(cfg) and cfg.quant.kv_cache == "attn_head"


KV = Needs("an FP8 KV cache's k_scale / v_scale (quantization_config.kv_cache_scheme)", _kv_scheme)
KV_HEAD = Needs("an FP8 KV cache's per-head scales (kv_cache_scheme.strategy: attn_head)", _kv_head_scheme)


def _kv(cfg, plan, dtype) -> bool:
    return _kv_scheme(cfg) and dtype != "float32"


def _kv_head_tp(cfg, plan, dtype) -> bool:
    return _kv(cfg, plan, dtype) and _kv_head_scheme(cfg) and plan.tp > 1


def _kv_head_replicated(cfg, plan, dtype) -> bool:
    return _kv_head_tp(cfg, plan, dtype) and plan.tp > cfg.num_kv_heads


@fault(52, "kv_scale_defaulted_to_one",
       "FP8 KV cache: k_scale and v_scale left at 1.0 instead of the checkpoint's (a loader that does not map "
       "self_attn.k_scale onto the attention layer and falls back to 1.0, with at most a warning)",
       shows_when="FP8 KV-cache checkpoints whose keys or values lie outside e4m3's normal range at scale 1 "
                  "(|x| < 2^-6 or > 448), bfloat16 / float16",
       expected_origin="layers.{layer}.attn.context", shows=_kv, needs=KV)
@torch.no_grad()
def kv_scale_defaulted_to_one(runner, i, layer):
    attn = layer.self_attn.attn
    if mark(attn, "kv_scale_defaulted_to_one"):
        attn.k_scale.data.fill_(1.0)
        attn.v_scale.data.fill_(1.0)


@fault(53, "kv_scales_k_v_swapped",
       "FP8 KV cache: the k_scale loaded into v_scale and the v_scale into k_scale (keys clamp at 448 v_scale)",
       shows_when="FP8 KV-cache checkpoints whose k and v scales differ, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.context", shows=_kv, needs=KV)
@torch.no_grad()
def kv_scales_k_v_swapped(runner, i, layer):
    attn = layer.self_attn.attn
    if mark(attn, "kv_scales_k_v_swapped"):
        k = attn.k_scale.data.clone()
        attn.k_scale.data.copy_(attn.v_scale.data)
        attn.v_scale.data.copy_(k)


def _reload_heads(runner, i: int, attn, first_head: int) -> None:
    """The layer's per-head k / v scales loaded again, from KV head ``first_head`` on (through the layer's own
    loader, as a rank that computed the wrong start would)."""
    names = [f"model.layers.{i}.self_attn.{w}_scale" for w in "kv"]
    full = read_tensors(runner, names, cast=False)
    right = attn.first_kv_head
    attn.first_kv_head = first_head
    try:
        for w, name in zip("kv", names):
            attn.kv_scale_loader(getattr(attn, f"{w}_scale"), full[name])
    finally:
        attn.first_kv_head = right


@fault(54, "kv_head_scales_rank0",
       "FP8 KV cache with per-head scales: every rank loads rank 0's KV heads' k / v scales (shapes right, numbers "
       "wrong for the heads of the other ranks)",
       shows_when="FP8 KV-cache checkpoints with per-head scales, tp > 1, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.context", shows=_kv_head_tp, needs=KV_HEAD)
@torch.no_grad()
def kv_head_scales_rank0(runner, i, layer):
    attn = layer.self_attn.attn
    if mark(attn, "kv_head_scales_rank0"):
        _reload_heads(runner, i, attn, 0)


@fault(55, "kv_head_scales_replicas_ignored",
       "FP8 KV cache with per-head scales and KV heads replicated (tp > KV heads): the rank's scale sliced at KV "
       "head tp_rank % kv_heads instead of tp_rank // replicas (the head the rank's k / v rows hold)",
       shows_when="FP8 KV-cache checkpoints with per-head scales, tp > KV heads, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.context", shows=_kv_head_replicated,
       needs=KV_HEAD)
@torch.no_grad()
def kv_head_scales_replicas_ignored(runner, i, layer):
    attn = layer.self_attn.attn
    if mark(attn, "kv_head_scales_replicas_ignored"):
        _reload_heads(runner, i, attn, layer.self_attn.qkv_proj.tp_rank % attn.total_kv_heads)
