"""The origin line of a failing run: what failed its first divergence, the cause first (``origin_cause``)."""
from __future__ import annotations

import math

NAN = math.nan


def origin_cause(fd: dict, dtype: str, allowance: float = 0.0) -> str:
    """What failed the origin row ``fd`` (``DiffResult.first_divergence``), its cause first: a structural note,
    then ranks whose replica errs beyond the threshold (``ranks_cause``), then the error against the golden (the
    first replica's, and another's where it is larger; after a cause it is told as its own multiple of the
    threshold: ``excess`` is the cause's), then a systematic gain where it failed
    (a negative gain: beyond ``gain_threshold`` plus ``allowance``, a declared rounding's: ``rounding_allowance``)."""
    fd = {**fd, "gain_allowance": allowance}
    thr = fd["threshold"]
    ranks, rep = ranks_cause(fd), _float(fd.get("replica_rel_err"))
    other = f" (another replica's {rep:.3g})" if rep > fd["rel_err"] and not ranks else ""
    err = f"rel_err {fd['rel_err']:.3g}{other} vs HF {dtype} {fd['ref_rel_err']:.3g}" + \
        (f" ({fd['ref_by']})" if fd.get("ref_by") else "")
    where = f"max |diff| {fd['max_abs']:.3g} at (batch, token, feature) {fd['max_abs_index']}"
    gain = f"; {_gain_note(fd, dtype)}" if _gain_failed(fd) else ""
    causes = [fd["note"]] if fd["note"] else []
    if ranks:
        causes.append(ranks)
    if not causes and not gain:
        return f"{err} -> {fd['excess']:.3g}x its threshold {thr:.3g}; {where}"
    if not causes:  # the error's own multiple: the excess may be the gain's
        return f"{err} -> {_times(fd['rel_err'], thr)} its threshold {thr:.3g}; {where}{gain}"
    return "; ".join(causes) + f"; {err}, {_times(fd['rel_err'], thr)} the threshold; {where}{gain}"


def ranks_cause(fd) -> str:
    """Why the ranks failed the row ``fd`` (a failing row as a dict or a table's row; ``tpcheck.judge.verdict``),
    or "" where they did not: another replica than the first errs against the golden beyond the threshold
    (``replica_rel_err``) while the first one does not, or while the replicas are also further apart than the
    threshold; in a result made before replicas were judged, the spread beyond the threshold."""
    thr, spread, rep = fd["threshold"], _float(fd.get("rank_spread")), _float(fd.get("replica_rel_err"))
    by = fd.get("rank_spread_by") or "?"
    told = f"ranks {by} disagree by {spread:.3g} ({_times(spread, thr)} the threshold {thr:.3g})"
    if math.isnan(rep):  # no replica differs, or an older result: its spread judged (NaN: no replicas)
        return told if spread > thr else ""
    if not (rep > thr and (fd["rel_err"] <= thr or spread > thr)):
        return ""
    return f"{told}, the other replica's rel_err {rep:.3g} ({_times(rep, thr)})"


def _float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return NAN


def _times(x: float, thr: float) -> str:
    """``x`` as a multiple of the threshold (a zero threshold: any error is infinitely over it)."""
    ratio = x / thr if thr > 0 else (math.inf if x > 0 else 0.0)
    return f"{ratio:.3g}x"


def _gain_failed(fd: dict) -> bool:
    g, thr = fd.get("gain", NAN), fd.get("gain_threshold", NAN)
    if not (isinstance(g, float) and isinstance(thr, float)):
        return False
    return abs(g) > thr + (fd.get("gain_allowance", 0.0) if g < 0 else 0.0)


# stored mantissa bits: rounding toward zero (truncation) to these loses on average half an ulp, a relative
# -2^-(bits+2) .. -2^-(bits+1) by where the value sits in its binade
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}


def rounding_allowance(meta: dict) -> float:
    """How far the gain threshold is widened on the negative side for the run ``meta`` describes: 0 unless its
    engine is declared to truncate (``meta["rounding"]["mode"] == "truncate"``, ``tpcheck.capture.rounding``) in
    a dtype of ``MANTISSA_BITS``; there ``2^-bits`` (bfloat16: 2^-7 = 7.8e-3).

    Why that figure: truncating a value x to ``bits`` stored mantissa bits loses ``[0, 1)`` ulp, on average half an
    ulp, a relative ``-2^-(bits+2)`` (x at the top of its binade) to ``-2^-(bits+1)`` (at its bottom): a shrink
    of every element alike, which the gain (a median of relative errors) reads in full. Within one layer a
    truncated result can feed another truncating op before it is judged (q and k truncated after RoPE, their
    product's softmax and the context truncated again, then ``attn.out``), so two such means in a row, at their
    largest: ``2 * 2^-(bits+1) = 2^-bits``, the bound ``truncation_like`` names. Measured on vLLM's CPU kernels:
    RoPE -0.22 to -0.33%, attention's output -0.27 to -0.80% a row (README "A dump's local pass"), within it but for
    the largest, which the gain's own threshold (added to it) covers. A larger shrink, or any positive gain, is not
    explained by truncation and is judged as under rounding to nearest."""
    bits = MANTISSA_BITS.get(meta.get("dtype"))
    mode = (meta.get("rounding") or {}).get("mode") if isinstance(meta.get("rounding"), dict) else None
    return 2.0 ** -bits if bits is not None and mode == "truncate" else 0.0


def truncation_like(gain: float, dtype: str, se: float = 0.0) -> bool:
    """Whether a gain is negative and of the size of rounding toward zero to ``dtype`` instead of to nearest, once
    or twice in a row, within three of its standard errors ``se``: between -2^-bits (two truncations' mean at
    most) and -2^-(bits+3) (half of one's least). vLLM's CPU kernels on a machine without AVX512-BF16 convert
    float32 to bfloat16 so: its RoPE -0.22 to -0.33% a row, attention's output -0.27 to -0.80% on rows of 65
    to 1,041 elements (README "A dump's local pass")."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None or not gain < 0:
        return False
    slack = 3 * se if se == se else 0.0  # NaN: not measured
    return -gain - slack <= 2.0 ** -bits and -gain + slack >= 2.0 ** -(bits + 3)


def _gain_note(fd: dict, dtype: str) -> str:
    """``gain +0.0075 over its threshold 0.00079 (9.5x): a systematic relative error`` (the row's gain failed),
    with what a truncating kernel would give where the gain has its sign and size (``truncation_like``)."""
    g, thr = fd["gain"], fd["gain_threshold"]
    note = f"gain {g:+.3g} over its threshold {thr:.3g} ({abs(g) / thr:.3g}x): a systematic relative error"
    if truncation_like(g, dtype, fd.get("gain_se", 0.0)):
        bits = MANTISSA_BITS[dtype]
        note += (f", of the sign and size of rounding toward zero to {dtype} instead of to nearest (-2^-{bits + 2} "
                 f"to -2^-{bits + 1} on average): a kernel that truncates its {dtype} results")
    return note
