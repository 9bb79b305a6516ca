"""``DiffResult``: the per-point table of a diff, its verdict, where the divergence began, and how it grew;
and the JSON documents tpcheck writes (``write_json``), their schema (``load_schema``) and run metadata
(``run_meta``).

JSON documents (``tpcheck diff/check/sweep --json``, ``tpcheck faults matrix --json``) are strict JSON (RFC
8259): jq, JavaScript's ``JSON.parse`` and any other conforming parser read them. Each is one object::

    {"schema_version": 1, "kind": "diff" | "check" | "sweep" | "fault_matrix", "passed": ..., "meta": {...},
     ... "rows": [...]}

* ``schema_version`` (``SCHEMA_VERSION``): an integer, raised when a document changes in a way an older
  reader would misread. Readers (``tpcheck gate`` / ``report``: ``tpcheck.report.load_result``) refuse a
  newer version than they know, naming the file and both versions. A file without ``schema_version`` (written
  before it existed) is read as version 0 when it otherwise has a diff result's shape.
* ``kind`` says which document it is; ``load_schema()`` returns the JSON Schema (draft 2020-12, shipped as
  ``tpcheck/result.schema.json``; ``tpcheck schema`` prints it) with one definition per kind.
* ``meta`` has at least ``run_meta()``'s keys: ``versions`` (tpcheck, python, torch, transformers),
  ``machine`` (platform, cpu_count, gpu), ``command`` and ``created_utc`` (ISO 8601, UTC); a diff's meta adds
  the run's own keys (model, dtype, tp, ...).

**The null rule.** A non-finite float (NaN, +inf, -inf), anywhere in a document, is written as ``null``;
``null`` in a number field never means anything else. Nothing is written as ``NaN`` or ``Infinity``: the
writer sanitizes recursively (``strict_json``) and then calls ``json.dumps(..., allow_nan=False)``, so a value
the sanitizer missed raises instead of producing invalid JSON. How a reader tells *why* a number is null:

* a diff row: ``nan`` / ``inf`` > 0 -- the engine's tensor held that many NaN / Inf elements, so its
  ``rel_err``, ``cosine``, ``max_abs``, ``excess``, ... are not finite (a NaN-producing engine); else ``note``
  non-empty -- the comparison could not be made (``shape [...] != golden [...]``: the error statistics are
  infinite); else ``excess`` null with a finite ``rel_err`` -- a zero threshold (a tolerance file's floor 0);
  else the column does not apply to the row: ``ref_rel_err_tp`` at tp 1, ``op_mismatch`` without
  ``--exact-ops`` or at a point exact ops do not check, ``ref_rel_err`` / ``ref_rel_err_hf`` where no
  reference measured an error (the threshold is then the floor), ``cosine`` where the engine's or the
  golden tensor is all zero;
* ``first_divergence`` is the first failing row: the same rule, with that row's counts in ``rows``;
* a sweep row's ``excess``: its worst point's excess was not finite (NaN in the engine, or a shape mismatch:
  ``origin`` / ``failing_example`` / ``error`` say which); a fault-matrix row's: its ``by`` / ``note``.

Reading back, ``tpcheck.report.load_result`` maps ``null`` to NaN in every float column, so a loaded result is
re-judged (``tpcheck gate``) to the same verdict and origin: the gate treats NaN and inf alike (neither is
within a threshold; a non-finite reference error leaves the floor as the threshold)."""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
import pandas as pd

from tpcheck.metrics import FLOOR, K_FACTOR

SCHEMA_VERSION = 1
KINDS = ("diff", "check", "sweep", "fault_matrix")
SCHEMA_FILE = "result.schema.json"  # package data of ``tpcheck``
RUN_META_KEYS = ("versions", "machine", "command", "created_utc")


