"""The engine's effective precision: its error at each point kind told as the significand width of an arithmetic
that errs like it.

A verdict says whether the engine stays within the noise floor; it does not say how much of the dtype's precision
the engine keeps. HF at the run's dtype on one device (``ref_rel_err_hf``) is the yardstick: its error against the
float64 golden is what ``p`` significand bits of arithmetic give at that point (p = 24 in float32: 23 stored bits
and the implicit one). An engine that errs r times as much behaves like arithmetic with ``p - log2(r)`` bits, so
``bits = p - log2(median(rel_err / ref_rel_err_hf))`` over the rows of a kind: an engine twice as far from the
golden as HF's float32 is ~23-bit arithmetic; one that keeps a wider accumulator can beat p. The median, because
one row whose HF error happens to be tiny (a lucky rounding) must not decide a kind."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

SIGNIFICAND_BITS = {"float32": 24, "bfloat16": 8, "float16": 11, "float64": 53}
MODES = ("propagated", "isolated")
NOTABLE_BITS = 0.5  # a kind is named when it is at least this far below the dtype's bits
MAX_NAMED = 4


def effective_precision(table: pd.DataFrame, dtype: str) -> dict:
    """``{mode: {kind: {"bits", "ratio", "rows"}}}`` of a result's ``table`` (columns ``mode``, ``kind``,
    ``rel_err``, ``ref_rel_err_hf``) at ``dtype``: over the rows where both errors are finite and positive,
    ``ratio`` = median of ``rel_err / ref_rel_err_hf`` and ``bits`` = ``p(dtype) - log2(ratio)``. Kinds in the
    order the table first holds them; a mode or kind without such a row is left out. Plain floats and ints (JSON)."""
    p = SIGNIFICAND_BITS[dtype]
    rel = pd.to_numeric(table["rel_err"], errors="coerce").astype(float).to_numpy()
    ref = pd.to_numeric(table["ref_rel_err_hf"], errors="coerce").astype(float).to_numpy()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = rel / ref
    ok = np.isfinite(rel) & np.isfinite(ref) & (rel > 0) & (ref > 0) & np.isfinite(ratio)
    t = pd.DataFrame({"mode": table["mode"].to_numpy()[ok], "kind": table["kind"].to_numpy()[ok], "ratio": ratio[ok]})
    out: dict = {}
    for mode in [m for m in MODES if (t["mode"] == m).any()]:
        per_kind = t[t["mode"] == mode].groupby("kind", sort=False)["ratio"]
        out[mode] = {str(kind): {"bits": p - math.log2(float(r.median())), "ratio": float(r.median()), "rows": len(r)}
                     for kind, r in per_kind}
    return out


def precision_sentence(precision: dict, dtype: str) -> str:
    """One line for the CLI: the kinds whose effective bits are at least ``NOTABLE_BITS`` below the dtype's, worst
    first (at most ``MAX_NAMED``), from the local pass where the run has one (each layer's own arithmetic, not
    what it inherited), else from the propagated pass."""
    mode = next((m for m in ("isolated", "propagated") if precision.get(m)), None)
    if mode is None:
        return f"engine arithmetic: not measured (no point where HF at {dtype} has a finite, non-zero error)"
    p, kinds = SIGNIFICAND_BITS[dtype], precision[mode]
    where = " (local pass)" if mode == "isolated" else ""
    low = sorted(((v["bits"], k) for k, v in kinds.items() if v["bits"] <= p - NOTABLE_BITS), key=lambda x: x[0])
    if not low:
        better = sum(v["bits"] >= p + NOTABLE_BITS for v in kinds.values())
        return (f"engine arithmetic{where}: like {dtype} (within {NOTABLE_BITS} bit of HF's) at every point kind"
                if not better else f"engine arithmetic{where}: like {dtype} or better at every point kind ({better} "
                                   f"of {len(kinds)} more than {NOTABLE_BITS} bit above HF's)")
    named = ", ".join(f"2^{-b:.1f} at {k}" for b, k in low[:MAX_NAMED])
    more = f" and {len(low) - MAX_NAMED} more kinds" if len(low) > MAX_NAMED else ""
    rest = len(kinds) - len(low)
    others = "" if not rest else \
        f"; the other {'kind' if rest == 1 else f'{rest} kinds'} within {NOTABLE_BITS} bit of it or better"
    return f"engine arithmetic{where}: like {named}{more} ({dtype} is 2^-{p}{others})"


def precision_of(table: pd.DataFrame, meta: dict) -> str:
    """``precision_sentence`` of a result: its ``meta["effective_precision"]``, or computed from its table where a
    result has none (made before tpcheck measured it)."""
    prec = meta.get("effective_precision")
    dtype = meta["dtype"]
    return precision_sentence(prec if isinstance(prec, dict) else effective_precision(table, dtype), dtype)
