"""``DiffResult``: the per-point table of a diff (one ``Row`` per comparison: the only list of columns), its
verdict, where the divergence began and how it grew; saved as a JSON document (``to_json``, the format in
``tpcheck.result.documents``) and read back (``load_result``)."""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import pandas as pd

from tpcheck.result.documents import SCHEMA_VERSION, document, package_version, run_meta, write_atomic, \
    write_document
from tpcheck.measure.metrics import K_FACTOR
from tpcheck.capture.points import point_order, split_point
from tpcheck.inputs.files.validate import MAX_LAYERS, int_in, read_json
from tpcheck.result.after_verdict import after_verdict
from tpcheck.result.origin import closest_part, isolate_line, origin_lines, rounding_allowance

NAN = math.nan


@dataclass
class Row:
    """One comparison of one point at one step: the table's columns, in order. The diff run fills the
    measurements and structural findings; ``tpcheck.judge`` fills ``threshold``, ``excess`` and ``passed``."""

    point: str
    layer: int | None
    step: int
    mode: str                      # "propagated" or "isolated" (teacher-forced)
    kind: str                      # the point's kind, the key of per-kind tolerances ("attn.q", "logits", ...)
    rel_err: float                 # ||engine - golden|| / ||golden||
    # the reference error the threshold uses: the worst row (token) of the references at this point over this
    # and earlier steps, or a reference's whole-tensor error if larger; ref_by names reference and step
    ref_rel_err: float
    ref_rel_err_hf: float = NAN    # HF at the dtype on one device, whole tensor, this step
    ref_rel_err_tp: float = NAN    # HF at the dtype rounding as the engine's TP all-reduces do (NaN at tp 1)
    ref_by: str = ""               # "hf-tp@0": the reference and step that set ref_rel_err
    threshold: float = NAN
    excess: float = NAN            # rel_err / threshold (or max_abs / abs_max, or |gain| / gain_threshold, if larger)
    # a systematic relative error (tpcheck.measure.gain): the median of (engine - golden) / golden over the
    # gain_n elements of at least their row's median magnitude, its standard error from the engine's own spread,
    # the largest |gain| of a reference at this point so far, the floor for a per-row float32 scalar, and the
    # judge's threshold max(gain_z(gain_n) * gain_se, gain_z_cols(gain_groups) * gain_se_cols, k * ref_gain,
    # gain_floor) (gain_se_cols: the standard error from gain_groups column groups, for errors a column shares
    # down its rows); NaN: not measured (the
    # propagated pass, integer points, under 32 qualifying elements) or not judged
    gain: float = NAN
    gain_se: float = NAN
    gain_n: float = NAN
    gain_se_cols: float = NAN
    gain_groups: float = NAN
    ref_gain: float = NAN
    gain_floor: float = NAN
    gain_threshold: float = NAN
    # the ulp floor (tpcheck.measure.metrics.ulp_floor): 2u max|g| / |g| of the golden at the run's dtype, what one
    # ulp at its largest element adds to rel_err where few elements hold the tensor's norm, added to the
    # threshold (NaN: a result made before it, or not floating)
    rel_floor: float = NAN
    cosine: float = NAN
    max_abs: float = NAN
    max_abs_index: list | None = None  # (batch, token, feature) of max_abs
    mean_abs: float = NAN
    p99_abs: float = NAN
    ref_norm: float = NAN
    nan: int = 0                   # NaN / Inf elements in the engine's tensor
    inf: int = 0
    op_mismatch: float = NAN       # --exact-ops: fraction of elements that differ from HF's op
    # replicas (Replicate points, KV-head replicas): the largest ||rank r - first replica|| / ||first replica||, a
    # figure (a rank-dependent reduction order rounds legitimately); NaN: no replicas. Each replica that differs is
    # judged against the golden as the first one is: ``replica_rel_err`` the largest of their rel_err (the same
    # units; NaN: none differs, and in a result made before it was measured: then the spread is judged against the
    # threshold), ``replica_own_err`` the largest of their own_err
    rank_spread: float = NAN
    rank_spread_by: str = ""       # the ranks of that largest spread, e.g. "0 vs 2"
    replica_rel_err: float = NAN
    replica_own_err: float = NAN
    # mixture of experts (tpcheck.judge.routing): moe.topk_ids' tokens whose expert set differs from the golden's,
    # and how many of those are near ties; a routed point's rows left out for a legitimately different route
    route_flips: float = NAN
    near_ties: float = NAN
    rows_excluded: float = NAN
    # the point's op recomputed in float64 on the engine's own inputs (tpcheck.measure.own_input): its error beyond
    # a correct kernel's rounding, relative to the golden, and the gain of the engine's tensor against that op's
    # result (the scale the op itself added); NaN where not computed. ``inherited``: the row passed because those
    # are within its thresholds and the op's inputs passed (its excess came in through its inputs)
    own_err: float = NAN
    own_gain: float = NAN
    inherited: bool = False
    # the gain within its bound only by the declared rounding's allowance (meta.rounding: a truncating engine's
    # negative gain, tpcheck.judge.verdict)
    by_rounding: bool = False
    passed: bool = False
    note: str = ""                 # a structural finding (shapes, ranks holding other shapes, exact ops): always fails
    stage: int | None = None       # --pp: the pipeline stage whose ranks reported the point (None: one stage)
    order: int = 0                 # execution order within (mode, step); not saved


