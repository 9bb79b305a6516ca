"""``tpcheck gate`` and ``tpcheck report``: re-judge and render saved results (``tpcheck diff --json``).

``tpcheck gate RESULT.json [RESULT.json ...] [--tolerances FILE]`` exits 0 when every point of every result
is within tolerance, 1 when a point is over (the message names the first failing point, its layer and
step, and by how much), 2 when an input cannot be read (missing, not JSON, not a diff result) or the
tolerance file is bad. Tolerances: ``--tolerances FILE`` or else ``[tool.tpcheck]`` in ``./pyproject.toml``
or else the defaults (``tpcheck.judge.tolerances``).

``tpcheck report RESULT.json -o PATH`` writes the HTML report of one result; with several results ``-o`` is
a directory that gets one report per result and an ``index.html`` summary of the matrix linking to each.
``tpcheck report SWEEP.json -o PATH`` (``tpcheck sweep --json``) writes the sweep's summary page: every
configuration, its verdict, origin and repro (``tpcheck sweep --html DIR`` also writes each failing
configuration's report, linked from it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tpcheck.cli.exit_codes import Exit
from tpcheck.cli.paths import check_output_paths
from tpcheck.inputs.files.validate import read_json

if TYPE_CHECKING:  # the judge (torch, pandas) loads with the subcommand, not the parser: `tpcheck --help` stays fast
    from tpcheck.judge.tolerances import Tolerances
    from tpcheck.result.table import DiffResult

PASS, FAIL, BAD_INPUT, ENGINE_FAILED = Exit.PASS, Exit.DIVERGED, Exit.BAD_INPUT, Exit.FAILED


def gate_result(result: DiffResult, tolerances: Tolerances | None = None, name: str = "result") -> tuple[int, str, DiffResult]:
    """Re-judge ``result`` under ``tolerances`` (``tpcheck.judge``): (exit code, message, re-judged result)."""
    from tpcheck.judge.tolerances import Tolerances
    from tpcheck.judge.verdict import judge
    from tpcheck.result.origin import ranks_cause
    tol = tolerances or Tolerances()
    r = judge(result, tol)
    t = r.table
    dtype = r.meta["dtype"]
    if r.passed:
        worst = r.worst()
        return PASS, (f"PASS {name}: all {len(t)} points within tolerance ({tol.source}); closest: {worst.point} "
                      f"(step {worst.step}, {worst['mode']}) at {worst.excess:.3g}x its threshold"), r
    fd = r.first_divergence
    if fd is None:  # every compared point passes: coverage failed the run (or nothing was compared)
        why = r.coverage_problem or "no point was compared"
        return ENGINE_FAILED, f"FAIL {name}: coverage: {why}", r
    row = t[(t["point"] == fd["point"]) & (t["step"] == fd["step"]) & (t["mode"] == fd["mode"])].iloc[0]
    where = (f"layer {fd['layer']}" if fd["layer"] is not None else "outside the decoder layers") + \
            f", step {fd['step']}, {fd['mode']}"
    bound = tol.abs_max(row.kind, dtype)
    reasons = []  # the cause first: ranks that disagree, then the error against the golden
    ranks = ranks_cause(row)
    if ranks:
        reasons.append(ranks)
    if not (row.rel_err <= row.threshold):
        reasons.append(f"rel_err {row.rel_err:.3g} > threshold {row.threshold:.3g} "
                       f"({tol.describe(row.kind, dtype, row.ref_rel_err)})")
    if bound is not None and not (row.max_abs <= bound):
        reasons.append(f"max |diff| {row.max_abs:.3g} > abs_max {bound:.3g}")
    if abs(row.gain) > row.gain_threshold:  # NaN (not judged) compares False
        reasons.append(f"|gain| {abs(row.gain):.3g} > gain threshold {row.gain_threshold:.3g} (a systematic "
                       "relative error: tpcheck.judge.verdict)")
    n_bad = int((~t["passed"]).sum())
    tail = f". {n_bad} of {len(t)} points fail ({tol.source})"
    if not reasons:  # within its error bounds: failed for its note (shape, ranks' shapes, exact ops)
        return FAIL, (f"FAIL {name}: first failing point {fd['point']} ({where}) fails: "
                      + (row.note or "failed in the saved run for a reason other than its error") + tail), r
    excess = "nan" if row.excess != row.excess else f"{row.excess:.3g}x"
    return FAIL, (f"FAIL {name}: first failing point {fd['point']} ({where}) is over tolerance by {excess}: "
                  + "; ".join(([row.note] if row.note else []) + reasons) + tail), r


def regate(result_json_path: str | Path, tolerances: Tolerances | str | Path | None = None) -> tuple[int, str]:
    """Re-judge a saved result: ``(0, message)`` pass, ``(1, message)`` a point over tolerance, ``(2, message)``
    unreadable or malformed input, ``(3, message)`` the run's coverage failed (``tpcheck.judge.coverage``).
    ``tolerances``: a ``Tolerances``, a TOML file path, or None (defaults)."""
    from tpcheck.judge.tolerances import ToleranceError, Tolerances, load_tolerances
    from tpcheck.result.report import ResultFormatError, load_result
    try:
        if tolerances is not None and not isinstance(tolerances, Tolerances):
            tolerances = load_tolerances(tolerances)
        result = load_result(result_json_path)
    except (ResultFormatError, ToleranceError) as e:
        return BAD_INPUT, f"tpcheck gate: error: {e}"
    code, msg, _ = gate_result(result, tolerances, str(result_json_path))
    return code, msg


# ------------------------------------------------------------------------------------------------ command line

def register(subparsers) -> None:
    """Add ``gate`` and ``report`` to ``tpcheck``'s sub-command parsers."""
    g = subparsers.add_parser("gate", help="re-judge saved results (tpcheck diff --json): exit 0 pass, 1 fail, 2 bad input, 3 coverage",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    g.add_argument("--tolerances", type=Path, metavar="FILE.toml",
                   help="tolerance file (default: [tool.tpcheck] in ./pyproject.toml, else the built-in defaults)")
    g.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"), help=argparse.SUPPRESS)
    r = subparsers.add_parser("report", help="write the HTML report of saved results (diff, or a sweep's summary)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    r.add_argument("-o", "--output", type=Path, required=True,
                   help="the HTML file (one result) or a directory (several: a report each and index.html)")
    r.add_argument("--tolerances", type=Path, metavar="FILE.toml", help="re-judge under these tolerances first")
    r.add_argument("--title", help="page title")
    for p in (g, r):
        p.set_defaults(handler=_command)


def _command(args, argv: list[str]) -> int:
    check_output_paths(getattr(args, "output", None), allow_dir=True)
    return run(args)


def run(args) -> int:
    """Run ``gate`` or ``report`` from parsed ``args``; returns the exit code."""
    from tpcheck.judge.tolerances import ToleranceError, load_tolerances
    try:
        if args.cmd == "gate":
            tol = load_tolerances(args.tolerances, args.pyproject)
        else:
            tol = load_tolerances(args.tolerances, None) if args.tolerances else None
    except ToleranceError as e:
        print(f"tpcheck {args.cmd}: error: {e}", file=sys.stderr)
        return BAD_INPUT
    if args.cmd == "gate":
        return _gate(args.results, tol)
    if args.cmd == "report":
        return _report(args.results, args.output, tol, args.title)
    raise ValueError(f"not a gate/report command: {args.cmd}")


def _gate(paths: list[Path], tol: Tolerances) -> int:
    worst = PASS
    for p in paths:
        code, msg = regate(p, tol)
        print(msg, file=sys.stderr if code == BAD_INPUT else sys.stdout)
        worst = max(worst, code)
    return worst


def _config_row(r: DiffResult, name: str) -> dict:
    m = r.meta
    fd = r.first_divergence
    return {"result": name, "model": str(m.get("model", "?")).rstrip("/").rsplit("/", 1)[-1], "dtype": m.get("dtype"),
            "decode_steps": m.get("decode_steps"), "inject": ",".join(m.get("inject") or []) or "-",
            "tp": m.get("tp"), "pp": m.get("pp", 1), "passed": r.passed,
            "origin": "-" if fd is None else f"{fd['point']} (step {fd['step']}, {fd['excess']:.3g}x)"}


def _sweep_document(path: Path) -> list[dict] | None:
    """The rows of a ``tpcheck sweep --json`` document, or None for any other file (read as a diff result, whose
    reader names what is wrong with it)."""
    from tpcheck.result.report import ResultFormatError
    try:
        data = read_json(path, ValueError, "sweep")  # strict and bounded, as every file tpcheck reads
    except ValueError:
        return None
    if not (isinstance(data, dict) and data.get("kind") == "sweep"):
        return None
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "config" in r for r in rows):
        raise ResultFormatError(f"{path}: a sweep document whose 'rows' are not a non-empty list of configurations")
    return rows


