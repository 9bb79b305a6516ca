"""The verdict, decided in one place: ``judge(result, tolerances)`` sets each row's ``threshold``, ``excess``,
``gain_threshold`` and ``passed`` from what the diff measured.

A diff run (``tpcheck.pipeline.diff``) records measurements (``rel_err``, the references' ``ref_rel_err``,
``max_abs``, how far replicas differ between ranks: ``rank_spread``, the gain, ...) and structural findings (a
shape that differs from the golden, ranks holding other shapes, an op whose bits differ from HF's under
``--exact-ops``), each written in the row's ``note``. A row passes when ``rel_err <= threshold``
(``Tolerances.threshold``: ``k * ref_rel_err + floor``, or ``rel_max``; plus ``rel_floor``, one ulp of the element
that holds the tensor's norm, which a reference that rounded that element luckily does not sample:
``tpcheck.measure.metrics.ulp_floor``) for every replica of the point (the worst
other one's is ``replica_rel_err``, below), ``max_abs <= abs_max`` where a bound is set, ``|gain| <=
gain_threshold`` where a gain was measured, and it has no structural finding; or, failing only the ``rel_err``
gate, as *inherited* (``inherited`` column) when its op recomputed on the engine's own inputs errs within the same
threshold beyond a correct kernel's rounding (``own_err``, ``tpcheck.measure.own_input``; for every replica) and
every input of that op passed: the excess came in through inputs that are themselves within their floors. NaN
never passes, except where Hugging Face at the run's dtype is non-finite too: the dtype cannot hold the model's
activations there (a trained model's ~1e5 in float16), which is no finding about the engine; those rows are left
unjudged and ``meta["overflow"]`` names the first (the run is then neither a pass nor a divergence: ``tpcheck diff``
exits 2 naming the dtype).

**Replicas** (``rank_spread``, ``replica_rel_err``): a correct engine's replicas may differ: vLLM's CPU all-reduce
adds the partials in a rank-dependent order, so at tp >= 3 each rank rounds the same sum its own way, and where
the sum cancels (a massive activation's ``mlp.out``) the spread reaches the size of the error against the golden
(measured: 1.65e-5 against a threshold of 1.62e-5 that one lucky reference rounding set). Two replicas are two
results of the engine, so each is judged as the first one is, against the golden, with the same threshold and the
same inheritance (its ``own_err`` on its own rank's inputs); the spread is a figure. A rank that holds other data
(a missing all-reduce on one rank, a wrong shard, a stale replica) errs against the golden by what it holds, and
fails at its origin as any error does; one that rounded in another order errs like the first replica. A result
made before replicas were judged (no ``replica_rel_err``) holds its spread to the threshold, as it was judged.

``tpcheck diff``, ``tpcheck gate`` (re-judging a saved result), ``tpcheck sweep`` and the pytest plugin
all call this function.

**The gain rule** (``tpcheck.measure.gain``): ``gain_threshold = max(gain_z(n) * gain_se, gain_z_cols(G) *
gain_se_cols, k * ref_gain, gain_floor)``, ``gain_z(n) = 6 (1 + 4 / sqrt(n))``, ``gain_z_cols(G)`` Student's t of
``G - 1`` degrees of freedom at the same tail, k the point's tolerance factor. Each term, and why a correct
engine stays under it:

* ``gain_z(n) * gain_se``: elementwise rounding has random sign, so a clean engine's gain is its estimation noise,
  ~N(0, se), with se measured on the engine's own ratios; 6 se is exceeded with probability ~2e-9 per comparison
  (a run has ~10^3), and the ``4 / sqrt(n)`` widens it where se is itself estimated from few elements (its tail,
  simulated: ``tpcheck.measure.gain``);
* ``gain_z_cols(G) * gain_se_cols``: where rows are near copies (a trained model's tokens all attend to their sink)
  a GEMM's error in one column repeats down its rows, the elements are not independent and ``gain_se`` is too
  small; the spread of the gains of G column groups is the standard error then (it equals ``gain_se`` where the
  elements are independent);
* ``k * ref_gain``: what is systematic and shared: the weights rounded to the dtype are the same numbers in HF and
  the engine, and scale features alike in every row (an RMSNorm weight rounded down by 2^-9 is a gain of every
  element it multiplies); each reference's whole-tensor gain is a sample of it, and the largest so far, times
  the same k as the rel_err rule, bounds the engine's share of it;
* ``gain_floor``: a per-row float32 scalar (an RMSNorm's rsqrt, a softmax denominator) legitimately rounded in
  another order (``tpcheck.measure.gain.gain_fields``).

What a bug must be to cross: a gain or bias of ~6.5 se; with the ~2,000 qualifying elements of a 32-token prefill
of a 128-wide point in bfloat16, se ~1e-4, so the ``residual_gain`` fault's 2^-7 = 7.8e-3 (1-2 ulp per element,
0.85x under the rel_err rule) is found at ~12x. A one-token step has ~64 elements, se ~6e-4 and gain_z 9: ~1.3x.

**Judged in the local pass only** (``GAIN_MODES``; the propagated pass does not measure it: its rows' gain columns
are NaN, which also saves the statistic's cost there, 10-30% of a run). In the propagated pass a point's error is inherited from every layer above it, and part of that inheritance
is a true gain: an RMSNorm divides each row by its RMS, which a few massive-activation channels dominate, so the
inherited error of those channels becomes a per-row scale of every element after the norm, of a size set by
upstream roundings that the references sample once per row. On 90 clean runs (5 presets, tp 1/2/4, three dtypes,
prompts of 32 and of 1 token, 2 decode steps) the propagated gain came to 0.95x its threshold (``small-outliers``
tp 4 float16, ``mlp.gate`` of a 2-row decode step; 1.11x with a fixed z = 6), against 0.57x in the local pass,
where every layer's input is the golden's and what is left is the layer's own rounding. A gain the local pass
cannot see is one applied between layers, after a layer's ``out`` and before the next layer's norm, which removes
it again: only the residual carries it (the next ``attn.residual``); not judged.

**A declared rounding** (``meta["rounding"]``, ``tpcheck.capture.rounding``): where the engine is declared to
truncate its bfloat16 / float16 results (vLLM's CPU kernels without AVX512-BF16), a negative gain passes up to
``gain_threshold + rounding_allowance`` (``tpcheck.result.origin``: 2^-bits, 2^-7 in bfloat16), and such a row's
excess is ``|gain|`` over that widened bound; a positive gain is judged against ``gain_threshold`` alone, as
everywhere. A row within its gain bound only by the allowance is marked ``by_rounding``."""
from __future__ import annotations

