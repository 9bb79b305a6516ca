"""The verdict, decided in one place: ``judge(result, tolerances)`` sets each row's ``threshold``, ``excess``
and ``passed`` from what the diff measured.

A diff run (``tpcheck.pipeline.diff``) records measurements (``rel_err``, the references' ``ref_rel_err``,
``max_abs``, how far replicas differ between ranks: ``rank_spread``, ...) and structural findings (a shape that
differs from the golden, ranks holding other shapes, an op whose bits differ from HF's under ``--exact-ops``),
each written in the row's ``note``. A row passes when ``rel_err <= threshold`` (``Tolerances.threshold``:
``k * ref_rel_err + floor``, or ``rel_max``), ``max_abs <= abs_max`` where a bound is set, ``rank_spread <=
threshold`` (replicas may differ by what a correct engine's rounding may: a rank-dependent all-reduce order; a
rank holding other data is far above it) and it has no structural finding; or, failing only the ``rel_err``
gate, as *inherited* (``inherited`` column) when its op recomputed on the engine's own inputs errs within the
same threshold beyond a correct kernel's rounding (``own_err``, ``tpcheck.measure.own_input``) and every input of
that op passed: the excess came in through inputs that are themselves within their floors. NaN never passes (a
NaN ``rank_spread``: the point has no replicas). ``tpcheck diff``, ``tpcheck gate`` (re-judging a saved result),
``tpcheck sweep`` and the pytest plugin all call this function."""
from __future__ import annotations

import numpy as np
import pandas as pd

from tpcheck.capture.points import point_order, split_point
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure import own_input
from tpcheck.result.table import DiffResult


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
    others_ok = (np.isnan(bound) | (mx <= bound)) & ~(spread > thr) & ~structural
    ok = (rel <= thr) & others_ok
    own = pd.to_numeric(t["own_err"], errors="coerce").astype(float).to_numpy() if "own_err" in t else \
        np.full(len(t), np.nan)
    inherited = _inherited(t, ok, (own <= thr) & others_ok, result.meta.get("num_layers"))
    with np.errstate(divide="ignore", invalid="ignore"):
        own_excess = np.maximum(own / np.where(thr > 0, thr, np.inf), rank_excess)
    ok, excess = ok | inherited, np.where(inherited, own_excess, excess)
    t["threshold"], t["excess"], t["passed"], t["inherited"] = thr, excess, ok.astype(bool), inherited
    return DiffResult(t, {**result.meta, "tolerances": tol.source})


def _inherited(t: pd.DataFrame, ok: np.ndarray, own_ok: np.ndarray, num_layers: int | None) -> np.ndarray:
    """Rows that fail only through their inputs (``tpcheck.measure.own_input``): ``own_err`` within the threshold
    and every input point of the op passed, raw or inherited, in the same pass and step (in an isolated pass the
    layer's input is the golden's own). Decided in execution order, so an inherited input counts."""
    out = np.zeros(len(t), dtype=bool)
    candidates = np.flatnonzero(~ok & own_ok)
    if not len(candidates):
        return out
    if num_layers is None:
        layers = pd.to_numeric(t["layer"], errors="coerce")
        num_layers = int(layers.max()) + 1 if layers.notna().any() else 0
    passed = {(m, s, p): bool(v) for m, s, p, v in zip(t["mode"], t["step"], t["point"], ok)}
    for i in sorted(candidates, key=lambda i: (t["mode"].iat[i], t["step"].iat[i], point_order(t["point"].iat[i]))):
        mode, step, point = t["mode"].iat[i], t["step"].iat[i], t["point"].iat[i]
        inputs = own_input.input_points(point, num_layers) or [None]
        if mode == "isolated" and split_point(point)[1] in ("input_norm", "attn.residual", "final_norm"):
            inputs = inputs[1:]  # the layer's input is the teacher: the golden's
        if all(passed.get((mode, step, p), False) for p in inputs):
            out[i] = passed[(mode, step, point)] = True
    return out