COLUMNS = [f.name for f in fields(Row)]
_FIELD_DEFAULTS = {f.name: f.default for f in fields(Row) if f.default is not MISSING}  # a dict row's gaps


def worst_key(table: pd.DataFrame) -> pd.Series:
    """The one ordering of "worst point": ``excess``, a NaN (never a pass: an engine NaN) counting as infinite."""
    return table["excess"].astype(float).fillna(math.inf)
FLOAT_COLUMNS = [f.name for f in fields(Row) if f.type == "float"]
INT_COLUMNS = ("layer", "step", "nan", "inf", "stage")


@dataclass
class DiffResult:
    table: pd.DataFrame
    meta: dict

    @classmethod
    def from_rows(cls, rows: list[Row] | list[dict], meta: dict, *, stamp: bool = True) -> "DiffResult":
        """The result of ``rows`` (``Row``s, or dicts of ``COLUMNS`` read back from a file). ``stamp``: add
        ``run_meta()``'s keys to ``meta`` where it has none (a new result: this process made it, now); False for a
        result read back from a file, whose meta says where and when it was made."""
        df = pd.DataFrame([asdict(r) if isinstance(r, Row) else {**_FIELD_DEFAULTS, **r} for r in rows],
                          columns=COLUMNS)
        df = df.sort_values(["mode", "step", "order"], kind="stable").reset_index(drop=True)
        return cls(df, {**run_meta(), **meta} if stamp else dict(meta))

    @property
    def passed(self) -> bool:
        """Every point within its threshold, and coverage met (``tpcheck.judge.coverage``): a run that compared
        nothing, or lacks a required point, does not pass."""
        return bool(len(self.table)) and bool(self.table["passed"].all()) and not self.coverage_problem \
            and not self.meta.get("overflow")

    @property
    def coverage_problem(self) -> str:
        return (self.meta.get("coverage") or {}).get("problem", "")

    def worst(self, mode: str | None = None) -> pd.Series | None:
        """The point closest to (or furthest over) its threshold: the largest ``excess`` (``worst_key``), first in
        table order on a tie; within ``mode`` when given; None for an empty table."""
        t = self.table if mode is None else self.table[self.table["mode"] == mode]
        return None if t.empty else t.loc[worst_key(t).idxmax()]

    def _failing(self, mode: str = "propagated") -> pd.DataFrame:
        t = self.table
        return t[(t["mode"] == mode) & ~t["passed"]]

    @property
    def first_divergence(self) -> dict | None:
        """The first failing point in execution order (earliest step first), over both passes: the origin. Where
        a point fails in both the propagated and the local pass, the row with the larger excess (the local one,
        for a bug deep in the model: its floor did not grow with depth)."""
        t = self.table
        bad = t[~t["passed"]]
        if bad.empty:
            return None
        first = bad[["step", "order"]].apply(tuple, axis=1)
        at = bad[first == min(first)]
        r = at.loc[worst_key(at).idxmax()]
        return {"point": r.point, "layer": None if pd.isna(r.layer) else int(r.layer), "step": int(r.step),
                "mode": r["mode"], "rel_err": float(r.rel_err), "ref_rel_err": float(r.ref_rel_err),
                "ref_by": r.ref_by if isinstance(r.ref_by, str) else "",
                "threshold": float(r.threshold), "excess": float(r.excess), "gain": float(r.gain),
                "gain_threshold": float(r.gain_threshold), "max_abs": float(r.max_abs),
                "max_abs_index": r.max_abs_index, "rank_spread": float(r.rank_spread),
                "rank_spread_by": r.rank_spread_by if isinstance(r.rank_spread_by, str) else "",
                "replica_rel_err": float(r.replica_rel_err), "note": r.note}

    def layer_table(self, mode: str = "propagated") -> pd.DataFrame:
        """The worst point (largest excess over its threshold) of each (step, layer), the embedding and the head
        (final norm, logits) apart from the layers; and the origin's row always, marked in an ``origin`` column
        (the origin is the first failing point, which need not be its layer's worst)."""
        t = self.table[self.table["mode"] == mode].copy()
        t["layer_key"] = t["layer"].fillna(-1).where(t["point"] != "embed", -2)
        t["excess_key"] = worst_key(t)
        idx = list(t.groupby(["step", "layer_key"], sort=False)["excess_key"].idxmax())
        cols = ["step", "layer", "point", "rel_err", "ref_rel_err", "ref_by", "excess", "gain", "max_abs", "passed",
                "note"]
        fd = self.first_divergence
        hit = t.index[(t["point"] == fd["point"]) & (t["step"] == fd["step"])] if fd and fd["mode"] == mode else []
        if len(hit) == 0:
            return t.loc[idx].sort_values(["step", "order"])[cols]
        w = t.loc[sorted(set(idx) | {hit[0]})].sort_values(["step", "order"])
        return w[cols].assign(origin=["<- origin" if i == hit[0] else "" for i in w.index])

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

    def summary(self, brief: bool = False) -> str:
        """The verdict in words: the head line, then a failing run's origin (``origin_lines``) and isolate line, or
        a passing run's closest point; the closing lines (``after_verdict``) and coverage. ``brief``: a failing
        run's head and origin alone (what the command line prints again last, after the tables)."""
        if brief and self.first_divergence is not None:
            return self._verdict(brief=True)
        cov = self.meta.get("coverage") or {}
        missing = cov.get("not_reported") or []
        tail = "" if not missing else (f"\nnot reported by the engine ({len(missing)}): {', '.join(missing[:12])}"
                                       f"{' ...' if len(missing) > 12 else ''}")
        partial = cov.get("rows_not_produced") or {}
        if partial:  # compared on the rows the engine produced, never dropped silently
            tail += "\nrows not produced by the engine (compared on the rest): " + \
                ", ".join(f"{n}: {k}" for n, k in partial.items())
        if self.coverage_problem:
            tail += f"\ncoverage: {self.coverage_problem}"
        return self._verdict() + tail

    def _verdict(self, brief: bool = False) -> str:
        fd = self.first_divergence
        m = self.meta
        pp = f" pp={m['pp']}" if m.get("pp", 1) > 1 else ""
        head = f"{'PASS' if self.passed else 'FAIL'}: tp={m.get('tp', '?')}{pp} {m['dtype']}, {len(self.table)} comparisons"
        over = m.get("overflow")
        if fd is None and over:
            return (f"OVERFLOW: tp={m.get('tp', '?')}{pp} {m['dtype']}: {m['dtype']} cannot hold this model's "
                    f"activations: from {over['point']} (step {over['step']}, {over['mode']}) Hugging Face at "
                    f"{m['dtype']} is not finite either, so {over['rows']} rows were not judged (no finding about the "
                    f"engine); every judged point within the noise floor. Run it in another dtype")
        if fd is None:
            worst = self.worst()
            tail = "" if worst is None else (f"; closest to its threshold: {worst.point} (step {worst.step}) at "
                                             f"{worst.excess:.2f}x" + closest_part(worst))
            ops = ""
            if m.get("exact_ops") and "op_mismatch" in self.table:
                n_ops = int(self.table["op_mismatch"].notna().sum())
                ops = f" and all {n_ops} checked ops (norms, residual adds) bit-identical to HF's"
            n_inh = int(self.table["inherited"].sum()) if "inherited" in self.table else 0
            inh = "" if not n_inh or m.get("allowances") else (
                f" ({n_inh} as inherited: over the floor only through their inputs, their own op within it on the "
                "engine's inputs)")  # a result judged before the allowances were counted
            return head + ", every point within the noise floor" + inh + ops + tail + after_verdict(self.table, m)
        lines = [head, *origin_lines(fd, m["dtype"], rounding_allowance(m))]
        if brief:
            return "\n".join(lines)
        if m.get("isolate"):
            lines.append(isolate_line(self.growth(), fd["mode"]))
        return "\n".join(lines) + after_verdict(self.table, m)

    @classmethod
    def from_json(cls, path: str | Path) -> "DiffResult":
        """Read what ``to_json`` wrote (``load_result``)."""
        return load_result(path)

    def to_document(self) -> dict:
        """The ``kind: "diff"`` JSON document (strict: see the module's null rule). Keys ``run_meta()`` adds that
        ``meta`` lacks (a result built without ``from_rows``) are those of this process, now."""
        rows = self.table.drop(columns=["order"]).to_dict(orient="records")
        for r in rows:  # integer columns that pandas holds as floats beside NaN (layer: NaN outside the layers)
            for c in INT_COLUMNS:
                v = r.get(c)
                if isinstance(v, float) and v.is_integer():
                    r[c] = int(v)
        return document("diff", {"passed": self.passed, "first_divergence": self.first_divergence, "rows": rows},
                        meta=self.meta)

    def to_json(self, path: str | Path) -> None:
        """Write ``to_document()``: full float64 precision, non-finite values as null, ``allow_nan=False``."""
        write_document(path, self.to_document())

    def to_csv(self, path: str | Path) -> None:
        write_atomic(path, lambda p: self.table.drop(columns=["order"]).to_csv(p, index=False))


