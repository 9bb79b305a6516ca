"""4-bit AWQ (W4A16) linears in vLLM's pattern: ``AwqLinearMethod.create_weights`` registers the packed
parameters, each with its layer's ``awq_loader``, and ``apply`` runs the layer.

Format (``quantization_config.quant_method == "awq"``, AutoAWQ's GEMM version, as vLLM's ``AutoAWQConfig`` reads
it), for a linear ``y = x W`` with ``W`` ``[K = in, N = out]`` and ``G = K / group_size`` groups of input rows:

* ``qweight`` int32 ``[K, N/8]``: eight output columns per word, packed along the **output** dim in AWQ's
  interleaved order: column ``8 c + j`` is nibble ``AWQ_REVERSE_ORDER[j]`` (bits ``4 * that`` ..) of
  ``qweight[k, c]``, ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]`` (vLLM's ``_REVERSE_AWQ_PACK_ORDER``: AutoAWQ
  writes nibble ``i`` from column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``);
* ``qzeros`` int32 ``[G, N/8]``, the same packing: the zero point itself (0..15, asymmetric; not minus one as
  GPTQ v1 stores it);
* ``scales`` float16 ``[G, N]``.

    W[k, n] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])

``apply`` dequantizes ``W`` in float32 (exact: a float16 scale times an integer in [-15, 15]), computes
``x.float() @ W`` (+ bias in float32) and casts to the activation dtype: vLLM on CPU repacks AWQ to the GPTQ
layout with zero points and runs the same float32-accumulating ``CPUWNA16`` kernel as for GPTQ.

Sharding (load time, ``impl.quant_gptq.load_columns`` / ``load_rows``): column-parallel layers split the output:
``qweight`` and ``qzeros`` by packed columns (a rank's slot must be a multiple of 8 output columns), ``scales`` by
columns; a fused layer loads each partition's columns into its slot. Row-parallel layers split the input:
``qweight`` rows ``[r K/tp, ...)``, ``scales`` / ``qzeros`` rows ``[r G/tp, ...)``, so a rank's shard must be a
whole number of groups: vLLM refuses one that is not ("The input size is not aligned with the quantized weight
shape. This can be caused by too large tensor parallel size."); impl too, with the numbers."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from impl.quant import Int8Scheme, QuantConfigError
from impl.quant_gptq import GROUP_SIZES, PACK, GptqScheme, matmul_w4a16, pack_cols, unpack_cols
from impl.quant_gptq import parse_quantization_config as parse_other

#: nibble of output column ``8 c + j`` in word ``c`` (vLLM's ``_REVERSE_AWQ_PACK_ORDER``)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: output column (within its 8) that nibble ``i`` holds: AutoAWQ's pack order, the inverse permutation
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = "awq: bits 4, group_size 32 / 64 / 128, zero_point true, version gemm"


@dataclass(frozen=True)
class AwqScheme:
    """An AWQ ``quantization_config``: 4-bit with zero points, ``group_size`` input rows per scale / zero."""

    group_size: int
    weight_strategy: str = "group"
    quantizes_activations: bool = False

    @property
    def name(self) -> str:
        return f"awq-w4a16 (group {self.group_size}, zero points)"


def parse_quantization_config(raw: dict | None) -> Int8Scheme | GptqScheme | AwqScheme | None:
    """Any ``quantization_config`` impl runs: ``quant_method: awq`` here, the others by ``impl.quant_gptq``."""
    if isinstance(raw, dict) and raw.get("quant_method") == "awq":
        return parse_awq_config(raw)
    return parse_other(raw)


def parse_awq_config(raw: dict) -> AwqScheme:
    """The scheme of a ``quant_method: awq`` config; QuantConfigError naming the field otherwise (AutoAWQ's
    aliases ``w_bit`` / ``q_group_size`` read as vLLM reads them)."""
    def field(*keys):
        for key in keys:
            if key in raw:
                return key, raw[key]
        raise QuantConfigError(f"quantization_config has no {keys[0]!r} (supported: {SUPPORTED})")
    key, bits = field("bits", "w_bit")
    if bits != 4:
        raise QuantConfigError(f"quantization_config.{key} = {bits!r}, impl supports 4 ({SUPPORTED})")
    key, gs = field("group_size", "q_group_size")
    if gs not in GROUP_SIZES:
        raise QuantConfigError(f"quantization_config.{key} = {gs!r}, impl supports {GROUP_SIZES} ({SUPPORTED})")
    _, zp = field("zero_point")
    if zp is not True:
        raise QuantConfigError(f"quantization_config.zero_point = {zp!r}: impl runs AWQ with zero points only "
                               f"({SUPPORTED})")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantConfigError(f"quantization_config.version = {raw['version']!r}, impl reads the GEMM layout "
                               f"({SUPPORTED})")
    for key in ("lm_head", "modules_to_not_convert"):
        if raw.get(key):
            raise QuantConfigError(f"quantization_config.{key} = {raw[key]!r} is not supported ({SUPPORTED})")
    return AwqScheme(gs)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` values 0..15 -> int32 ``[R, N/8]`` in AWQ's order: nibble ``i`` of word ``c`` holds column
    ``8 c + AWQ_PACK_ORDER[i]``."""
    r, n = q.shape
    return pack_cols(q.reshape(r, n // PACK, PACK)[:, :, list(AWQ_PACK_ORDER)].reshape(r, n))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_awq``: int32 ``[R, N/8]`` -> int64 ``[R, N]``, column ``8 c + j`` from nibble
    ``AWQ_REVERSE_ORDER[j]``."""
    v = unpack_cols(packed)
    r, n = v.shape
    return v.reshape(r, n // PACK, PACK)[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, n)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W [K, N]`` in ``dtype``: ``scales[k // gs, n] * (q[k, n] - zero[k // gs, n])`` with ``gs = K / G`` (the
    rows of the ``scales`` / ``qzeros`` given: a row-parallel rank's own groups)."""
    q, zero = unpack_awq(qweight), unpack_awq(qzeros)
    g = torch.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    return scales.to(dtype)[g] * (q - zero[g]).to(dtype)


class AwqLinearMethod:
    """AWQ W4A16 for one parallel linear ``layer``: ``create_weights`` registers ``qweight``, ``qzeros``, ``scales``
    (loaded by the layer's ``awq_loader``); ``apply`` computes ``x @ W`` (module docstring)."""

    def __init__(self, scheme: AwqScheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, in_total: int,
                       row_parallel: bool) -> None:
        gs = self.scheme.group_size
        if in_total % gs or out_local % PACK:
            raise QuantConfigError(f"a linear of input {in_total} and local output {out_local}: input must be a "
                                   f"multiple of group_size {gs} and the local output of {PACK}")
        if in_local % gs:  # vLLM: "The input size is not aligned with the quantized weight shape"
            raise QuantConfigError(f"row-parallel shard of {in_local} input rows (input_size {in_total} over tp "
                                   f"{in_total // in_local}) is not a whole number of group_size {gs} groups")
        layer.gptq_scales_whole = False  # no act-order: a row-parallel rank holds its own groups' scales
        for name, shape, dtype in (("qweight", (in_local, out_local // PACK), torch.int32),
                                   ("qzeros", (in_local // gs, out_local // PACK), torch.int32),
                                   ("scales", (in_local // gs, out_local), torch.float16)):
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = layer.awq_loader
            setattr(layer, name, p)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return matmul_w4a16(x, dequantize(layer.qweight, layer.qzeros, layer.scales), bias)
