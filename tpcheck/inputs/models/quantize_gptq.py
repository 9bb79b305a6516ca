"""4-bit GPTQ checkpoints (W4A16, AutoGPTQ's format v1, as vLLM reads it): round to nearest per group.

``quantize_gptq_checkpoint(src, dst, scheme)`` writes each decoder-layer linear weight
(``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``) as ``qweight``,
``qzeros``, ``scales`` and ``g_idx`` (``impl.quant_gptq``'s module docstring: layout and packing); every other
tensor as it is, ``config.json`` with ``quantization_config`` (``gptq_quantization_config``), the other top-level
files copied (``tpcheck.inputs.models.quantize``'s rules).

The math, for the float weight ``W = weight^T`` ``[K = in, N = out]`` and each group ``g`` of ``group_size`` input
rows (``g_idx[k] == g``) and output column ``n`` (symmetric, AutoGPTQ's ``sym``)::

    scale[g, n] = float16(2 * absmax(W[g rows, n]) / 15)      # in float64, stored as float16 (all zero: 1.0)
    q[k, n]     = clamp(round(W[k, n] / scale[g_idx[k], n]) + 8, 0, 15)   # with the float16 scale; half to even
    zero        = 8, stored as 7 (v1 stores zero - 1)

Round to nearest, no Hessian (the GPTQ algorithm's error feedback): the format is what is checked, not the
quality of the rounding. Act-order (``-actorder`` schemes, ``desc_act: true``): the input rows are visited in a
permutation drawn from a generator seeded by the layer's input (the same file every time; q, k, v share one, as do
gate and up, as GPTQ's order comes from the input's Hessian), the ``i``-th visited
row going to group ``i // group_size`` (``g_idx[perm[i]] = i // group_size``), as GPTQ's act-order groups rows in
the order it quantizes them. Without it ``g_idx[k] = k // group_size``. The file is written with
``safetensors.torch.save_file`` (the whole output in memory: meant for the synthetic presets)."""
from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from impl.quant_gptq import pack_cols, pack_rows
from tpcheck.inputs.models.quant_schemes import GPTQ_SCHEMES
from tpcheck.inputs.models.quantize import (LINEAR_WEIGHT, _FLOAT_DTYPES, _OTHER_PROJ, _Source, quantize_checkpoint,
                                     write_checkpoint)

_SCHEME = re.compile(r"gptq-w4g(32|64|128)(-actorder)?")


def gptq_params(scheme: str) -> tuple[int, bool]:
    """``(group_size, desc_act)`` of a scheme name."""
    m = _SCHEME.fullmatch(scheme)
    if m is None:
        raise ValueError(f"unknown GPTQ scheme {scheme!r}; supported: {', '.join(GPTQ_SCHEMES)}")
    return int(m.group(1)), m.group(2) is not None


def gptq_quantization_config(scheme: str) -> dict:
    """``quantization_config`` as AutoGPTQ's ``BaseQuantizeConfig.to_dict`` writes it (vLLM reads ``bits``,
    ``group_size``, ``desc_act``, ``sym``, ``lm_head``, ``dynamic``, ``checkpoint_format``)."""
    gs, act = gptq_params(scheme)
    return {"bits": 4, "group_size": gs, "damp_percent": 0.01, "desc_act": act, "static_groups": False, "sym": True,
            "true_sequential": True, "lm_head": False, "model_name_or_path": None, "model_file_base_name": "model",
            "quant_method": "gptq", "checkpoint_format": "gptq"}


