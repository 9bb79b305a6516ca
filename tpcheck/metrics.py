"""Error statistics of a tensor against its golden (float64) value, and the default gate numbers.

Gate (after TorchDynamo's ``same()``; applied by ``tpcheck.judge``): a point passes when
``err_engine <= k * err_ref + floor``, where
``err_ref`` is the error of Hugging Face run at the same dtype against the same golden run: an engine may
be as noisy as the reference implementation, times k, never more. Relative L2 error, not max-abs, is
gated: residual magnitudes grow with depth, and a max-abs of 900 means nothing without the norm beside it."""
from __future__ import annotations

import math

import torch

K_FACTOR = {"float32": 2.0, "float64": 2.0, "bfloat16": 3.0, "float16": 3.0}
FLOOR = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-3, "float16": 1e-3}


def rel_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """``||x - g|| / ||g||`` in float64 (NaN when x has a NaN): the one statistic the noise floor needs."""
    x64, g64 = x.detach().to(torch.float64), golden.detach().to(torch.float64)
    ref = float(g64.norm())
    d = float((x64 - g64).norm())
    return d / ref if ref > 0 else d


def max_row_rel_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """The largest ``rel_err`` of one row (token) of ``[rows, features]`` tensors, over the rows whose golden
    norm is not 0 (NaN when x has a NaN; NaN when no row qualifies)."""
    x64, g64 = x.detach().to(torch.float64), golden.detach().to(torch.float64)
    ref = g64.norm(dim=-1)
    keep = ref > 0
    if not bool(keep.any()):
        return math.nan
    return float(((x64 - g64).norm(dim=-1)[keep] / ref[keep]).max())


def compare(x: torch.Tensor, golden: torch.Tensor) -> dict:
    """Statistics of ``x`` against ``golden``, computed in float64. A NaN/Inf in ``x`` makes its
    absolute differences infinite (never "close") and its relative error NaN (never passes a gate)."""
    if x.shape != golden.shape:
        raise ValueError(f"shape {tuple(x.shape)} != golden shape {tuple(golden.shape)}")
    x64, g64 = x.detach().to(torch.float64).flatten(), golden.detach().to(torch.float64).flatten()
    nan, inf = int(torch.isnan(x64).sum()), int(torch.isinf(x64).sum())
    d = (x64 - g64).abs_()
    if nan or inf:
        d = d.nan_to_num_(nan=math.inf)
    n = d.numel()
    ref_norm, x_norm, d_norm = float(g64.norm()), float(x64.norm()), float(d.norm())
    max_abs, flat = (d.max(0) if n else (torch.tensor(0.0), torch.tensor(0)))
    return {
        "rel_err": (d_norm / ref_norm if ref_norm > 0 else d_norm) if not nan else math.nan,
        "cosine": float(x64 @ g64) / (x_norm * ref_norm) if x_norm > 0 and ref_norm > 0 else math.nan,
        "max_abs": float(max_abs),
        "max_abs_index": [int(i) for i in torch.unravel_index(flat, golden.shape)] if n else [],
        "mean_abs": float(d.mean()) if n else 0.0,
        "p99_abs": float(d.kthvalue(max(1, math.ceil(0.99 * n))).values) if n else 0.0,
        "ref_norm": ref_norm,
        "nan": nan,
        "inf": inf,
    }


def mismatch(x: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(elements of ``x`` whose value differs from ``ref``'s, elements): compared in float64, so an engine
    keeping a tensor in a wider dtype than HF matches only where its values are HF's exactly; NaN matches
    NaN; a shape difference makes every element a mismatch."""
    n = ref.numel()
    if x.shape != ref.shape:
        return max(n, x.numel()), max(n, x.numel())
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    same = (x == ref) | (torch.isnan(x) & torch.isnan(ref))
    return int(n - same.sum()), n
