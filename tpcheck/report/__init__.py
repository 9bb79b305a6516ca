"""Reports of a diff: a self-contained HTML file (``tpcheck.report.html``) and saved results read back.

``load_result(path)`` reads what ``DiffResult.to_json`` wrote; a file that cannot be read or does not have
that shape raises ``ResultFormatError`` naming the file and what is wrong (``tpcheck gate`` exits 2 on it).

Versions (``tpcheck.result``'s module docstring): a document whose ``schema_version`` is newer than
``tpcheck.result.SCHEMA_VERSION`` is refused, naming both versions; one without ``schema_version`` (written
before documents carried it) is version 0 and is read when it has a diff result's shape (``meta`` with a
known ``dtype``, non-empty ``rows``). A document of another ``kind`` (a check, sweep or fault-matrix result)
is refused by name. ``null`` in a float column (the null rule: a non-finite value) is read as NaN."""
from __future__ import annotations

import json
import math
from pathlib import Path

from tpcheck.metrics import K_FACTOR
from tpcheck.points import split_point
from tpcheck.result import COLUMNS, SCHEMA_VERSION, DiffResult


class ResultFormatError(ValueError):
    """A saved result that is unreadable or malformed."""


_REQUIRED = ("point", "step", "mode", "rel_err", "ref_rel_err")
_NUMERIC = ("rel_err", "ref_rel_err", "ref_rel_err_hf", "ref_rel_err_tp", "threshold", "excess", "cosine", "max_abs", "mean_abs", "p99_abs", "ref_norm",
            "op_mismatch")
_DEFAULTS = {"threshold": math.nan, "excess": math.nan, "cosine": math.nan, "max_abs": math.nan,
             "max_abs_index": None, "mean_abs": math.nan, "p99_abs": math.nan, "ref_norm": math.nan,
             "nan": 0, "inf": 0, "op_mismatch": math.nan, "passed": True, "note": "", "ref_rel_err_hf": math.nan,
             "ref_rel_err_tp": math.nan, "ref_by": ""}


def _num(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def result_from_dict(data, source: str = "<result>") -> DiffResult:
    """A ``DiffResult`` from the parsed JSON of ``DiffResult.to_json``; ``source`` names it in errors."""
    if not isinstance(data, dict):
        raise ResultFormatError(f"{source}: expected a JSON object with 'meta' and 'rows', got {type(data).__name__}")
    version = data.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ResultFormatError(f"{source}: schema_version must be an integer >= 0, got {version!r}")
    if version > SCHEMA_VERSION:
        raise ResultFormatError(f"{source}: schema_version {version} is newer than this tpcheck "
                                f"({_tpcheck_version()}) reads: schema_version {SCHEMA_VERSION} and older; "
                                f"read it with a newer tpcheck")
    kind = data.get("kind", "diff" if version == 0 else None)
    if kind != "diff":
        if "kind" not in data:
            raise ResultFormatError(f"{source}: no 'kind' key (a schema_version {version} document must have one)")
        what = f"a tpcheck {kind} result" if isinstance(kind, str) else f"kind {kind!r}"
        raise ResultFormatError(f"{source}: {what}, not a diff result (the --json output of tpcheck diff)")
    for key in ("meta", "rows"):
        if key not in data:
            raise ResultFormatError(f"{source}: no '{key}' key (is this the --json output of tpcheck diff?)")
    meta, rows = data["meta"], data["rows"]
    if not isinstance(meta, dict):
        raise ResultFormatError(f"{source}: 'meta' must be an object")
    if meta.get("dtype") not in K_FACTOR:
        raise ResultFormatError(f"{source}: meta.dtype is {meta.get('dtype')!r}, expected one of {', '.join(K_FACTOR)}")
    if not isinstance(rows, list) or not (rows or (meta.get("coverage") or {}).get("problem")):
        raise ResultFormatError(f"{source}: 'rows' must be a non-empty list (empty only with meta.coverage.problem)")
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ResultFormatError(f"{source}: rows[{i}] is not an object")
        missing = [c for c in _REQUIRED if c not in r]
        if missing:
            raise ResultFormatError(f"{source}: rows[{i}] has no {', '.join(repr(m) for m in missing)}")
        if not isinstance(r["point"], str) or r.get("mode") not in ("propagated", "isolated"):
            raise ResultFormatError(f"{source}: rows[{i}]: bad point {r['point']!r} or mode {r.get('mode')!r}")
        if isinstance(r["step"], bool) or not isinstance(r["step"], int) or r["step"] < 0:
            raise ResultFormatError(f"{source}: rows[{i}].step must be an integer >= 0, got {r['step']!r}")
        for c in _NUMERIC:
            if c in r and not _num(r[c]):
                raise ResultFormatError(f"{source}: rows[{i}].{c} must be a number or null, got {r[c]!r}")
        if "passed" in r and not isinstance(r["passed"], bool):
            raise ResultFormatError(f"{source}: rows[{i}].passed must be true or false, got {r['passed']!r}")
        layer, kind = split_point(r["point"])
        row = {**_DEFAULTS, "layer": layer, "kind": kind, **{k: v for k, v in r.items() if k in COLUMNS}}
        for c in _NUMERIC:  # JSON null: NaN or inf that pandas wrote as null
            if row[c] is None:
                row[c] = math.nan
        row["note"] = row["note"] or ""
        row["order"] = i  # rows are saved in execution order within each (mode, step)
        out.append(row)
    return DiffResult.from_rows(out, meta, stamp=False)  # meta says where and when the result was made


def _tpcheck_version() -> str:
    from tpcheck.result import run_meta
    return run_meta()["versions"]["tpcheck"]


def load_result(path: str | Path) -> DiffResult:
    """Read a result written by ``DiffResult.to_json`` (``tpcheck diff --json``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ResultFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ResultFormatError(f"{path}: not UTF-8 text: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultFormatError(f"{path}: not valid JSON: {e}") from None
    return result_from_dict(data, str(path))


def __getattr__(name):  # lazy: the HTML module is only imported when a report is written
    if name in ("render_html", "write_html", "render_sweep_html"):
        from tpcheck.report import html
        return getattr(html, name)
    raise AttributeError(name)


__all__ = ["ResultFormatError", "load_result", "result_from_dict", "render_html", "write_html", "render_sweep_html"]
