"""The JSON documents tpcheck writes (``tpcheck diff/check/sweep --json``, ``tpcheck faults matrix --json``) are strict JSON (RFC
8259): jq, JavaScript's ``JSON.parse`` and any other conforming parser read them. Each is one object::

    {"schema_version": 3, "kind": "diff" | "check" | "sweep" | "fault_matrix", "passed": ..., "meta": {...},
     ... "rows": [...]}

* ``schema_version`` (``SCHEMA_VERSION``): an integer, raised when a document changes in a way an older
  reader would misread. Readers (``tpcheck gate`` / ``report``: ``tpcheck.result.report.load_result``) refuse a
  newer version than they know, naming the file and both versions. A file without ``schema_version`` (written
  before it existed) is read as version 0 when it otherwise has a diff result's shape. Version 2: a diff row's
  ``rank_spread`` / ``rank_spread_by`` (how far replicas differ between ranks, judged against the threshold; a
  version-1 reader would ignore them and pass a row that fails for its ranks). Version 1 files still read: their
  rows have no ``rank_spread`` (NaN), and ranks that differed are in their ``note`` as before, so they fail again.
  Version 3: a diff row's ``replica_rel_err`` / ``replica_own_err`` (each replica that differs judged against the
  golden, the spread a figure; a version-2 reader would judge the spread alone and pass a row whose other replica
  errs beyond the threshold). Version 2 files still read: their rows have no ``replica_rel_err`` (NaN), and the
  judge holds their spread to the threshold as it did.
* ``kind`` says which document it is; ``load_schema()`` returns the JSON Schema (draft 2020-12, shipped as
  ``tpcheck/result/result.schema.json``; ``tpcheck schema`` prints it) with one definition per kind.
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

Reading back, ``tpcheck.result.report.load_result`` maps ``null`` to NaN in every float column, so a loaded result is
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
from pathlib import Path, PurePath

import numpy as np
import pandas as pd
from importlib import metadata
from importlib import resources

SCHEMA_VERSION = 3
KINDS = ("diff", "check", "sweep", "fault_matrix", "comparison", "invariance")
SCHEMA_FILE = "result.schema.json"  # package data of ``tpcheck.result``
RUN_META_KEYS = ("versions", "machine", "command", "created_utc")


def package_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _static_meta() -> dict:
    import torch  # imported already (tpcheck.measure.metrics)
    gpu = None
    try:
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken driver must not stop a result from being written
        gpu = None
    return {"versions": {"tpcheck": package_version("tpcheck") or "unknown", "python": platform.python_version(),
                         "torch": str(torch.__version__), "transformers": package_version("transformers")},
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


def write_atomic(path: str | Path, write) -> Path:
    """``write(tmp)`` into a temporary file beside ``path``, then renamed onto it: a failure (a full disk, an
    error while rendering) leaves ``path`` as it was and no temporary file. An I/O error is re-raised as an
    OSError whose ``filename`` is ``path`` (the CLI names it: exit 3)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")  # same suffix: pandas infers compression
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_document(path: str | Path, doc: dict) -> Path:
    text = dumps(doc) + "\n"  # before touching the file: a failure leaves no half-written document
    return write_text_atomic(path, text)


def write_json(path: str | Path, kind: str, body: dict, meta: dict | None = None,
               command: str | None = None) -> Path:
    """Write ``document(kind, body, meta, command)`` to ``path`` as strict JSON (parent directories created);
    returns the path. E.g. ``write_json(p, "check", {"passed": ok, "model": str(model), "rows": rows})``."""
    return write_document(path, document(kind, body, meta, command))


def load_schema() -> dict:
    """The JSON Schema (draft 2020-12) of every document kind, shipped in the package (``result.schema.json``)."""
    return json.loads(resources.files("tpcheck.result").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))
