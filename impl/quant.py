"""Quantized linear layers in vLLM's pattern: a per-layer quant method whose ``create_weights`` registers the
quantized parameters (each with its own ``weight_loader``) and whose ``apply`` the parallel linear calls.

Supported: **FP8 W8A8** (``format == "float-quantized"``: ``impl.quant_fp8``, the same scheme object with
``num_type == "float"``, parsed here) and **INT8 W8A8** in the compressed-tensors format (``quantization_config.quant_method ==
"compressed-tensors"``, ``format == "int-quantized"``): int8 weights ``W_q`` ``[out, in]`` with a float32 scale per
output channel (``weight_scale [out, 1]``) or per tensor (``[1]``), symmetric; int8 activations quantized per token
at run time (dynamic: ``s_x = max|x_t| / 127`` per row) or with one static ``input_scale`` ``[1]``. The layer computes

    y = (s_x * s_w) * (q_x @ W_q^T)  (+ b),   q_x = clamp(round_half_even(x / s_x), -128, 127)

with the integer GEMM exact (int32 in an engine; here float32 GEMMs over 1024-column chunks, each sum an integer
below 2^24, added in float64: ``exact_int_matmul``) and the scaling in float32,
cast to the activation dtype at the end, as vLLM's CPU and CUDA int8 kernels do.

Sharding (load time, by the TP rules): ``W_q`` shards as the float weight would. A channel scale follows the output
rows: column-parallel layers narrow it with the weight's rows (fused QKV / gate_up: into each partition's slot; a
replicated KV head's scale with its head), row-parallel layers hold it whole (their output is not split). A
per-tensor scale is one number per fused partition (q, k, v / gate, up), expanded to the partition's channels after
loading (vLLM's ``convert_to_channelwise``), never re-quantized. A static ``input_scale`` is per layer, the same on
every rank.

A ``kv_cache_scheme`` (FP8 e4m3 with static k/v scales, per tensor or per KV head) gives the attention layers an
FP8 KV cache (``impl.quant_kv``). Anything else in ``quantization_config`` is refused with the field and the supported values (never a load that goes
on with defaults: a missing ``weight_scale`` is a missing tensor, not 1.0)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from impl.errors import ConfigError, ShapeMismatch
from impl.quant_kv import KvCacheScheme, parse_kv_cache_scheme

QMAX = 127
SUPPORTED = "compressed-tensors int-quantized W8A8 (8-bit int) or float-quantized W8A8 (8-bit float, e4m3): " \
            "symmetric weights (channel or tensor strategy), symmetric activations of the same type (dynamic per " \
            "token, or static per tensor)"
#: ``format`` -> the ``type`` of its weights and activations (``impl.quant_fp8``: the float8_e4m3fn math)
FORMATS = {"int-quantized": "int", "float-quantized": "float"}


class QuantConfigError(ConfigError):
    """A ``quantization_config`` impl cannot run: names the field and what is supported."""


@dataclass(frozen=True)
class Int8Scheme:
    """What a compressed-tensors W8A8 ``quantization_config`` asks for. ``weight_strategy``: "channel" or
    "tensor"; ``dynamic_input``: per-token scales at run time (else one static ``input_scale`` per layer);
    ``ignore``: modules left in float (vLLM's ``ignore`` list; impl requires ``lm_head`` in it); ``num_type``:
    "int" (INT8, ``format: int-quantized``) or "float" (FP8 e4m3, ``format: float-quantized``)."""

    weight_strategy: str
    dynamic_input: bool
    ignore: tuple[str, ...] = ("lm_head",)
    quantizes_activations = True  # W8A8 (a GPTQ scheme: False)
    num_type: str = "int"
    kv_cache: str | None = None  # an FP8 KV cache's scale strategy ("tensor" / "attn_head": impl.quant_kv)

    @property
    def name(self) -> str:
        kind = "w8a8-int8" if self.num_type == "int" else "w8a8-fp8"
        kv = "" if self.kv_cache is None else f", FP8 KV cache ({self.kv_cache} scales)"
        return f"{kind} ({self.weight_strategy} weights, {'dynamic per-token' if self.dynamic_input else 'static'} activations{kv})"


def _field(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise QuantConfigError(f"quantization_config: {where} has no {key!r} (supported: {SUPPORTED})")
    return d[key]


def _int8_args(args: dict, where: str, strategies: tuple[str, ...], num_type: str = "int") -> dict:
    """One ``weights`` / ``input_activations`` entry: 8 bits of ``num_type``, symmetric, a strategy in
    ``strategies``."""
    for key, want in (("num_bits", 8), ("type", num_type), ("symmetric", True)):
        got = _field(args, key, where)
        if got != want:
            raise QuantConfigError(f"quantization_config: {where}.{key} = {got!r}, impl supports {want!r} "
                                   f"({SUPPORTED})")
    strategy = _field(args, "strategy", where)
    if strategy not in strategies:
        raise QuantConfigError(f"quantization_config: {where}.strategy = {strategy!r}, impl supports "
                               f"{' or '.join(map(repr, strategies))} ({SUPPORTED})")
    return args


def parse_quant_config(raw: dict | None):
    """The scheme of a checkpoint's ``quantization_config`` (None: not quantized): an ``Int8Scheme``, or a
    ``impl.quant_kv.KvCacheScheme`` (no ``config_groups``, a ``kv_cache_scheme``: float linears, an FP8 KV cache);
    QuantConfigError otherwise. (``impl.quant_awq.parse_quantization_config`` reads ``awq`` and ``gptq`` first.)"""
    if raw is None:
        return None
    method = _field(raw, "quant_method", "the config")
    if method != "compressed-tensors":
        raise QuantConfigError(f"quantization_config.quant_method = {method!r} is not supported: impl runs {SUPPORTED}; or gptq, awq")
    try:
        kv_cache = parse_kv_cache_scheme(raw.get("kv_cache_scheme"))
    except ConfigError as e:
        raise QuantConfigError(str(e)) from None
    if raw.get("config_groups") == {} and kv_cache is not None:  # only the KV cache is quantized
        return KvCacheScheme(kv_cache)
    fmt = _field(raw, "format", "the config")
    if fmt not in FORMATS:
        raise QuantConfigError(f"quantization_config.format = {fmt!r} is not supported: impl runs {SUPPORTED}")
    groups = _field(raw, "config_groups", "the config")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise QuantConfigError(f"quantization_config.config_groups: impl supports one group, got "
                               f"{len(groups) if isinstance(groups, dict) else type(groups).__name__}")
    (gname, group), = groups.items()
    where = f"config_groups.{gname}"
    targets = _field(group, "targets", where)
    if list(targets) != ["Linear"]:
        raise QuantConfigError(f"quantization_config: {where}.targets = {targets!r}, impl supports ['Linear']")
    num_type = FORMATS[fmt]
    w = _int8_args(_field(group, "weights", where), f"{where}.weights", ("channel", "tensor"), num_type)
    if w.get("block_structure") is not None or w.get("group_size") is not None:
        raise QuantConfigError(f"quantization_config: {where}.weights.block_structure / group_size is set: block "
                               f"and group scales are not supported ({SUPPORTED})")
    if w.get("dynamic"):
        raise QuantConfigError(f"quantization_config: {where}.weights.dynamic = true: weights must be static")
    a = group.get("input_activations")
    if a is None:
        raise QuantConfigError(f"quantization_config: {where} has no input_activations (weight-only int8 is not "
                               f"supported: {SUPPORTED})")
    dynamic = bool(a.get("dynamic"))
    _int8_args(a, f"{where}.input_activations", ("token",) if dynamic else ("tensor",), num_type)
    if group.get("output_activations") is not None:
        raise QuantConfigError(f"quantization_config: {where}.output_activations is set; impl does not quantize outputs")
    ignore = tuple(raw.get("ignore") or ())
    if "lm_head" not in ignore:
        raise QuantConfigError("quantization_config.ignore does not list 'lm_head': a quantized lm_head is not "
                               "supported (impl keeps the vocab-parallel head in float)")
    return Int8Scheme(w["strategy"], dynamic, ignore, num_type, kv_cache)


def quantize_per_token(x: torch.Tensor, work: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization of each row of ``x`` ``[T, K]``: ``(q_x, s_x [T, 1])`` in ``work`` with
    ``s_x = max|x_t| / 127`` (a zero row: scale 1, q 0). ``work``: float32 as the kernels compute it; the golden
    (``tpcheck.reference.quantized``) asks for float64."""
    xw = x.to(work)
    s = xw.abs().amax(dim=-1, keepdim=True) / QMAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(xw / s).clamp_(-QMAX - 1, QMAX), s


def quantize_static(x: torch.Tensor, scale: torch.Tensor, work: torch.dtype = torch.float32) -> torch.Tensor:
    """``clamp(round(x / input_scale), -128, 127)`` in ``work`` (one scale for every token)."""
    return torch.round(x.to(work) / scale.to(work)).clamp_(-QMAX - 1, QMAX)


class Int8LinearMethod:
    """INT8 W8A8 for one parallel linear (``layer``): parameters created by ``create_weights``, loaded by the
    layer's own sharding rules (``weight_loader``, ``scale_loader``), applied by ``apply`` (a per-tensor scale
    expanded to its partition's channels there: ``channel_scale``)."""

    def __init__(self, scheme: Int8Scheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, partitions: list[int]) -> None:
        """``weight`` int8 ``[out_local, in_local]``; ``weight_scale`` float32 ``[out_local, 1]`` (channel) or one
        per fused partition (tensor); ``input_scale`` ``[1]`` when static. ``partitions``: the local widths of the
        fused outputs (one entry for an unfused layer)."""
        layer.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=torch.int8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        shape = (out_local, 1) if self.scheme.weight_strategy == "channel" else (len(partitions),)
        layer.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        layer.weight_scale.weight_loader = layer.scale_loader
        if not self.scheme.dynamic_input:
            layer.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
            layer.input_scale.weight_loader = _whole
        layer.partitions = list(partitions)

    def channel_scale(self, layer: nn.Module) -> torch.Tensor:
        """``[out_local]`` float32: the per-channel scale (a per-tensor scale repeated over its partition)."""
        s = layer.weight_scale
        if self.scheme.weight_strategy == "channel":
            return s.reshape(-1)
        return torch.cat([s[i].expand(w) for i, w in enumerate(layer.partitions)])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scheme.dynamic_input:
            qx, sx = quantize_per_token(x2)
        else:
            sx = layer.input_scale
            qx = quantize_static(x2, sx)
        # float32, not float64: exact for int8 values, half the bytes to convert (no copy is kept: the loaders and
        # the faults write the int8 weight through .data, which no version counter sees)
        acc = exact_int_matmul(qx, layer.weight.float())
        y = acc.float() * (sx * self.channel_scale(layer))
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], -1)


