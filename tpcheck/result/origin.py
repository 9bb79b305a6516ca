"""The origin of a failing run in the summary (``origin_lines``): where it first diverged and how far (one ratio),
why (the kind of evidence: ``cause_of``) and what to check next (``tpcheck.result.hints``); the isolate line
(``isolate_line``); whether the ranks failed a row (``ranks_cause``); what a pass's closest point owes its own op
(``closest_part``)."""
from __future__ import annotations

import math
import textwrap

from tpcheck.capture.points import split_point
from tpcheck.measure.wording import in_words
from tpcheck.result.hints import STRUCTURAL, WHY, hint

NAN = math.nan
WIDTH = 120  # the longest line of the origin, wrapped beyond it


def origin_lines(fd: dict, dtype: str, allowance: float = 0.0, width: int = WIDTH) -> list[str]:
    """The summary's origin, three lines of at most ``width`` characters (a longer one wrapped, indented): where the
    row ``fd`` (``DiffResult.first_divergence``) is and how far it is over (its ``excess``, the one ratio: the
    judge's largest of its own ratios), why (``cause_of``: the kind of evidence, then its numbers) and what to
    check next (``tpcheck.result.hints``). ``allowance``: the negative gain's widening (``rounding_allowance``)."""
    fd = {**fd, "gain_allowance": allowance}
    cause = cause_of(fd)
    step = f"step {fd['step']}" + (f", {fd['mode']}" if fd["mode"] != "propagated" else "")
    far = {"nan": "not finite"}.get(cause, WHY[cause] if cause in STRUCTURAL else _far(fd["excess"]))
    idx = fd.get("max_abs_index")
    at = f", largest |diff| {fd['max_abs']:.3g} at prompt {idx[0]}, token {idx[1]}" \
        if isinstance(idx, (list, tuple)) and len(idx) == 3 and math.isfinite(_float(fd.get("max_abs"))) \
        and cause not in STRUCTURAL else ""
    kind = split_point(fd["point"])[1]
    nxt = hint(kind, cause)
    if cause == "gain" and truncation_like(fd["gain"], dtype, fd.get("gain_se", 0.0)):
        nxt = f"whether a kernel truncates its {dtype} results (rounding toward zero): if so, --rounding truncate"
    lines = [f"origin: {fd['point']} ({step}): {far}{at}", f"why: {_why(fd, cause, dtype)}", f"next: check {nxt}"]
    return [textwrap.fill(line, width, initial_indent="" if i == 0 else "  ", subsequent_indent="    ",
                          break_long_words=False, break_on_hyphens=False) for i, line in enumerate(lines)]


def _far(excess: float) -> str:
    """How far over: ``5.1e+05x its threshold``; an infinite excess (a zero threshold, a NaN on one rank only) in
    words."""
    return "infinitely over its threshold" if math.isinf(excess) else f"{excess:.3g}x its threshold"


def cause_of(fd: dict) -> str:
    """The kind of evidence that failed the origin row ``fd`` (a ``tpcheck.result.hints.WHY`` key): its note's
    (``shape``: shapes differ; ``exact-ops``; else ``note``), ``nan`` where the engine's error is not finite,
    ``ranks`` where they disagree (``ranks_cause``), else whichever of the error against the golden (``floor``:
    the worst replica's rel_err over the threshold) and the gain (``gain``: ``|gain|`` over its threshold) is
    further over its bound; ``bound`` where neither is (``max |diff|`` over an absolute bound, ``abs_max``)."""
    note = fd.get("note") or ""
    if note:
        return "shape" if "shape" in note else "exact-ops" if note.startswith("exact-ops") else "note"
    if not math.isfinite(_float(fd.get("rel_err"))):
        return "nan"
    if ranks_cause(fd):
        return "ranks"
    rel = _worst_rel(fd)
    over = {"floor": _ratio(rel, fd["threshold"]) if rel > fd["threshold"] else 0.0,
            "gain": _ratio(abs(fd["gain"]), _gain_limit(fd)) if _gain_failed(fd) else 0.0}
    best = max(over, key=over.get)
    return best if over[best] > 0 else "bound"


def _why(fd: dict, cause: str, dtype: str) -> str:
    """The evidence of ``cause`` in words and numbers (no ratio: the origin's line has the one)."""
    if cause in STRUCTURAL:
        return fd["note"] if cause != "nan" else f"the engine's tensor holds NaN or Inf (rel_err {fd['rel_err']})"
    thr, rep = fd["threshold"], _float(fd.get("replica_rel_err"))
    err = f"rel_err {fd['rel_err']:.3g}" + (f" (another replica's {rep:.3g})" if rep > fd["rel_err"] else "")
    floor = f"threshold {thr:.3g} (HF {dtype} errs {fd['ref_rel_err']:.3g}" + \
        (f", {fd['ref_by']})" if fd.get("ref_by") else ")")
    if cause == "ranks":
        spread = _float(fd.get("rank_spread"))
        by = f"ranks {fd.get('rank_spread_by') or '?'} differ by {spread:.3g}" if not math.isnan(spread) else \
            "another rank's copy errs"
        return f"{WHY[cause]}: {by}; {err}, threshold {thr:.3g}"
    if cause == "gain":
        return f"{WHY[cause]}: every element scaled by {_gain_note(fd, dtype)}" + (
            f"; {err}, {floor}" if _worst_rel(fd) > thr else "")
    extra = f"; gain {_gain_note(fd, dtype)}" if _gain_failed(fd) else ""
    if cause == "bound":
        return f"{WHY[cause]}: max |diff| {fd['max_abs']:.3g}; {err}, {floor}{extra}"
    return f"{WHY[cause]}: {err}, {floor}{extra}"


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