# ---------------------------------------------------------------------------------------- reading back

class ResultFormatError(ValueError):
    """A saved result that is unreadable or malformed."""


_REQUIRED = ("point", "step", "mode", "rel_err", "ref_rel_err")
_DEFAULTS = {f.name: f.default for f in fields(Row) if f.name not in _REQUIRED}
_DEFAULTS["passed"] = True  # a version-0 row without a verdict: the judge decides again


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
    _check_meta(meta, source)
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
        for c in FLOAT_COLUMNS:
            if c in r and not _num(r[c]):
                raise ResultFormatError(f"{source}: rows[{i}].{c} must be a number or null, got {r[c]!r}")
        for c in ("passed", "inherited", "by_rounding"):
            if c in r and not isinstance(r[c], bool):
                raise ResultFormatError(f"{source}: rows[{i}].{c} must be true or false, got {r[c]!r}")
        _check_row_fields(r, f"{source}: rows[{i}]")
        layer, kind = split_point(r["point"])
        if layer is not None and layer >= MAX_LAYERS:
            raise ResultFormatError(f"{source}: rows[{i}].point {r['point']!r}: layer beyond {MAX_LAYERS}")
        row = {**_DEFAULTS, "layer": layer, "kind": kind, **{k: v for k, v in r.items() if k in COLUMNS}}
        for c in FLOAT_COLUMNS:  # JSON null: NaN or inf that pandas wrote as null
            if row[c] is None:
                row[c] = math.nan
        row["note"] = row["note"] or ""
        row["rank_spread_by"] = row["rank_spread_by"] if isinstance(row["rank_spread_by"], str) else ""
        row["order"] = point_order(r["point"])  # execution order, comparable across the two passes
        out.append(row)
    return DiffResult.from_rows(out, meta, stamp=False)  # meta says where and when the result was made


