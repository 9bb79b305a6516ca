"""Bit-for-bit comparison of two captures of the same tensor (``tpcheck invariance``): which elements differ, and
by how many units in the last place (ulps) *of the tensor's own dtype*.

The ulp distance of two finite floats ``a``, ``b`` of one dtype is the number of representable values of that
dtype between them, plus one: with ``key(x)`` the float's bits read as a sign-magnitude integer
(``key(x) = bits`` for ``x >= 0``, ``-(bits & magnitude_mask)`` for ``x < 0``), ``ulps = |key(a) - key(b)|``; so
``+0`` and ``-0`` are 0 ulps apart (but not bit-identical), the largest finite float and ``inf`` 1 ulp. A NaN
against anything that is not the same NaN bits, or an integer tensor's differing values (expert ids), is an
infinite distance: no rounding makes them. Two tensors of other shapes or dtypes are a structural finding, never
measured in ulps."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# the integer view of each float dtype (same width), for bit equality and the ulp keys
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def ulp_keys(t: torch.Tensor) -> torch.Tensor:
    """``t``'s floats as int64 keys, monotone in value, one apart between neighbouring floats of ``t``'s dtype."""
    if t.dtype not in _INT_VIEW:
        raise TypeError(f"ulp_keys needs a float tensor of {sorted(map(str, _INT_VIEW))}, got {t.dtype}")
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    width = torch.finfo(t.dtype).bits
    magnitude = bits & ((1 << (width - 1)) - 1)  # the sign bit cleared (an int64 of the same bits)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ulps between ``a`` and ``b`` (same shape and float dtype) as float64: 0 where bit-identical
    or +-0, ``inf`` where exactly one is NaN or both are NaN of other bits."""
    d = (ulp_keys(a) - ulp_keys(b)).abs().to(torch.float64)
    na, nb = a.isnan(), b.isnan()
    return d.masked_fill(na ^ nb | (na & nb & ~same_bits(a, b)), math.inf)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: ``a`` and ``b`` hold the same bits (integer tensors: the same values)."""
    if a.dtype in _INT_VIEW:
        return a.contiguous().view(_INT_VIEW[a.dtype]) == b.contiguous().view(_INT_VIEW[b.dtype])
    return a == b


@dataclass(frozen=True)
class TensorDiff:
    """How two captures of one tensor differ. ``differing``: elements whose bits differ (of ``numel``);
    ``max_ulps``: the largest ulp distance (0.0 bit-identical or only +-0 swapped; ``inf``: a NaN or an integer
    that differs); ``first``: ``(row, element)`` of the first differing element in row-major order (None: none);
    ``max_abs``: the largest ``|a - b|`` in float64 (NaN where a NaN is involved); ``structural``: why the two
    cannot be compared element-wise ("" when they can)."""

    numel: int
    differing: int
    max_ulps: float
    first: tuple[int, int] | None
    max_abs: float
    structural: str = ""

    @property
    def identical(self) -> bool:
        return not self.structural and self.differing == 0

    def within(self, ulps: float) -> bool:
        """Bit-identical (``ulps`` 0), or every element within ``ulps`` of the other side."""
        if self.structural:
            return False
        return self.differing == 0 if ulps == 0 else self.max_ulps <= ulps


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """``a`` vs ``b``, each ``[rows, features]`` (a 1-D tensor counts as one row): see ``TensorDiff``."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return TensorDiff(a.numel(), a.numel(), math.inf, None, math.nan,
                          f"shapes {list(a.shape)} vs {list(b.shape)}, dtypes {a.dtype} vs {b.dtype}"
                          .replace(f", dtypes {a.dtype} vs {a.dtype}", ""))
    a2, b2 = a.reshape(1, -1) if a.dim() < 2 else a.reshape(a.shape[0], -1), \
        b.reshape(1, -1) if b.dim() < 2 else b.reshape(b.shape[0], -1)
    bad = ~same_bits(a2, b2)
    n = int(bad.sum())
    if n == 0:
        return TensorDiff(a.numel(), 0, 0.0, None, 0.0)
    row, col = (int(i) for i in bad.nonzero()[0])
    if a2.dtype in _INT_VIEW:
        ulps = float(ulp_distance(a2[bad], b2[bad]).max())
        diff = (a2[bad].double() - b2[bad].double()).abs()
        mx = math.nan if bool(diff.isnan().any()) else float(diff.max())
    else:  # ids, counts: any difference is no rounding
        ulps, mx = math.inf, float((a2[bad].double() - b2[bad].double()).abs().max())
    return TensorDiff(a.numel(), n, ulps, (row, col), mx)