# ref_rel_err: the reference error the threshold uses: the worst row (token) of the references at this point
# over this and earlier steps, or a reference's whole-tensor error if larger; ref_by names the reference and
# step ("hf-tp@0"). The references' whole-tensor errors at this step: ref_rel_err_hf (HF at the dtype, one
# device) and ref_rel_err_tp (HF at the dtype rounding as the engine's TP all-reduces do; NaN at tp 1).
COLUMNS = ["point", "layer", "step", "mode", "kind", "rel_err", "ref_rel_err", "ref_rel_err_hf", "ref_rel_err_tp",
           "ref_by", "threshold", "excess", "cosine",
           "max_abs", "max_abs_index", "mean_abs", "p99_abs", "ref_norm", "nan", "inf", "op_mismatch", "passed", "note", "order"]


@dataclass
class DiffResult:
    table: pd.DataFrame
    meta: dict

    @classmethod
    def from_rows(cls, rows: list[dict], meta: dict, *, stamp: bool = True) -> "DiffResult":
        """The result of ``rows`` (``COLUMNS``). ``stamp``: add ``run_meta()``'s keys to ``meta`` where it has
        none (a new result: this process made it, now); False for a result read back from a file, whose meta
        says where and when it was made."""
        df = pd.DataFrame(rows, columns=COLUMNS)
        df = df.sort_values(["mode", "step", "order"], kind="stable").reset_index(drop=True)
        return cls(df, {**run_meta(), **meta} if stamp else dict(meta))

    @property
    def passed(self) -> bool:
        """Every point within its threshold, and coverage met (``tpcheck.coverage``): a run that compared
        nothing, or lacks a required point, does not pass."""
        return bool(len(self.table)) and bool(self.table["passed"].all()) and not self.coverage_problem

    @property
    def coverage_problem(self) -> str:
        return (self.meta.get("coverage") or {}).get("problem", "")

    def _failing(self, mode: str = "propagated") -> pd.DataFrame:
        t = self.table
        return t[(t["mode"] == mode) & ~t["passed"]]

    @property
    def first_divergence(self) -> dict | None:
        """The first failing point in execution order (earliest step first): the origin."""
        bad = self._failing()
        if bad.empty:
            bad = self._failing("isolated")
            if bad.empty:
                return None
        r = bad.iloc[0]
        return {"point": r.point, "layer": None if pd.isna(r.layer) else int(r.layer), "step": int(r.step),
                "mode": r["mode"], "rel_err": float(r.rel_err), "ref_rel_err": float(r.ref_rel_err),
                "ref_by": r.ref_by if isinstance(r.ref_by, str) else "",
                "threshold": float(r.threshold), "excess": float(r.excess), "max_abs": float(r.max_abs),
                "max_abs_index": r.max_abs_index, "note": r.note}

    def layer_table(self, mode: str = "propagated") -> pd.DataFrame:
        """The worst point (largest excess over its threshold) of each (step, layer)."""
        t = self.table[self.table["mode"] == mode].copy()
        t["layer_key"] = t["layer"].fillna(-1)
        t["excess_key"] = t["excess"].fillna(math.inf)
        idx = t.groupby(["step", "layer_key"], sort=False)["excess_key"].idxmax()
        w = t.loc[idx].sort_values(["step", "order"])
        return w[["step", "layer", "point", "rel_err", "ref_rel_err", "ref_by", "excess", "max_abs", "passed", "note"]]

    def growth(self) -> list[dict]:
        """With an isolated pass: each layer's local error (isolated) beside its propagated error and the
        factor by which the propagated error grew across it."""
        t = self.table[(self.table["kind"] == "out") & (self.table["step"] == 0)]
        prop = t[t["mode"] == "propagated"].set_index("layer")
        iso = t[t["mode"] == "isolated"].set_index("layer")
        out, prev = [], None
        for layer in prop.index:
            e = float(prop.loc[layer, "rel_err"])
            row = {"layer": int(layer), "propagated_rel_err": e, "amplification": (e / prev) if prev else None}
            if layer in iso.index:
                row["local_rel_err"] = float(iso.loc[layer, "rel_err"])
                row["local_passed"] = bool(iso.loc[layer, "passed"])
            out.append(row)
            prev = e if e > 0 else None
        return out

    def summary(self) -> str:
        cov = self.meta.get("coverage") or {}
        missing = cov.get("not_reported") or []
        tail = "" if not missing else (f"\nnot reported by the engine ({len(missing)}): {', '.join(missing[:12])}"
                                       f"{' ...' if len(missing) > 12 else ''}")
        if self.coverage_problem:
            tail += f"\ncoverage: {self.coverage_problem}"
        return self._verdict() + tail

    def _verdict(self) -> str:
        fd = self.first_divergence
        m = self.meta
        head = f"{'PASS' if self.passed else 'FAIL'}: tp={m.get('tp', '?')} {m['dtype']}, {len(self.table)} comparisons"
        if fd is None:
            worst = self.table.loc[self.table["excess"].idxmax()] if len(self.table) else None
            tail = "" if worst is None else (f"; closest to its threshold: {worst.point} (step {worst.step}) at "
                                             f"{worst.excess:.2f}x")
            ops = ""
            if m.get("exact_ops") and "op_mismatch" in self.table:
                n_ops = int(self.table["op_mismatch"].notna().sum())
                ops = f" and all {n_ops} checked ops (norms, residual adds) bit-identical to HF's"
            return head + ", every point within the noise floor" + ops + tail
        lines = [head, f"origin: {fd['point']} (step {fd['step']}{', ' + fd['mode'] if fd['mode'] != 'propagated' else ''}): "
                       f"rel_err {fd['rel_err']:.3g} vs HF {m['dtype']} {fd['ref_rel_err']:.3g}"
                       + (f" ({fd['ref_by']})" if fd.get("ref_by") else "") + " "
                       f"-> {fd['excess']:.3g}x its threshold {fd['threshold']:.3g}; max |diff| {fd['max_abs']:.3g} "
                       f"at (batch, token, feature) {fd['max_abs_index']}" + (f"; {fd['note']}" if fd["note"] else "")]
        if m.get("isolate"):
            g = self.growth()
            local_bad = [r["layer"] for r in g if r.get("local_passed") is False]
            if local_bad:
                src = local_bad[0]
                amp = [f"layer {r['layer']} x{r['amplification']:.3g}" for r in g
                       if r["layer"] > src and r["amplification"] is not None]
                lines.append(f"isolate: layer {src} creates the divergence (local rel_err "
                             f"{next(r['local_rel_err'] for r in g if r['layer'] == src):.3g}); later layers are locally "
                             f"{'clean' if local_bad == [src] else 'also failing: ' + str(local_bad[1:])}; growth: "
                             + (", ".join(amp) or "none"))
            else:
                lines.append("isolate: every layer is locally within the noise floor (the error is in a point "
                             "outside the decoder layers, or only in the propagated run)")
        return "\n".join(lines)

    @classmethod
    def from_json(cls, path: str | Path) -> "DiffResult":
        """Read what ``to_json`` wrote; ``tpcheck.report.ResultFormatError`` (a ValueError) names the file and
        what is wrong."""
        from tpcheck.report import load_result  # lazy: tpcheck.report imports this module
        return load_result(path)

    def to_document(self) -> dict:
        """The ``kind: "diff"`` JSON document (strict: see the module's null rule). Keys ``run_meta()`` adds that
        ``meta`` lacks (a result built without ``from_rows``) are those of this process, now."""
        rows = self.table.drop(columns=["order"]).to_dict(orient="records")
        for r in rows:  # integer columns that pandas holds as floats beside NaN (layer: NaN outside the layers)
            for c in _INT_COLUMNS:
                v = r.get(c)
                if isinstance(v, float) and v.is_integer():
                    r[c] = int(v)
        return document("diff", {"passed": self.passed, "first_divergence": self.first_divergence, "rows": rows},
                        meta=self.meta)

    def to_json(self, path: str | Path) -> None:
        """Write ``to_document()``: full float64 precision, non-finite values as null, ``allow_nan=False``."""
        _write(path, self.to_document())

    def to_csv(self, path: str | Path) -> None:
        self.table.drop(columns=["order"]).to_csv(path, index=False)


