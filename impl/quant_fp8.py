"""FP8 W8A8 linears (compressed-tensors ``format == "float-quantized"``), in vLLM's pattern as ``impl.quant``'s INT8.

Weights ``W_q`` are float8_e4m3fn ``[out, in]`` with a float32 scale per output channel (``weight_scale [out, 1]``)
or per tensor (``[1]``); activations are float8_e4m3fn too, quantized per token at run time (``s_x = max|x_t| /
448``, 448 the largest e4m3 number) or with one static ``input_scale`` ``[1]``. The layer computes

    q_x = e4m3(clamp(x / s_x, -448, 448))        # round to nearest, ties to even (torch's cast)
    y   = (q_x @ W_q^T) * s_x * s_w  (+ b)      # upcast to float32, float32 accumulation, cast to x's dtype

The product of two e4m3 numbers is exact in float32 (4 + 4 significant bits), so the float32 GEMM on the upcast
operands is what ``torch._scaled_mm`` computes (fp8 operands, float32 accumulation) up to the order of the sums;
vLLM's CPU build runs per-tensor / per-channel FP8 through it. impl upcasts explicitly: ``_scaled_mm`` on CPU is
not available in every torch build, and the float32 matmul is the same sum.

The cast to e4m3 goes through float32 in every ``work`` dtype (torch's own float64 -> e4m3 cast does: a float64
value within 2^-24 of a tie rounds as the tie), so impl (float32) and the golden (float64, ``tpcheck.reference.
quantized``) round by one rule.

Sharding: as INT8 (``impl.quant``): ``W_q`` and a channel scale follow the weight's rows; a per-tensor scale is one
number per fused partition (q, k, v / gate, up). After loading, a fused layer with per-tensor scales is
**re-quantized to the maximum** of its partitions' scales, as vLLM does (``requantize_with_max_scale``): each
partition's ``W_q`` is dequantized (``W_q * s_i`` in float16, vLLM's ``per_tensor_dequantize``) and quantized again
with ``s_max`` (``e4m3(clamp(W / s_max))``, the division in float32); the layer then holds one scale. The checkpoint
means this (vLLM is the format's engine), so the golden does the same re-quantization (``requantize_to_max``) in
float64. Static ``input_scale``: one per partition in the checkpoint; the layer uses their maximum (vLLM's
``input_scale.max()``), the same on every rank."""
from __future__ import annotations

import torch
from torch import nn

from impl.errors import ShapeMismatch
from impl.fp8 import FP8, FP8_MAX, to_fp8  # noqa: F401 (re-exported: the golden and the quantizer import them here)
from impl.quant import Int8LinearMethod, Int8Scheme


def quantize_fp8_per_token(x: torch.Tensor, work: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of each row of ``x`` ``[T, K]``: ``(q_x, s_x [T, 1])``, ``q_x`` as e4m3 values in
    ``work``, ``s_x = max|x_t| / 448`` computed in ``work`` (a zero row: scale 1, q 0). ``work``: float32 as the
    kernels compute it; the golden asks for float64."""
    xw = x.to(work)
    s = xw.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    s = torch.where(s == 0, torch.ones_like(s), s)
    return to_fp8(xw / s).to(work), s


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor, work: torch.dtype = torch.float32) -> torch.Tensor:
    """``e4m3(clamp(x / input_scale, -448, 448))`` as values in ``work`` (one scale for every token)."""
    return to_fp8(x.to(work) / scale.to(work)).to(work)


def requantize_to_max(parts: list[torch.Tensor], scales: torch.Tensor,
                      work: torch.dtype = torch.float16) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM's ``requantize_with_max_scale``: the e4m3 partitions ``parts`` (scales ``scales[i]``) re-quantized to
    ``s_max = max(scales)``: ``e4m3(clamp((W_i * s_i) / s_max))`` with the product in ``work`` (float16 as vLLM's
    ``per_tensor_dequantize``; the golden: float64) and the division in float32 (float64 for the golden).
    Returns the new e4m3 partitions and ``s_max`` ``[1]`` (float32)."""
    s_max = scales.max().reshape(1).to(torch.float32)
    div = torch.float64 if work == torch.float64 else torch.float32
    out = []
    for w, s in zip(parts, scales.reshape(-1)):
        if bool(s == s_max[0]):
            out.append(w.clone())  # dequantize and quantize with one scale: the same e4m3 values
            continue
        dq = w.to(work) * s.to(work)
        out.append(to_fp8(dq.to(div) / s_max.to(div)))
    return out, s_max


class Fp8LinearMethod:
    """FP8 W8A8 for one parallel linear (``layer``): ``create_weights`` registers the e4m3 ``weight`` and the float32
    scales with the layer's loaders, ``process_weights_after_loading`` re-quantizes fused per-tensor scales to their
    maximum, ``apply`` runs the layer (the module docstring: the math)."""

    def __init__(self, scheme: Int8Scheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, out_local: int, in_local: int, partitions: list[int]) -> None:
        """``weight`` e4m3 ``[out_local, in_local]``; ``weight_scale`` float32 ``[out_local, 1]`` (channel) or one per
        fused partition (tensor); ``input_scale`` one per fused partition when static."""
        layer.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=FP8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        shape = (out_local, 1) if self.scheme.weight_strategy == "channel" else (len(partitions),)
        layer.weight_scale = nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float32), requires_grad=False)
        layer.weight_scale.weight_loader = layer.scale_loader
        if not self.scheme.dynamic_input:
            layer.input_scale = nn.Parameter(torch.full((len(partitions),), float("nan")), requires_grad=False)
            layer.input_scale.weight_loader = layer.input_scale_loader
        layer.partitions = list(partitions)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Refuse a scale no checkpoint tensor filled; re-quantize a fused per-tensor layer to its maximum scale."""
        for pname in ("weight_scale", "input_scale"):
            p = getattr(layer, pname, None)
            if p is not None and bool(torch.isnan(p).any()):
                raise ShapeMismatch(f"{pname}: a partition's scale was not in the checkpoint (still unset)")
        if self.scheme.weight_strategy != "tensor" or len(layer.partitions) == 1:
            return
        parts = list(layer.weight.data.split(layer.partitions, dim=0))
        new, s_max = requantize_to_max(parts, layer.weight_scale.data)
        layer.weight.data.copy_(torch.cat(new, dim=0))
        layer.weight_scale.data.fill_(s_max[0])

    channel_scale = Int8LinearMethod.channel_scale  # the same scale layout as INT8's

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scheme.dynamic_input:
            qx, sx = quantize_fp8_per_token(x2)
        else:
            sx = layer.input_scale.max().reshape(1)
            qx = quantize_fp8_static(x2, sx)
        acc = qx @ layer.weight.float().t()  # float32 accumulation of exact e4m3 products
        y = acc * sx * self.channel_scale(layer)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], -1)