def group_index(k: int, group_size: int, act_order: bool, name: str = "") -> torch.Tensor:
    """int32 ``[k]``: ``k // group_size``, or act-order's groups of a permutation seeded by ``name``."""
    if not act_order:
        return (torch.arange(k) // group_size).to(torch.int32)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    g = torch.empty(k, dtype=torch.int64)
    g[perm] = torch.arange(k) // group_size
    return g.to(torch.int32)


def _input_key(layer: str) -> str:
    """Layers reading the same input share one act-order permutation (GPTQ orders by the input's Hessian): q, k, v
    -> ``...self_attn.qkv``, gate, up -> ``...mlp.gate_up``; o_proj and down_proj their own."""
    return re.sub(r"self_attn\.[qkv]_proj$", "self_attn.qkv", re.sub(r"mlp\.(gate|up)_proj$", "mlp.gate_up", layer))


def quantize_gptq_weight(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """An HF weight ``[out, in]`` -> ``{qweight, qzeros, scales, g_idx}`` (module docstring)."""
    w = weight.detach().to(torch.float64).t()  # [K, N]
    k, n = w.shape
    if k % group_size or n % 8:
        raise ValueError(f"input {k} is not a multiple of group_size {group_size} or output {n} of 8")
    g = g_idx.long()
    absmax = torch.zeros(k // group_size, n, dtype=torch.float64).scatter_reduce_(0, g[:, None].expand(k, n), w.abs(),
                                                                                  "amax")
    scales = (2 * absmax / 15).to(torch.float16)
    scales = torch.where(absmax == 0, torch.ones_like(scales), scales)
    if not bool(torch.isfinite(scales).all()) or bool((scales[absmax > 0] == 0).any()):
        raise ValueError("a group's scale is out of float16's range")
    q = (torch.round(w / scales.double()[g]) + 8).clamp_(0, 15)
    return {"qweight": pack_rows(q), "qzeros": pack_cols(torch.full((k // group_size, n), 7, dtype=torch.int64)),
            "scales": scales, "g_idx": g_idx}


def quantized_tensors(source: _Source, quantize_one) -> dict[str, torch.Tensor]:
    """Every tensor of ``source``, each decoder-layer linear weight ``{base}.weight`` replaced by the tensors
    ``quantize_one(base, weight)`` returns (``{base}.{leaf}``); the 4-bit formats' shared walk (GPTQ, AWQ:
    ``tpcheck.inputs.models.quantize_awq``)."""
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in sorted(source.meta.items()):
        if LINEAR_WEIGHT.fullmatch(name):
            if dtype not in _FLOAT_DTYPES or len(shape) != 2:
                raise ValueError(f"tensor {name}: expected a 2-D float weight, found {dtype} {shape}")
            w = source.get(name)
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"tensor {name}: has inf or nan values")
            base = name.removesuffix(".weight")
            try:
                parts = quantize_one(base, w)
            except ValueError as e:
                raise ValueError(f"tensor {name}: {e}") from None
            out.update({f"{base}.{k}": v for k, v in parts.items()})
        elif _OTHER_PROJ.fullmatch(name):
            raise ValueError(f"tensor {name}: a projection weight this quantizer does not know")
        else:
            out[name] = source.get(name)
    if not any(k.endswith(".qweight") for k in out):
        raise ValueError("no decoder-layer linear weight (model.layers.N.self_attn.q_proj.weight ...) in the source")
    return out


def _tensors(source: _Source, scheme: str) -> dict[str, torch.Tensor]:
    gs, act = gptq_params(scheme)
    return quantized_tensors(source, lambda base, w: quantize_gptq_weight(
        w, gs, group_index(w.shape[1], gs, act, _input_key(base))))


def quantize_any(src: str | os.PathLike, dst: str | os.PathLike, scheme: str) -> Path:
    """``scheme``'s quantization of ``src`` into ``dst``: a ``gptq-*`` scheme here, the INT8 / FP8 ones by
    ``tpcheck.inputs.models.quantize.quantize_checkpoint`` (``tpcheck.inputs.models.quantize_awq.quantize_any`` adds AWQ)."""
    if scheme in GPTQ_SCHEMES:
        return quantize_gptq_checkpoint(src, dst, scheme)
    return quantize_checkpoint(src, dst, scheme)


def quantize_gptq_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str) -> Path:
    """Write the GPTQ ``scheme`` quantization of float checkpoint ``src`` into the new (or empty) ``dst``, through a
    temporary directory renamed into place (``tpcheck.inputs.models.quantize.write_checkpoint``)."""
    gptq_params(scheme)
    return write_4bit(src, dst, lambda source: _tensors(source, scheme), gptq_quantization_config(scheme))


def write_4bit(src: str | os.PathLike, dst: str | os.PathLike, tensors, quantization_config: dict) -> Path:
    """``dst`` with one ``model.safetensors`` of ``tensors(source)`` and ``quantization_config`` in its
    ``config.json`` (``tpcheck.inputs.models.quantize.write_checkpoint``: checked, atomic)."""
    def fill(source, tmp: Path) -> dict:
        save_file({k: v.contiguous() for k, v in tensors(source).items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        return quantization_config
    return write_checkpoint(src, dst, fill)
