"""``DiffResult``: the per-point table of a diff, its verdict, where the divergence began, and how it grew."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from tpcheck.metrics import FLOOR, K_FACTOR


@dataclass
class Tolerances:
    """Gate ``rel_err <= k * ref_rel_err + floor``; ``k`` and ``floor`` default per dtype
    (``tpcheck.metrics``) and can be overridden per point kind (``"attn.q"``, ``"logits"``, ...)."""

    k: dict[str, float] = field(default_factory=dict)
    floor: dict[str, float] = field(default_factory=dict)

    def threshold(self, kind: str, dtype: str, ref_err: float) -> float:
        k = self.k.get(kind, K_FACTOR[dtype])
        floor = self.floor.get(kind, FLOOR[dtype])
        return k * ref_err + floor if math.isfinite(ref_err) else floor


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
    def from_rows(cls, rows: list[dict], meta: dict) -> "DiffResult":
        df = pd.DataFrame(rows, columns=COLUMNS)
        df = df.sort_values(["mode", "step", "order"], kind="stable").reset_index(drop=True)
        return cls(df, meta)

    @property
    def passed(self) -> bool:
        return bool(self.table["passed"].all())

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

    def to_json(self, path: str | Path) -> None:
        # full float64 precision (pandas' to_json rounds to 10 decimals); non-finite values become null
        rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                for r in self.table.drop(columns=["order"]).to_dict(orient="records")]
        Path(path).write_text(json.dumps({"passed": self.passed, "first_divergence": self.first_divergence,
                                          "meta": self.meta, "rows": rows}, indent=1, default=str))

    def to_csv(self, path: str | Path) -> None:
        self.table.drop(columns=["order"]).to_csv(path, index=False)
