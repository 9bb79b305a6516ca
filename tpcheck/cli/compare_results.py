"""``tpcheck compare-results A.json B.json``: which points got worse between two saved results.

Both results are re-judged under the same tolerances (``tpcheck.judge``), then joined on (point, step, mode).
A point's *excess* is its error over its own threshold, so it is comparable across runs whose noise floors
differ a little. Each joined point gets one ``change``:

* ``newly failing`` — passed in A, fails in B (a regression, whatever the numbers);
* ``fixed`` — failed in A, passes in B;
* ``worse`` / ``better`` — passes (or fails) in both, excess up / down by more than ``--factor`` (default 1.5);
* ``same`` — otherwise; ``only in A`` / ``only in B`` — not compared in the other run.

Exit codes (tpcheck's contract): 0 no point newly failing, 1 some point newly failing (or B fails where A
passed), 2 a result that cannot be read or results of different models / dtypes (``--allow-mismatch`` to
compare them anyway)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from typing import TYPE_CHECKING

from tpcheck.cli.exit_codes import verdict
from tpcheck.cli.paths import check_output_paths

if TYPE_CHECKING:  # pandas and the judge load with the subcommand, not with the parser: `tpcheck --help` stays fast
    import pandas as pd

    from tpcheck.judge.tolerances import Tolerances
    from tpcheck.result.table import DiffResult

KEY = ["point", "step", "mode"]
COLUMNS = ["point", "step", "mode", "change", "excess_a", "excess_b", "ratio", "rel_err_a", "rel_err_b",
           "passed_a", "passed_b"]
CHANGES = ("newly failing", "fixed", "worse", "better", "same", "only in A", "only in B")
_ORDER = {c: i for i, c in enumerate(CHANGES)}


def _change(row, factor: float) -> str:
    a, b = row["passed_a"], row["passed_b"]
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return "only in B"
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "only in A"
    if a and not b:
        return "newly failing"
    if b and not a:
        return "fixed"
    ea, eb = row["excess_a"], row["excess_b"]
    if not (math.isfinite(ea) and math.isfinite(eb)):
        return "same" if (math.isfinite(ea) == math.isfinite(eb)) else ("worse" if math.isfinite(ea) else "better")
    if eb > factor * ea:
        return "worse"
    if ea > factor * eb:
        return "better"
    return "same"


def compare_results(a: DiffResult, b: DiffResult, tolerances: Tolerances | None = None,
                    factor: float = 1.5) -> pd.DataFrame:
    """One row per (point, step, mode) of either result (``COLUMNS``), the most alarming changes first
    (newly failing, then worse by the largest ratio)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):  # nan compares false
        raise ValueError(f"--factor must be a finite number >= 1, got {factor}")
    from tpcheck.judge.verdict import judge
    ta, tb = judge(a, tolerances).table, judge(b, tolerances).table
    cols = KEY + ["excess", "rel_err", "passed"]
    j = ta[cols].merge(tb[cols], on=KEY, how="outer", suffixes=("_a", "_b"))
    j["passed_a"] = j["passed_a"].astype(object).where(j["passed_a"].notna(), None)
    j["passed_b"] = j["passed_b"].astype(object).where(j["passed_b"].notna(), None)
    j["ratio"] = j["excess_b"] / j["excess_a"]
    j["change"] = [_change(r, factor) for _, r in j.iterrows()]
    j["_o"] = j["change"].map(_ORDER)
    j = j.sort_values(["_o", "ratio"], ascending=[True, False], na_position="last")
    return j[COLUMNS].reset_index(drop=True)