def _worst_rel(fd: dict) -> float:
    """The row's error as the judge holds it: the worst replica's (``replica_rel_err``, NaN: none differs)."""
    rep = _float(fd.get("replica_rel_err"))
    return fd["rel_err"] if math.isnan(rep) else max(fd["rel_err"], rep)


def isolate_line(growth: list[dict], origin_mode: str, width: int = WIDTH) -> str:
    """The summary's ``isolate:`` line (a run with the local pass): the first layer whose output fails locally
    creates the divergence, whether later ones fail locally too, and the factor by which the propagated error
    grew across each later layer (``DiffResult.growth``); where no layer's output fails locally, whether the local
    pass fails inside a layer (the origin in the ``isolated`` mode) or only the propagated run does."""
    bad = [r["layer"] for r in growth if r.get("local_passed") is False]
    if not bad:
        return ("isolate: every layer's output is locally within the noise floor; the local pass fails inside a "
                "layer (the origin's line)") if origin_mode == "isolated" else \
            ("isolate: every layer is locally within the noise floor (the error is in a point outside the decoder "
             "layers, or only in the propagated run)")
    src, later = bad[0], bad[1:]
    local = next(r["local_rel_err"] for r in growth if r["layer"] == src)
    amp = [f"layer {r['layer']} x{r['amplification']:.3g}" for r in growth
           if r["layer"] > src and r["amplification"] is not None]
    also = "later layers are locally clean" if not later else \
        f"{'layers' if len(later) > 1 else 'layer'} {in_words(later)} also {'fail' if len(later) > 1 else 'fails'} locally"
    line = (f"isolate: layer {src} creates the divergence (local rel_err {local:.3g}); {also}; growth: "
            + (", ".join(amp) or "none"))
    return textwrap.fill(line, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def _ratio(x: float, thr: float) -> float:
    return x / thr if thr > 0 else (math.inf if x > 0 else 0.0)


def _times(x: float, thr: float) -> str:
    """``x`` as a multiple of the threshold (a zero threshold: any error is infinitely over it)."""
    return f"{_ratio(x, thr):.3g}x"


def _gain_limit(fd: dict) -> float:
    """The bound ``|gain|`` is held to: its threshold, widened on the negative side by ``gain_allowance``."""
    return fd["gain_threshold"] + (fd.get("gain_allowance", 0.0) if fd["gain"] < 0 else 0.0)


def _gain_failed(fd: dict) -> bool:
    g, thr = fd.get("gain", NAN), fd.get("gain_threshold", NAN)
    if not (isinstance(g, float) and isinstance(thr, float)):
        return False
    return abs(g) > _gain_limit(fd)


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
    """``+0.0075 (threshold 0.00079)``: the gain of the row ``fd``, with what a truncating kernel would give where
    the gain has its sign and size (``truncation_like``)."""
    g, thr = fd["gain"], fd["gain_threshold"]
    note = f"{g:+.3g} (threshold {thr:.3g})"
    if truncation_like(g, dtype, fd.get("gain_se", 0.0)):
        bits = MANTISSA_BITS[dtype]
        note += (f", of the sign and size of rounding toward zero to {dtype} instead of to nearest (-2^-{bits + 2} "
                 f"to -2^-{bits + 1} on average)")
    return note


def closest_part(row) -> str:
    """What the summary adds to a pass's closest point (``row``: its table row): how much of its excess its own op
    added, where it was measured (over half the threshold), against the bound that sets the excess: ``own_err``
    against the threshold, or where the gain sets it, ``own_gain`` against the gain's bound (``|gain| / excess``:
    the declared rounding's allowance included, as the verdict's ``own_gain`` rule reads it). Near 0, what brings
    the row near its threshold is its inputs', and over it the row would pass as inherited while its inputs pass."""
    def num(name: str) -> float:
        return float(row.get(name, math.nan))
    own, thr, x = num("own_err"), num("threshold"), num("excess")
    gain, og, gthr = abs(num("gain")), abs(num("own_gain")), num("gain_threshold")
    # the excess is the gain's where it is over rel_err's share and |gain| / excess is a gain bound (>= its threshold)
    if thr > 0 and x > 0 and gain > 0 and x > num("rel_err") / thr * (1 + 1e-9) and gain / x >= gthr * (1 - 1e-9):
        return f" (by its gain; its own op's gain: {og * x / gain:.2f}x)" if math.isfinite(og) else " (by its gain)"
    return f" (its own op's error: {own / thr:.2f}x)" if math.isfinite(own) and thr > 0 else ""
