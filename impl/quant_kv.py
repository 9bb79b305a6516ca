"""FP8 (float8_e4m3fn) KV cache with static k/v scales from the checkpoint (compressed-tensors' ``kv_cache_scheme``,
as vLLM reads it: ``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py``,
``CompressedTensorsKVCacheMethod``).

``kv_cache_scheme``: ``type "float"``, ``num_bits 8``, ``symmetric true``, ``dynamic false`` and ``strategy``
``"tensor"`` (one ``k_scale`` / ``v_scale`` ``[1]`` per layer) or ``"attn_head"`` (one per KV head,
``[num_kv_heads]``; llm-compressor stores ``[num_kv_heads, 1, 1]``). The checkpoint names them
``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (vLLM remaps them onto its ``self_attn.attn``). With the key
after RoPE and the value of one token, per KV head ``h``::

    k_q = e4m3(clamp(float32(k) / k_scale[h], -448, 448))   # stored in the cache (nearest, ties to even)
    k   = k_q * k_scale[h]                                   # what attention reads, cast to the activation dtype

(``v`` alike). Attention reads the rounded keys and values for every token, the new ones of a prefill included, as
vLLM's backends do (they write the cache first and attend over it).

Sharding (load time): a per-tensor scale is one number every rank holds whole. A per-head scale follows the rank's
KV heads: heads ``[r K/tp, (r+1) K/tp)`` when they are partitioned, and KV head ``r // replicas`` when ``tp > K``
replicates each head on ``replicas = tp / K`` consecutive ranks (vLLM's ``_tp_aware_loader``; the same rule as the
k/v rows of ``QKVParallelLinear``).

A scale no checkpoint tensor filled is a load error naming the tensor (vLLM defaults it to 1.0 and warns); a scale
that is not positive and finite is refused naming the tensor."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.errors import ConfigError, ShapeMismatch
from impl.fp8 import FP8, to_fp8

KV_STRATEGIES = ("tensor", "attn_head")
SUPPORTED_KV = "kv_cache_scheme: 8-bit float (e4m3), symmetric, static, strategy 'tensor' or 'attn_head'"


@dataclass(frozen=True)
class KvCacheScheme:
    """A compressed-tensors config that quantizes only the KV cache (``config_groups: {}``, a ``kv_cache_scheme``):
    the linears stay in the checkpoint's float dtype. ``kv_cache``: the scales' strategy ("tensor" / "attn_head")."""

    kv_cache: str
    quantizes_activations = False  # no linear input is quantized (the golden fake-quantizes keys and values only)
    quantizes_weights = False
    weight_strategy = None
    num_type = "float"

    @property
    def name(self) -> str:
        return f"fp8-kv (float linears, FP8 KV cache with {self.kv_cache} scales)"


def parse_kv_cache_scheme(raw: dict | None) -> str | None:
    """The ``strategy`` of a ``kv_cache_scheme`` (None: no quantized KV cache); ConfigError naming the field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config.kv_cache_scheme is a {type(raw).__name__}, not a mapping ({SUPPORTED_KV})")
    for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
        if raw.get(key) != want:
            raise ConfigError(f"quantization_config.kv_cache_scheme.{key} = {raw.get(key)!r}, impl supports {want!r} "
                              f"({SUPPORTED_KV})")
    if raw.get("dynamic"):
        raise ConfigError(f"quantization_config.kv_cache_scheme.dynamic = {raw['dynamic']!r}: the KV scales must be "
                          f"static, from the checkpoint ({SUPPORTED_KV})")
    strategy = raw.get("strategy")
    if strategy not in KV_STRATEGIES:
        raise ConfigError(f"quantization_config.kv_cache_scheme.strategy = {strategy!r}, impl supports "
                          f"{' or '.join(map(repr, KV_STRATEGIES))} ({SUPPORTED_KV})")
    return strategy


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -448, 448))`` as float8_e4m3fn, the division in float32 (float64 for a float64
    ``x``: the golden); ``scale`` broadcastable to ``x`` (one per KV head on the head dimension)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return to_fp8(x.to(work) / scale.to(work))


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` (exact in float32: 4 significant bits times a float32), cast to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * scale.to(work)).to(dtype)


def fake_quant_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a key or value becomes through the FP8 cache, in ``x``'s dtype (the golden's and references' rule)."""
    return dequantize_kv(quantize_kv(x, scale), scale, x.dtype)


def kv_scale_count(strategy: str, local_kv_heads: int) -> int:
    """How many scales a rank holds: 1 (per tensor) or its KV heads (per head)."""
    return local_kv_heads if strategy == "attn_head" else 1


def load_kv_scale(param: torch.nn.Parameter, loaded, strategy: str, total_kv_heads: int, first_head: int) -> None:
    """One ``k_scale`` / ``v_scale`` into a rank's ``param``: whole (per tensor, ``[1]`` or ``[]``), or the rank's
    heads ``[first_head, first_head + len(param))`` of the ``[K]`` / ``[K, 1, 1]`` per-head tensor."""
    shape = tuple(loaded.shape)
    if strategy == "tensor":
        if shape not in ((), (1,)):
            raise ShapeMismatch(f"checkpoint shape {list(shape)} != expected [1] (a per-tensor KV-cache scale)")
        value = loaded.narrow(0, 0, 1) if shape == (1,) else loaded[()].reshape(1)
    else:
        if shape not in ((total_kv_heads,), (total_kv_heads, 1, 1)):
            raise ShapeMismatch(f"checkpoint shape {list(shape)} != expected [{total_kv_heads}] or "
                                f"[{total_kv_heads}, 1, 1] (one KV-cache scale per KV head)")
        value = loaded.narrow(0, first_head, param.shape[0]).reshape(-1)
    value = value.to(torch.float32)
    if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
        raise ShapeMismatch(f"KV-cache scale {value.tolist()} is not positive and finite")
    param.data.copy_(value)


CACHE_DTYPE = FP8  # what the cache holds when the checkpoint declares a kv_cache_scheme