def _check_meta(meta: dict, source: str) -> None:
    """The meta fields the verdict and the report read: typed and bounded (no hostile number reaches a range)."""
    cov = meta.get("coverage")
    if cov is not None and not (isinstance(cov, dict) and isinstance(cov.get("problem") or "", str)):
        raise ResultFormatError(f"{source}: meta.coverage must be an object (with a string 'problem'), got "
                                f"{str(cov)[:60]!r}")
    n = meta.get("num_layers")
    if n is not None:
        int_in(n, 0, MAX_LAYERS, f"{source}: meta.num_layers", ResultFormatError)


def _check_row_fields(r: dict, where: str) -> None:
    for c in ("nan", "inf"):
        if c in r and r[c] is not None:
            int_in(r[c], 0, 2**63, f"{where}.{c}", ResultFormatError)
    # null, or NaN in a result written before JSON was strict: no value
    for c in ("note", "ref_by", "kind", "rank_spread_by"):
        v = r.get(c)
        if v is not None and not isinstance(v, str) and not (isinstance(v, float) and math.isnan(v)):
            raise ResultFormatError(f"{where}.{c} must be a string, got {str(r[c])[:60]!r}")
    idx = r.get("max_abs_index")
    if idx is not None and not (isinstance(idx, list) and len(idx) <= 8 and all(isinstance(x, int) for x in idx)):
        raise ResultFormatError(f"{where}.max_abs_index must be a short list of integers or null")


def _tpcheck_version() -> str:
    return package_version("tpcheck") or "unknown"


def load_result(path: str | Path) -> DiffResult:
    """Read a result written by ``DiffResult.to_json`` (``tpcheck diff --json``)."""
    try:
        data = read_json(path, ResultFormatError, "result")  # strict: UTF-8, depth and integer size bounded
    except ResultFormatError as e:
        # results written before documents were versioned (no schema_version) let NaN through: those still read
        if "NaN" not in str(e) and "Infinity" not in str(e):
            raise
        data = read_json(path, ResultFormatError, "result", allow_nan=True)
        if not isinstance(data, dict) or "schema_version" in data:
            raise e from None
    return result_from_dict(data, str(path))