def _report_sweep(path: Path, rows: list[dict], out: Path, title: str | None) -> int:
    """A sweep's summary page (its JSON holds no rows of the diffs: no per-configuration report to link;
    ``tpcheck sweep --html DIR`` writes those)."""
    from tpcheck.result.report.sweep import render_sweep_html, sweep_index_rows
    page_path = out / "index.html" if out.is_dir() or str(out).endswith("/") else out
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(render_sweep_html(sweep_index_rows(rows), None, title or f"tpcheck sweep {path.name}"),
                         encoding="utf-8")
    print(f"wrote {page_path} (the sweep's {len(rows)} configurations; for a report of each failing one, "
          f"run the sweep with --html DIR)")
    return PASS


def _report(paths: list[Path], out: Path, tol: Tolerances | None, title: str | None) -> int:
    from tpcheck.judge.verdict import judge
    from tpcheck.result.documents import write_text_atomic
    from tpcheck.result.report import ResultFormatError, load_result
    from tpcheck.result.report.html import render_sweep_html, write_html
    try:
        sweep_rows = _sweep_document(paths[0]) if len(paths) == 1 else None
    except ResultFormatError as e:
        print(f"tpcheck report: error: {e}", file=sys.stderr)
        return BAD_INPUT
    if sweep_rows is not None:
        return _report_sweep(paths[0], sweep_rows, out, title)
    results = []
    for p in paths:
        try:
            r = load_result(p)
        except ResultFormatError as e:
            print(f"tpcheck report: error: {e}", file=sys.stderr)
            return BAD_INPUT
        results.append((p, judge(r, tol) if tol is not None else r))
    if len(results) == 1 and not (out.is_dir() or str(out).endswith("/")):
        write_html(results[0][1], out, title)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
        return PASS
    out.mkdir(parents=True, exist_ok=True)
    rows, links, used = [], [], set()
    for p, r in results:
        stem = p.stem
        while stem in used or stem == "index":
            stem += "_"
        used.add(stem)
        write_html(r, out / f"{stem}.html")
        rows.append(_config_row(r, p.name))
        links.append(f"{stem}.html")
    write_text_atomic(out / "index.html", render_sweep_html(rows, links, title or "tpcheck sweep"))
    print(f"wrote {len(results)} reports and {out / 'index.html'}")
    return PASS