import numpy as np
import pandas as pd

from tpcheck.capture.points import point_order, split_point
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure import own_input
from tpcheck.measure.gain import gain_z, gain_z_cols
from tpcheck.result.origin import rounding_allowance
from tpcheck.result.table import DiffResult

GAIN_MODES = ("isolated",)  # the passes whose gain is judged (module docstring)


def _col(t: pd.DataFrame, name: str) -> np.ndarray:
    return pd.to_numeric(t[name], errors="coerce").astype(float).to_numpy()


def gain_thresholds(t: pd.DataFrame, dtype: str, tol: Tolerances, floor: bool = True) -> np.ndarray:
    """Each row's ``gain_threshold`` (module docstring); NaN where no gain is judged. ``floor``: with the gain's
    floor (``gain_floor``: what a correct kernel's rounding of a per-row scale may add); False: the statistical and
    the references' terms alone (what ``allowances`` compares with)."""
    k = np.array([tol.k_for(kind, dtype) for kind in t["kind"]], dtype=float)
    z = np.array([gain_z(n) if n > 0 else np.nan for n in _col(t, "gain_n")], dtype=float)
    groups = _col(t, "gain_groups") if "gain_groups" in t else np.full(len(t), np.nan)
    se_cols = _col(t, "gain_se_cols") if "gain_se_cols" in t else np.full(len(t), np.nan)
    zc = np.array([gain_z_cols(int(g)) if g >= 2 else np.nan for g in groups], dtype=float)
    thr = np.fmax.reduce([z * _col(t, "gain_se"), zc * se_cols, k * np.nan_to_num(_col(t, "ref_gain")),
                          _col(t, "gain_floor") if floor else np.full(len(t), np.nan)])
    judged = np.isfinite(_col(t, "gain")) & t["mode"].isin(GAIN_MODES).to_numpy()
    return np.where(judged, thr, np.nan)


