"""Error statistics of a tensor against its golden (float64) value, and the default gate numbers.

Gate (after TorchDynamo's ``same()``; applied by ``tpcheck.judge``): a point passes when
``err_engine <= k * err_ref + floor``, where
``err_ref`` is the error of Hugging Face run at the same dtype against the same golden run: an engine may
be as noisy as the reference implementation, times k, never more. Relative L2 error, not max-abs, is
gated: residual magnitudes grow with depth, and a max-abs of 900 means nothing without the norm beside it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpcheck.measure import golden_stats

K_FACTOR = {"float32": 2.0, "float64": 2.0, "bfloat16": 3.0, "float16": 3.0}
FLOOR = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-3, "float16": 1e-3}


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p of a floating dtype (p significand bits, the implicit one included): half its machine epsilon."""
    return torch.finfo(dtype).eps / 2


def _f64_copy(x: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``x`` that the caller may overwrite (the one float64 buffer a statistic needs)."""
    return x.detach().to(torch.float64, copy=True)


@dataclass(frozen=True)
class RowErrors:
    """A reference tensor's errors against the golden (``row_errors``): ``whole`` (``rel_err``), ``worst`` (the
    largest row rel_err over rows whose golden norm is not 0; NaN when none), and in absolute units, for a narrow
    point (``tpcheck.judge.noise_floor``): ``rms_row`` (the RMS of the rows' error norms), ``worst_abs`` (the
    largest row error norm), ``golden_sq`` (the golden's squared norm) and ``rows``."""

    whole: float
    worst: float
    rms_row: float
    worst_abs: float
    golden_sq: float
    rows: int


def row_errors(x: torch.Tensor, golden: torch.Tensor) -> RowErrors:
    """``RowErrors`` of ``[rows, features]`` tensors from one float64 difference (the noise floor needs all of
    them of every reference point)."""
    gs = golden_stats.of(golden)  # its norms: computed once for the engine's and every reference's statistics
    d = _f64_copy(x).sub_(gs.g64)
    d_rows, g_rows = d.norm(dim=-1), gs.row_norms()
    d_all, g_all = float(d.norm()), gs.norm()  # as ``compare`` computes them: the same bits
    del d
    whole = d_all / g_all if g_all > 0 else d_all
    keep = g_rows > 0
    worst = float((d_rows[keep] / g_rows[keep]).max()) if bool(keep.any()) else math.nan
    rows = int(d_rows.numel())
    return RowErrors(whole, worst, d_all / math.sqrt(rows) if rows else math.nan,
                     float(d_rows.max()) if rows else math.nan, g_all * g_all, rows)


def row_rel_errs(x: torch.Tensor, golden: torch.Tensor) -> tuple[float, float]:
    """``(rel_err, max_row_rel_err)`` of ``[rows, features]`` tensors (``row_errors``)."""
    e = row_errors(x, golden)
    return e.whole, e.worst


def rel_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """``||x - g|| / ||g||`` in float64 (NaN when x has a NaN): the one statistic the noise floor needs."""
    gs = golden_stats.of(golden)
    d, ref = float(_f64_copy(x).sub_(gs.g64).norm()), gs.norm()
    return d / ref if ref > 0 else d


def max_row_rel_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """The largest ``rel_err`` of one row (token) of ``[rows, features]`` tensors, over the rows whose golden
    norm is not 0 (NaN when x has a NaN; NaN when no row qualifies)."""
    return row_rel_errs(x, golden)[1]


def compare(x: torch.Tensor, golden: torch.Tensor) -> dict:
    """Statistics of ``x`` against ``golden``, computed in float64. A NaN/Inf in ``x`` makes its
    absolute differences infinite (never "close") and its relative error NaN (never passes a gate).

    One float64 buffer is allocated (a logits point is rows x vocab: a second or third copy costs more than
    the arithmetic); the p99 is an in-place selection on it (numpy's introselect: the value
    ``torch.kthvalue`` gives, at several times the speed)."""
    if x.shape != golden.shape:
        raise ValueError(f"shape {tuple(x.shape)} != golden shape {tuple(golden.shape)}")
    gs = golden_stats.of(golden)
    g64 = gs.g64.reshape(-1)
    d = _f64_copy(x).reshape(-1)
    n = d.numel()
    ref_norm, x_norm = gs.norm(), float(d.norm())  # a 2-D tensor's norm and its flat view's: the same bits
    dot = float(d @ g64) if n else 0.0
    nan = inf = 0
    if not math.isfinite(x_norm):  # the norm of finite values never overflows in float64
        nan, inf = int(torch.isnan(d).sum()), int(torch.isinf(d).sum())
    d.sub_(g64).abs_()
    if nan or inf:
        d.nan_to_num_(nan=math.inf)
    d_norm = float(d.norm())
    max_abs, flat = (d.max(0) if n else (torch.tensor(0.0), torch.tensor(0)))
    mean_abs = float(d.mean()) if n else 0.0
    p99 = 0.0
    if n:
        k = max(1, math.ceil(0.99 * n))  # kthvalue's k-th smallest
        if d.device.type == "cpu":
            a = d.numpy()
            a.partition(k - 1)  # d is ours: reordered in place, read no more
            p99 = float(a[k - 1])
        else:
            p99 = float(d.kthvalue(k).values)
    return {
        "rel_err": (d_norm / ref_norm if ref_norm > 0 else d_norm) if not nan else math.nan,
        "cosine": dot / (x_norm * ref_norm) if x_norm > 0 and ref_norm > 0 and not (nan or inf) else math.nan,
        "max_abs": float(max_abs),
        "max_abs_index": [int(i) for i in torch.unravel_index(flat, golden.shape)] if n else [],
        "mean_abs": mean_abs,
        "p99_abs": p99,
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
