"""4-bit AWQ checkpoints (W4A16, AutoAWQ's GEMM layout, as vLLM reads it): round to nearest per group, with zero
points.

``quantize_awq_checkpoint(src, dst, scheme)`` writes each decoder-layer linear weight
(``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``) as ``qweight``,
``qzeros`` and ``scales`` (``impl.quant_awq``'s module docstring: layout and AWQ's interleaved packing); every other
tensor as it is, ``config.json`` with ``quantization_config`` (``awq_quantization_config``), the other top-level
files copied (``tpcheck.inputs.models.quantize_gptq.write_4bit``).

The math, AutoAWQ's ``pseudo_quantize_tensor`` with ``zero_point`` for the float weight ``W = weight^T``
``[K = in, N = out]``, each group ``g`` of ``group_size`` consecutive input rows and output column ``n``::

    scale[g, n] = float16(max(max(W[g rows, n]) - min(W[g rows, n]), 1e-5) / 15)   # in float64, stored float16
    zero[g, n]  = clamp(-round(min(W[g rows, n]) / scale[g, n]), 0, 15)           # with the float16 scale
    q[k, n]     = clamp(round(W[k, n] / scale[g, n]) + zero[g, n], 0, 15)         # half to even

No activation-aware scale search (AWQ's per-channel input scaling, folded into the previous layer): the format is
what is checked, not the quality of the rounding."""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from impl.quant_awq import pack_awq
from tpcheck.inputs.models.quant_schemes import AWQ_SCHEMES
from tpcheck.inputs.models.quantize_gptq import quantize_any as quantize_other
from tpcheck.inputs.models.quantize_gptq import quantized_tensors, write_4bit

_SCHEME = re.compile(r"awq-w4g(32|64|128)")


def awq_group_size(scheme: str) -> int:
    """The ``group_size`` of a scheme name."""
    m = _SCHEME.fullmatch(scheme)
    if m is None:
        raise ValueError(f"unknown AWQ scheme {scheme!r}; supported: {', '.join(AWQ_SCHEMES)}")
    return int(m.group(1))


def awq_quantization_config(scheme: str) -> dict:
    """``quantization_config`` as AutoAWQ writes it into ``config.json`` (vLLM reads ``bits``, ``group_size``,
    ``zero_point``, ``modules_to_not_convert``; ``version`` picks the GEMM layout)."""
    return {"quant_method": "awq", "bits": 4, "group_size": awq_group_size(scheme), "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def quantize_awq_weight(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """An HF weight ``[out, in]`` -> ``{qweight, qzeros, scales}`` (module docstring)."""
    w = weight.detach().to(torch.float64).t()  # [K, N]
    k, n = w.shape
    if k % group_size or n % 8:
        raise ValueError(f"input {k} is not a multiple of group_size {group_size} or output {n} of 8")
    groups = w.reshape(k // group_size, group_size, n)
    lo, hi = groups.amin(1), groups.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    if not bool(torch.isfinite(scales).all()) or bool((scales == 0).any()):
        raise ValueError("a group's scale is out of float16's range")
    s = scales.double()
    zeros = (-torch.round(lo / s)).clamp(0, 15)
    q = (torch.round(groups / s[:, None]) + zeros[:, None]).clamp(0, 15).reshape(k, n)
    return {"qweight": pack_awq(q.long()), "qzeros": pack_awq(zeros.long()), "scales": scales}


def quantize_any(src: str | os.PathLike, dst: str | os.PathLike, scheme: str) -> Path:
    """``scheme``'s quantization of ``src`` into ``dst``: an ``awq-*`` scheme here, the others by
    ``tpcheck.inputs.models.quantize_gptq.quantize_any`` (GPTQ, INT8 / FP8 W8A8)."""
    if scheme in AWQ_SCHEMES:
        return quantize_awq_checkpoint(src, dst, scheme)
    return quantize_other(src, dst, scheme)


def quantize_awq_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str) -> Path:
    """Write the AWQ ``scheme`` quantization of float checkpoint ``src`` into the new (or empty) ``dst``, through a
    temporary directory renamed into place."""
    gs = awq_group_size(scheme)
    return write_4bit(src, dst, lambda source: quantized_tensors(source, lambda base, w: quantize_awq_weight(w, gs)),
                      awq_quantization_config(scheme))
