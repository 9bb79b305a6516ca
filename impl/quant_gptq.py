"""4-bit GPTQ (W4A16) linears in vLLM's pattern: ``GptqLinearMethod.create_weights`` registers the packed
parameters, each with its own loader, and ``apply`` runs the layer.

Format (``quantization_config.quant_method == "gptq"``, as AutoGPTQ / GPTQModel write it, format v1), for a
linear ``y = x W`` with ``W`` ``[K = in, N = out]``:

* ``qweight`` int32 ``[K/8, N]``: ``q[k, n]`` (0..15) is nibble ``k % 8`` (bits ``4*(k%8)`` ..) of
  ``qweight[k // 8, n]`` (eight values packed along the input dim);
* ``qzeros`` int32 ``[G, N/8]``: ``zero[g, n] - 1`` is nibble ``n % 8`` of ``qzeros[g, n // 8]`` (v1 stores the
  zero point minus one; symmetric 4-bit: zero 8, stored 7, every word ``0x77777777``);
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of each input row (``k // group_size``
  without act-order; any assignment of ``group_size`` rows per group with ``desc_act``). ``G = K / group_size``.

    W[k, n] = scales[g_idx[k], n] * (q[k, n] - (stored_zero[g_idx[k], n] + 1))

``apply`` dequantizes ``W`` in float32 (exact: a float16 scale times an integer in [-15, 15]), computes
``x.float() @ W`` (+ bias in float32) and casts to the activation dtype: the activation's float upcast, as vLLM's
CPU kernel (``cpu_gemm_wna16``) accumulates in float32. (vLLM reads ``sym`` 4-bit as ``uint4b8``, zero 8, and
ignores ``qzeros``; impl applies the stored zeros, which equal 8 in a symmetric checkpoint.)

Sharding (load time): column-parallel layers (q/k/v, gate/up, fused) split the output: ``qweight`` and ``scales``
columns and ``qzeros`` packed columns (so a rank's slot must be a multiple of 8 output columns); a fused layer loads
each partition's columns into its slot (``column_slot``). Row-parallel layers (o_proj, down_proj) split the input:
``qweight`` rows ``[r K/8/tp, ...)``, ``g_idx`` rows ``[r K/tp, ...)``; without act-order ``scales`` / ``qzeros``
rows by group, ``[r G/tp, ...)``, so a shard must be a whole number of groups (else refused, vLLM's rule); with
act-order a rank's rows may use any group, so ``scales`` / ``qzeros`` are held whole (as earlier vLLM releases'
``gptq.py`` did for ``desc_act`` on row-parallel ranks, recalled, not re-read here: vLLM 0.32 has no such path, it
refuses ``desc_act`` with groups outright)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from impl.errors import ShapeMismatch, check_shape
from impl.quant import Int8Scheme, QuantConfigError, parse_quant_config

PACK = 8  # 4-bit values per int32
GROUP_SIZES = (32, 64, 128)
SUPPORTED = "gptq: bits 4, sym true, group_size 32 / 64 / 128, desc_act false or true, checkpoint_format gptq (v1)"


@dataclass(frozen=True)
class GptqScheme:
    """A GPTQ ``quantization_config``: 4-bit symmetric, ``group_size`` input rows per scale, ``desc_act``
    (act-order: rows assigned to groups by ``g_idx``)."""

    group_size: int
    desc_act: bool
    weight_strategy: str = "group"
    quantizes_activations: bool = False

    @property
    def name(self) -> str:
        return f"gptq-w4a16 (group {self.group_size}{', act-order' if self.desc_act else ''})"


def parse_quantization_config(raw: dict | None) -> Int8Scheme | GptqScheme | None:
    """Any ``quantization_config`` impl runs: ``quant_method: gptq`` here, the others by ``impl.quant``."""
    if isinstance(raw, dict) and raw.get("quant_method") == "gptq":
        return parse_gptq_config(raw)
    return parse_quant_config(raw)


def parse_gptq_config(raw: dict) -> GptqScheme:
    """The scheme of a ``quant_method: gptq`` config; QuantConfigError naming the field otherwise."""
    def field(key):
        if key not in raw:
            raise QuantConfigError(f"quantization_config has no {key!r} (supported: {SUPPORTED})")
        return raw[key]
    for key, want in (("bits", 4), ("sym", True)):
        if field(key) != want:
            raise QuantConfigError(f"quantization_config.{key} = {raw[key]!r}, impl supports {want!r} ({SUPPORTED})")
    gs = field("group_size")
    if gs not in GROUP_SIZES:
        raise QuantConfigError(f"quantization_config.group_size = {gs!r}, impl supports {GROUP_SIZES} ({SUPPORTED})")
    desc = field("desc_act")
    if not isinstance(desc, bool):
        raise QuantConfigError(f"quantization_config.desc_act = {desc!r}, must be true or false")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise QuantConfigError(f"quantization_config.checkpoint_format = {fmt!r}, impl supports 'gptq' (v1 zeros)")
    for key in ("dynamic", "lm_head"):
        if raw.get(key):
            raise QuantConfigError(f"quantization_config.{key} = {raw[key]!r} is not supported ({SUPPORTED})")
    return GptqScheme(gs, desc)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` values 0..15 -> int32 ``[K/8, N]``: row ``k`` in nibble ``k % 8`` of packed row ``k // 8``."""
    k, n = q.shape
    v = q.to(torch.int64).reshape(k // PACK, PACK, n)
    shifts = (torch.arange(PACK, dtype=torch.int64) * 4).reshape(1, PACK, 1)
    return _to_int32((v << shifts).sum(1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_rows``: int32 ``[K/8, N]`` -> int64 ``[K, N]`` in 0..15."""
    shifts = (torch.arange(PACK, dtype=torch.int64) * 4).reshape(1, PACK, 1)
    v = (packed.to(torch.int64).unsqueeze(1) >> shifts) & 0xF
    return v.reshape(-1, packed.shape[1])


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """``[G, N]`` values 0..15 -> int32 ``[G, N/8]``: column ``n`` in nibble ``n % 8`` of packed column ``n // 8``."""
    return pack_rows(q.t()).t().contiguous()


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_cols``: int32 ``[G, N/8]`` -> int64 ``[G, N]``."""
    return unpack_rows(packed.t()).t()


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 bit pattern (two's complement)."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W [K, N]`` in ``dtype``: ``scales[g_idx[k], n] * (q[k, n] - (qzeros' nibble + 1))`` (module docstring);
    ``g_idx`` indexes the rows of the ``scales`` / ``qzeros`` given."""
    q = unpack_rows(qweight)
    zero = unpack_cols(qzeros) + 1
    g = g_idx.long()
    return scales.to(dtype)[g] * (q - zero[g]).to(dtype)


@contextlib.contextmanager
def layer_name(name: str):
    """Prefix a QuantConfigError raised while building a layer with the layer's checkpoint name."""
    try:
        yield
    except QuantConfigError as e:
        raise QuantConfigError(f"{name}: {e}") from None


class GptqLinearMethod:
    """GPTQ W4A16 for one parallel linear ``layer``. ``create_weights`` registers ``qweight``, ``qzeros``,
    ``scales``, ``g_idx`` (loaders: ``load_out`` on the output dim, ``load_in`` on the input dim by the layer's
    rules); ``apply`` computes ``x @ W`` (module docstring)."""

    def __init__(self, scheme: GptqScheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, in_total: int,
                       row_parallel: bool) -> None:
        gs = self.scheme.group_size
        if in_total % gs or in_local % PACK or out_local % PACK:
            raise QuantConfigError(f"a linear of input {in_total} (local {in_local}) and local output {out_local}: "
                                   f"input must be a multiple of group_size {gs} and local widths of {PACK}")
        if row_parallel and not self.scheme.desc_act and in_local % gs:
            raise QuantConfigError(f"row-parallel shard of {in_local} input rows (input_size {in_total} over tp "
                                   f"{in_total // in_local}) is not a whole number of group_size {gs} groups")
        whole = row_parallel and self.scheme.desc_act
        groups = in_total // gs if (whole or not row_parallel) else in_local // gs
        layer.gptq_scales_whole = whole
        for name, shape, dtype in (("qweight", (in_local // PACK, out_local), torch.int32),
                                   ("qzeros", (groups, out_local // PACK), torch.int32),
                                   ("scales", (groups, out_local), torch.float16), ("g_idx", (in_local,), torch.int32)):
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.weight_loader = layer.gptq_loader
            setattr(layer, name, p)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        g = layer.g_idx.long()
        if layer.quant_row_parallel and not layer.gptq_scales_whole:  # local scales: groups from this rank's first
            g = g - layer.tp_rank * layer.scales.shape[0]
        return matmul_w4a16(x, dequantize(layer.qweight, layer.qzeros, layer.scales, g), bias)


def matmul_w4a16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w`` (+ bias) with ``w`` the float32 dequantized ``[K, N]``: the activation upcast, float32 sums (as
    vLLM's CPU WNA16 kernel accumulates), cast back to ``x``'s dtype."""
    y = x.reshape(-1, x.shape[-1]).float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def load_columns(layer: nn.Module, name: str, param: nn.Parameter, loaded, slot: tuple[int, int, int, int],
                 packed: tuple[str, ...] = ("qzeros",)) -> None:
    """A column-parallel (or replicated) layer's GPTQ / AWQ tensor: ``slot = (local offset, width, source start,
    total width)`` in output columns; the ``packed`` tensors (GPTQ: ``qzeros``; AWQ: ``qweight`` and ``qzeros``)
    in packed columns (all divided by 8), ``g_idx`` whole."""
    offset, size, start, total = slot
    if name == "g_idx":
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))
        return
    if name in packed:
        if offset % PACK or size % PACK or start % PACK:
            raise ShapeMismatch(f"{name} packs {PACK} output columns per int32: a shard of {size} columns at "
                                f"{start} is not a whole number of packed columns")
        offset, size, start, total = offset // PACK, size // PACK, start // PACK, total // PACK
    check_shape(loaded, (param.shape[0], total))
    param.data.narrow(1, offset, size).copy_(loaded.narrow(1, start, size))


def load_rows(layer: nn.Module, name: str, param: nn.Parameter, loaded) -> None:
    """A row-parallel layer's GPTQ / AWQ tensor: rank r's block of rows: GPTQ ``qweight`` ``[r K/8/tp ...)``,
    ``g_idx`` ``[r K/tp ...)``, ``scales`` / ``qzeros`` ``[r G/tp ...)`` (or whole with act-order, module docstring);
    AWQ ``qweight`` ``[r K/tp ...)``, ``scales`` / ``qzeros`` ``[r G/tp ...)``."""
    rows = param.shape[0]
    if name in ("scales", "qzeros") and layer.gptq_scales_whole:
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.narrow(0, 0, rows))
        return
    check_shape(loaded, (rows * layer.tp_size, *param.shape[1:]))
    param.data.copy_(loaded.narrow(0, layer.tp_rank * rows, rows))
