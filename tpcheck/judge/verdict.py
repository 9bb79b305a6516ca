"""The verdict, decided in one place: ``judge(result, tolerances)`` sets each row's ``threshold``, ``excess``
and ``passed`` from what the diff measured.

A diff run (``tpcheck.pipeline.diff``) records measurements (``rel_err``, the references' ``ref_rel_err``,
``max_abs``, how far replicas differ between ranks: ``rank_spread``, ...) and structural findings (a shape that
differs from the golden, ranks holding other shapes, an op whose bits differ from HF's under ``--exact-ops``),
each written in the row's ``note``. A row passes when ``rel_err <= threshold`` (``Tolerances.threshold``:
``k * ref_rel_err + floor``, or ``rel_max``), ``max_abs <= abs_max`` where a bound is set, ``rank_spread <=
threshold`` (replicas may differ by what a correct engine's rounding may: a rank-dependent all-reduce order; a
rank holding other data is far above it) and it has no structural finding. NaN never passes (a NaN
``rank_spread``: the point has no replicas). ``tpcheck diff``, ``tpcheck gate`` (re-judging a saved result),
``tpcheck sweep`` and the pytest plugin all call this function."""
from __future__ import annotations

import numpy as np
import pandas as pd

from tpcheck.result.table import DiffResult
from tpcheck.judge.tolerances import Tolerances


def judge(result: DiffResult, tolerances: Tolerances | None = None) -> DiffResult:
    """``result`` with ``threshold``, ``excess`` (the largest of ``rel_err / threshold``, ``max_abs / abs_max``
    and ``rank_spread / threshold``) and ``passed`` set under ``tolerances`` (default: ``Tolerances()``);
    ``meta["tolerances"]`` names them."""
    tol = tolerances or Tolerances()
    dtype = result.meta["dtype"]
    t = result.table.copy()
    rel, ref, mx, spread = (pd.to_numeric(t[c], errors="coerce").astype(float).to_numpy()
                            for c in ("rel_err", "ref_rel_err", "max_abs", "rank_spread"))
    structural = (t["note"].fillna("").astype(str) != "").to_numpy()
    thr = np.array([tol.threshold(k, dtype, r) for k, r in zip(t["kind"], ref)], dtype=float)
    bound = np.array([np.nan if (b := tol.abs_max(k, dtype)) is None else b for k in t["kind"]], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_excess = np.where(thr > 0, rel / thr, np.where(rel > 0, np.inf, 0.0))
        abs_excess = np.where(np.isnan(bound), 0.0, np.where(bound > 0, mx / bound, np.where(mx > 0, np.inf, 0.0)))
        rank_excess = np.where(np.isnan(spread), 0.0,
                               np.where(thr > 0, spread / thr, np.where(spread > 0, np.inf, 0.0)))
    excess = np.where(np.isnan(rel), np.nan,
                      np.maximum(np.maximum(rel_excess, np.nan_to_num(abs_excess, nan=np.inf)), rank_excess))
    ok = (rel <= thr) & (np.isnan(bound) | (mx <= bound)) & ~(spread > thr) & ~structural
    t["threshold"], t["excess"], t["passed"] = thr, excess, ok.astype(bool)
    return DiffResult(t, {**result.meta, "tolerances": tol.source})