_INT_COLUMNS = ("layer", "step", "nan", "inf")


# ------------------------------------------------------------------------------------------ JSON documents

def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _static_meta() -> dict:
    import torch  # imported already (tpcheck.metrics)
    gpu = None
    try:
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken driver must not stop a result from being written
        gpu = None
    return {"versions": {"tpcheck": _version("tpcheck") or "unknown", "python": platform.python_version(),
                         "torch": str(torch.__version__), "transformers": _version("transformers")},
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "gpu": gpu}}


def _process_command() -> str:
    """This process's command line, as a shell would take it (``tpcheck ...`` for the console script)."""
    argv = list(sys.argv) or [""]
    head = Path(argv[0]).name or "python"
    if head == "__main__.py":  # python -m tpcheck
        head = f"python -m {Path(argv[0]).parent.name}"
    return " ".join([head, shlex.join(argv[1:])]).strip()


def run_meta(command: str | None = None) -> dict:
    """What made a result: ``versions`` (tpcheck, python, torch, transformers: strings; transformers None when
    not installed), ``machine`` (``platform.platform()``, CPU count, the name of GPU 0 when
    ``torch.cuda.is_available()``, else None), ``command`` (default: this process's command line) and
    ``created_utc`` (now, ISO 8601 in UTC, e.g. ``2025-01-31T12:00:00+00:00``)."""
    static = _static_meta()
    return {"versions": dict(static["versions"]), "machine": dict(static["machine"]),
            "command": command if command is not None else _process_command(),
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def strict_json(obj):
    """``obj`` as plain JSON data under the null rule: non-finite floats (Python, numpy) become None; numpy
    scalars and arrays, tuples and sets become Python numbers and lists; paths and other objects their
    ``str()`` (as ``json.dumps(default=str)`` did); dict keys strings."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, float):  # np.float64 too
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [strict_json(v) for v in sorted(obj, key=repr)]
    if isinstance(obj, np.generic):
        return strict_json(obj.item())
    if isinstance(obj, np.ndarray):
        return strict_json(obj.tolist())
    if obj is pd.NA or obj is pd.NaT:
        return None
    if isinstance(obj, (datetime.datetime, datetime.date)):
        return obj.isoformat()
    if isinstance(obj, PurePath):
        return str(obj)
    if hasattr(obj, "tolist"):  # a torch tensor
        return strict_json(obj.tolist())
    return str(obj)


def dumps(doc) -> str:
    """Strict JSON text of ``doc``: ``strict_json`` then ``json.dumps(allow_nan=False)`` (a non-finite float
    that got past the sanitizer raises ValueError rather than writing ``NaN``)."""
    return json.dumps(strict_json(doc), indent=1, allow_nan=False)


def document(kind: str, body: dict, meta: dict | None = None, command: str | None = None) -> dict:
    """The JSON document of ``kind`` (``KINDS``): ``schema_version``, ``kind``, ``body``'s keys, and ``meta``:
    ``run_meta(command)`` under ``meta`` (``meta``'s own keys, e.g. a diff's command, win), with ``rows``
    last. Not yet sanitized: ``dumps`` / ``write_json`` do that."""
    if kind not in KINDS:
        raise ValueError(f"unknown document kind {kind!r}; kinds: {', '.join(KINDS)}")
    clash = {"schema_version", "kind"} & set(body)
    if clash:
        raise ValueError(f"body must not set {', '.join(sorted(clash))}")
    meta = {**run_meta(command), **(body.get("meta") or {}), **(meta or {})}
    doc = {"schema_version": SCHEMA_VERSION, "kind": kind}
    doc.update((k, v) for k, v in body.items() if k not in ("meta", "rows"))
    doc["meta"] = meta
    if "rows" in body:
        doc["rows"] = body["rows"]
    return doc


def _write(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    text = dumps(doc) + "\n"  # before touching the file: a failure leaves no half-written document
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_json(path: str | Path, kind: str, body: dict, meta: dict | None = None,
               command: str | None = None) -> Path:
    """Write ``document(kind, body, meta, command)`` to ``path`` as strict JSON (parent directories created);
    returns the path. E.g. ``write_json(p, "check", {"passed": ok, "model": str(model), "rows": rows})``."""
    return _write(path, document(kind, body, meta, command))


def load_schema() -> dict:
    """The JSON Schema (draft 2020-12) of every document kind, shipped in the package (``result.schema.json``)."""
    from importlib import resources
    return json.loads(resources.files("tpcheck").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))