#: K per float32 GEMM: |q_x| <= 128 and |W_q| <= 128, so a chunk's sums stay integers <= 1024 * 2^14 = 2^24, exact in
#: float32 whatever the order of the additions; the chunks are added in float64 (exact below 2^53)
EXACT_CHUNK = 1024


def exact_int_matmul(qx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``qx @ w^T`` of integer-valued float32 operands (int8 values) as exact integers in float64: float32 GEMMs over
    K chunks of ``EXACT_CHUNK``, summed in float64. (A float64 GEMM on float64 copies is exact too, and slower: the
    ``benchmarks/quant_cost.py --layer`` figures in README.)"""
    k = qx.shape[-1]
    acc = None
    for s in range(0, k, EXACT_CHUNK):
        part = (qx[:, s:s + EXACT_CHUNK] @ w[:, s:s + EXACT_CHUNK].t()).double()
        acc = part if acc is None else acc + part
    return acc


def _whole(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A tensor every rank holds whole (a static input scale)."""
    if tuple(loaded.shape) not in ((1,), ()):
        raise ShapeMismatch(f"checkpoint shape {list(loaded.shape)} != expected [1] (one scale per layer)")
    param.data.copy_(loaded.narrow(0, 0, 1) if tuple(loaded.shape) == (1,) else loaded[()])


def per_tensor_slot(param: nn.Parameter, loaded, slot: int) -> None:
    """A fused layer's per-tensor weight scale: partition ``slot``'s one number."""
    if tuple(loaded.shape) not in ((1,), ()):
        raise ShapeMismatch(f"checkpoint shape {list(loaded.shape)} != expected [1] (a per-tensor weight scale)")
    param.data[slot:slot + 1].copy_(loaded.narrow(0, 0, 1) if tuple(loaded.shape) == (1,) else loaded[()].reshape(1))
