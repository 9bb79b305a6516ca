"""The lines a result's summary adds after its verdict (``DiffResult.summary``): the engine's declared rounding and
the rows that passed only by it, where the ranks' replicas differ, and which rows the local pass ran."""
from __future__ import annotations

import math

import pandas as pd

from tpcheck.result.origin import rounding_allowance


def after_verdict(table: pd.DataFrame, meta: dict) -> str:
    """``allowances``, ``by_rounding``, ``replicas`` then ``local_rows``: each a line starting with a newline, or
    nothing."""
    return allowances(meta) + by_rounding(table, meta) + replicas(table) + local_rows(meta)


ALLOWANCES = {  # meta["allowances"] key -> what carried those rows (tpcheck.judge.verdict)
    "inherited": "as inherited (over the floor only through their inputs; their own op, recomputed on the engine's "
                 "inputs, within what a correct kernel of any design may add)",
    "rel_floor": "by the ulp floor (one ulp of the element that holds the norm)",
    "gain_floor": "by the gain floor (a per-row scale a correct kernel rounds otherwise)",
}


def allowances(meta: dict) -> str:
    """The line counting the passing rows that an allowance beyond the references' noise floor alone carried, by
    allowance (none: nothing), so a pass is judged as well as a fail."""
    a = meta.get("allowances") or {}
    parts = [f"{a[k]} {why}" for k, why in ALLOWANCES.items() if a.get(k)]
    return "" if not parts else "\nallowances: passed only by an allowance: " + "; ".join(parts)


def local_rows(meta: dict) -> str:
    """The line saying the local pass ran each prompt's last rows (``tpcheck.pipeline.local_rows``; every row:
    nothing)."""
    n = meta.get("local_rows")
    if not n:
        return ""
    return (f"\nlocal pass: the last {n} positions of each prompt's prefill (and every decode step), the keys and "
            "values of earlier positions the golden's; the propagated pass judged every row (--local-rows 0: the "
            "local pass on every row)")


def replicas(table: pd.DataFrame) -> str:
    """The line saying where ranks' replicas differ, each judged against the golden (none: nothing)."""
    if "replica_rel_err" not in table:
        return ""
    t = table[table["replica_rel_err"].notna()]
    if t.empty:
        return ""
    w = t.loc[(t["rank_spread"] / t["threshold"]).astype(float).fillna(math.inf).idxmax()]
    return (f"\nreplicas: the ranks' replicas differ at {len(t)} of {len(table)} rows, each judged against the "
            f"golden; furthest apart: {w.point} (step {w.step}), ranks {w.rank_spread_by or '?'} by "
            f"{w.rank_spread:.3g}, {w.rank_spread / w.threshold:.3g}x its threshold")


def by_rounding(table: pd.DataFrame, meta: dict) -> str:
    """The line naming the declared rounding and the rows whose gain passed only by it (none: nothing)."""
    r = meta.get("rounding") if isinstance(meta.get("rounding"), dict) else {}
    t = table[table["by_rounding"].astype(bool)] if "by_rounding" in table else table[:0]
    if r.get("mode", "nearest") == "nearest" and t.empty:
        return ""
    line = f"\nrounding: declared {r.get('mode')} ({r.get('why') or '?'})"
    if not rounding_allowance(meta):
        return line
    pts = list(dict.fromkeys(t["point"]))
    pts = ", ".join(pts[:6]) + (f" and {len(pts) - 6} more points" if len(pts) > 6 else "")
    return line + (f"; {len(t)} rows' gain within its bound only by it (negative, up to "
                   f"{rounding_allowance(meta):.3g} more){': ' + pts if pts else ''}")