def judge(result: DiffResult, tolerances: Tolerances | None = None) -> DiffResult:
    """``result`` with ``threshold``, ``gain_threshold``, ``excess`` (the largest of ``rel_err / threshold`` (the
    worst replica's), ``max_abs / abs_max``, ``|gain| / gain_threshold`` and, in a result made before replicas were
    judged, ``rank_spread / threshold``; an inherited row's: its
    ``own_err``'s), ``passed`` and ``inherited`` set under ``tolerances`` (default: ``Tolerances()``);
    ``meta["tolerances"]`` names them."""
    tol = tolerances or Tolerances()
    dtype = result.meta["dtype"]
    t = result.table.copy()
    rel, ref, mx, spread = (_col(t, c) for c in ("rel_err", "ref_rel_err", "max_abs", "rank_spread"))
    # every replica judged against the golden: the worst one's error is the row's (NaN: no replica differs, or a
    # result made before they were measured, whose spread is held to the threshold as it was)
    rep = _col(t, "replica_rel_err") if "replica_rel_err" in t else np.full(len(t), np.nan)
    measured = ~np.isnan(rep)
    rel = np.where(measured, np.maximum(rel, rep), rel)
    spread = np.where(measured, np.nan, spread)
    structural = (t["note"].fillna("").astype(str) != "").to_numpy()
    thr = np.array([tol.threshold(k, dtype, r) for k, r in zip(t["kind"], ref)], dtype=float)
    if "rel_floor" in t:  # one ulp of the element that holds the norm, beyond the references' (metrics.ulp_floor)
        thr = thr + np.nan_to_num(_col(t, "rel_floor"))
    bound = np.array([np.nan if (b := tol.abs_max(k, dtype)) is None else b for k in t["kind"]], dtype=float)
    gthr = gain_thresholds(t, dtype, tol)
    signed = _col(t, "gain")
    gain = np.abs(signed)
    # a declared truncating engine: the negative side widened by what truncation explains (``rounding_allowance``)
    glim = np.where(signed < 0, gthr + rounding_allowance(result.meta), gthr)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_excess = np.where(thr > 0, rel / thr, np.where(rel > 0, np.inf, 0.0))
        abs_excess = np.where(np.isnan(bound), 0.0, np.where(bound > 0, mx / bound, np.where(mx > 0, np.inf, 0.0)))
        rank_excess = np.where(np.isnan(spread), 0.0,
                               np.where(thr > 0, spread / thr, np.where(spread > 0, np.inf, 0.0)))
        gain_excess = np.where(np.isnan(gthr), 0.0, np.where(glim > 0, gain / glim, np.where(gain > 0, np.inf, 0.0)))
    excess = np.where(np.isnan(rel), np.nan, np.maximum.reduce(
        [rel_excess, np.nan_to_num(abs_excess, nan=np.inf), rank_excess, gain_excess]))
    others_ok = (np.isnan(bound) | (mx <= bound)) & ~(spread > thr) & (np.isnan(gthr) | (gain <= glim)) & ~structural
    ok = (rel <= thr) & others_ok
    own = _col(t, "own_err") if "own_err" in t else np.full(len(t), np.nan)
    if "replica_own_err" in t:
        own = np.where(measured, np.maximum(own, _col(t, "replica_own_err")), own)
    # the gain the op itself added (own_gain: against the op on the engine's own inputs) where the row's gain is
    # over its bound: a scale its input carried in (within that input's own bound) is the input's, not the op's
    own_gain = np.abs(_col(t, "own_gain")) if "own_gain" in t else np.full(len(t), np.nan)
    gain_by_own = np.isfinite(gthr) & (gain > glim) & (own_gain <= glim)
    with np.errstate(divide="ignore", invalid="ignore"):
        own_gain_excess = np.where(gain_by_own, np.where(glim > 0, own_gain / glim, 0.0), gain_excess)
    own_others_ok = others_ok | (gain_by_own & (np.isnan(bound) | (mx <= bound)) & ~(spread > thr) & ~structural)
    inherited = _inherited(t, ok, (own <= thr) & own_others_ok, result.meta.get("num_layers"))
    with np.errstate(divide="ignore", invalid="ignore"):
        own_excess = np.maximum.reduce([own / np.where(thr > 0, thr, np.inf), rank_excess, own_gain_excess])
    ok, excess = ok | inherited, np.where(inherited, own_excess, excess)
    # the dtype's own overflow: the engine non-finite where Hugging Face at the same dtype is too (float16 and a
    # trained model's ~1e5 activations): no verdict about the engine there, and the run says so (``overflow``)
    overflow = ~np.isfinite(rel) & ~np.isfinite(ref) & ~structural
    ok, excess = ok | overflow, np.where(overflow, np.nan, excess)
    t["threshold"], t["gain_threshold"], t["excess"] = thr, gthr, excess
    t["passed"], t["inherited"] = ok.astype(bool), inherited
    t["by_rounding"] = (gain > gthr) & (gain <= glim)  # within the gain's threshold only by the declared rounding
    meta = {**result.meta, "tolerances": tol.source}
    floor = np.nan_to_num(_col(t, "rel_floor")) if "rel_floor" in t else np.zeros(len(t))
    plain = ok & ~inherited & ~overflow
    meta["allowances"] = {  # the passing rows each allowance alone carried (module docstring; the summary says it)
        "inherited": int(inherited.sum()),
        "rel_floor": int((plain & (floor > 0) & (rel > thr - floor)).sum()),
        "gain_floor": int((plain & (gain > gain_thresholds(t, dtype, tol, floor=False)) & (gain <= gthr)).sum()),
        "by_rounding": int((plain & t["by_rounding"].to_numpy()).sum())}
    meta.pop("overflow", None)
    if overflow.any():
        o = t[overflow]
        first = o.loc[o[["step", "order"]].apply(tuple, axis=1).idxmin()]
        meta["overflow"] = {"point": first.point, "step": int(first.step), "mode": first["mode"],
                            "rows": int(overflow.sum())}
    return DiffResult(t, meta)


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
    sandwich = bool(t["point"].str.endswith(".attn.post_norm").any())  # Gemma 3: its residual adds read the norms
    qk_norm = bool(t["point"].str.endswith(".attn.q_norm").any())  # Qwen3, Gemma 3: RoPE reads the normed q, k
    names = set(t["point"])
    moe = {}  # layer -> its sparse block's kind (tpcheck.measure.own_moe.layer_kind), from the points it holds
    for p in names:
        if p.endswith(".moe.experts"):
            at = p.removesuffix("moe.experts")
            moe[split_point(p)[0]] = "shared" if at + "moe.shared" in names else "moe"
    for i in sorted(candidates, key=lambda i: (t["mode"].iat[i], t["step"].iat[i], point_order(t["point"].iat[i]))):
        mode, step, point = t["mode"].iat[i], t["step"].iat[i], t["point"].iat[i]
        kv = (mode, step, point.replace(".attn.context", ".kv.k")) in passed  # the context read the cache back
        inputs = own_input.input_points(point, num_layers, sandwich, qk_norm, kv, moe.get(split_point(point)[0], ""))\
            or [None]
        if mode == "isolated" and own_input.reads_layer_input(split_point(point)[1]):
            inputs = inputs[1:]  # the layer's input is the teacher: the golden's
        if all(passed.get((mode, step, p), False) for p in inputs):
            out[i] = passed[(mode, step, point)] = True
    return out
