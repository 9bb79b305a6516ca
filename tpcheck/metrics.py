"""Error statistics of a tensor against its golden (float64) value, and the noise-floor gate.

Gate (after TorchDynamo's ``same()``): a point passes when ``err_engine <= k * err_ref + floor``, where
``err_ref`` is the error of Hugging Face run at the same dtype against the same golden run: an engine may
be as noisy as the reference implementation, times k, never more. Relative L2 error, not max-abs, is
gated: residual magnitudes grow with depth, and a max-abs of 900 means nothing without the norm beside it."""
from __future__ import annotations

import math

import torch

K_FACTOR = {"float32": 2.0, "float64": 2.0, "bfloat16": 3.0, "float16": 3.0}
FLOOR = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-3, "float16": 1e-3}


def compare(x: torch.Tensor, golden: torch.Tensor) -> dict:
    """Statistics of ``x`` against ``golden``, computed in float64."""
    if x.shape != golden.shape:
        raise ValueError(f"shape {tuple(x.shape)} != golden shape {tuple(golden.shape)}")
    x64, g64 = x.detach().to(torch.float64), golden.detach().to(torch.float64)
    nan, inf = int(torch.isnan(x64).sum()), int(torch.isinf(x64).sum())
    d = (x64 - g64).abs()
    d = torch.where(torch.isfinite(d), d, torch.full_like(d, math.inf))
    ref_norm = float(g64.norm())
    flat = int(d.argmax()) if d.numel() else 0
    return {
        "rel_err": float((x64 - g64).norm()) / ref_norm if ref_norm > 0 else float((x64 - g64).norm()),
        "cosine": float(torch.nn.functional.cosine_similarity(x64.flatten(), g64.flatten(), dim=0)),
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "max_abs_index": [int(i) for i in torch.unravel_index(torch.tensor(flat), d.shape)] if d.numel() else [],
        "mean_abs": float(d.mean()) if d.numel() else 0.0,
        "p99_abs": float(torch.quantile(d.flatten()[:1 << 24], 0.99)) if d.numel() and torch.isfinite(d).all() else math.inf,
        "ref_norm": ref_norm,
        "nan": nan,
        "inf": inf,
    }


def gate(err: float, ref_err: float, dtype: str, k: float | None = None, floor: float | None = None) -> bool:
    """``err <= k * ref_err + floor``; NaN errors never pass."""
    k = K_FACTOR[dtype] if k is None else k
    floor = FLOOR[dtype] if floor is None else floor
    return bool(err <= k * ref_err + floor)