def _mismatch(a: DiffResult, b: DiffResult) -> list[str]:
    out = []
    for key in ("model", "dtype", "num_layers"):
        va, vb = a.meta.get(key), b.meta.get(key)
        if va != vb:
            out.append(f"{key}: {va!r} vs {vb!r}")
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("compare-results", help="which points got worse between two saved results "
                                                      "(tpcheck diff --json): exit 1 when a point newly fails",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, metavar="A.json", help="the baseline result")
    p.add_argument("b", type=Path, metavar="B.json", help="the result to compare with it")
    p.add_argument("--factor", type=float, default=1.5,
                   help="an excess that grows or shrinks by more than this is worse / better (default 1.5)")
    p.add_argument("--tolerances", type=Path, metavar="FILE.toml", help="re-judge both under these tolerances")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="compare results of different models, dtypes or layer counts")
    p.add_argument("--changed", action="store_true",
                   help="list every changed point (worse, better, fixed, only in A or B), not only the newly failing")
    p.add_argument("--all", action="store_true", help="list every point, changed or not")
    p.add_argument("--limit", type=int, default=20, metavar="N",
                   help="list at most N newly failing points (default 20; 0: all of them)")
    p.add_argument("--json", type=Path, help="write the comparison table as JSON")
    p.set_defaults(handler=lambda a, argv: check_output_paths(a.json) or run(a))


def run(args) -> int:
    """``tpcheck compare-results``: prints the verdict first, B's origin, then the newly failing points in B's
    execution order (``--changed``: every changed point, ``--all``: every point); returns the exit code.
    Unreadable inputs raise (``ResultFormatError``: exit 2 through ``tpcheck.cli``)."""
    from tpcheck.judge.tolerances import load_tolerances
    from tpcheck.judge.verdict import judge
    from tpcheck.result.table import load_result
    tol = load_tolerances(args.tolerances, None) if args.tolerances else None
    a, b = load_result(args.a), load_result(args.b)
    bad = _mismatch(a, b)
    if bad and not args.allow_mismatch:
        raise ValueError(f"{args.a} and {args.b} are not runs of the same model: {'; '.join(bad)} "
                         "(--allow-mismatch compares them anyway)")
    t = compare_results(a, b, tol, args.factor)
    counts = t["change"].value_counts()
    ja, jb = judge(a, tol), judge(b, tol)
    summary = ", ".join(f"{counts[c]} {c}" for c in CHANGES if c in counts)
    regressed = int(counts.get("newly failing", 0)) > 0 or (ja.passed and not jb.passed)
    print(f"{'REGRESSED' if regressed else 'NO REGRESSION'}: {args.a} ({'PASS' if ja.passed else 'FAIL'}) -> "
          f"{args.b} ({'PASS' if jb.passed else 'FAIL'}); {len(t)} points: {summary}")
    fd = jb.first_divergence
    if fd is not None:
        print(f"origin in B: {fd['point']} (step {fd['step']}, {fd['mode']}) at {fd['excess']:.3g}x its threshold")
    _print_rows(t, jb.table, args)
    if args.json:
        from tpcheck.result.documents import write_json
        write_json(args.json, "comparison", {"regressed": regressed, "a": str(args.a), "b": str(args.b),
                                             "factor": args.factor, "rows": t.to_dict("records")})
    return verdict(not regressed)


def _print_rows(t: pd.DataFrame, table_b: pd.DataFrame, args) -> None:
    """The rows asked for: by default the newly failing ones, in B's execution order (its origin first), at
    most ``--limit``; the count of the rest and the flag that lists them."""
    fmt = lambda df: df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}")  # noqa: E731
    if args.all or args.changed:
        shown = t if args.all else t[t["change"] != "same"]
        if len(shown):
            print("\n" + fmt(shown))
        return
    order = table_b[KEY + ["order"]].rename(columns={"order": "_order"})
    newly = t[t["change"] == "newly failing"].merge(order, on=KEY, how="left")
    newly = newly.assign(_m=newly["mode"] != "propagated").sort_values(["_m", "step", "_order"])[COLUMNS]
    limit = args.limit if args.limit > 0 else len(newly)
    if len(newly):
        print(f"\nnewly failing, in B's execution order{f' (first {limit} of {len(newly)})' if len(newly) > limit else ''}:")
        print(fmt(newly.head(limit)))
    rest = int((t["change"] != "same").sum()) - min(limit, len(newly))
    if rest > 0:
        print(f"\n{rest} more changed point(s) not listed: --changed lists every changed point, --all every point")
