"""The result of ``tpcheck invariance``: two captures of one probe request (``Capture``: ``{(step, point):
[rows, features]}`` in the engine's dtype) compared point by point, bit for bit (``tpcheck.measure.bitwise``), the
first point where they part named (step, layer, point, token, element) with its size in ulps of the point's dtype,
and how the difference grows after it; every schedule against the reference one, and the verdict when an
invariance was declared (``ulps``: 0 bitwise, N a budget in ulps; None declares nothing: the run reports, exit 0).

Order: a capture's points are compared step by step, each step's in execution order (``point_order``), so the
first row that differs is where the bits part first."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tpcheck.capture.points import kind_of, point_order, split_point
from tpcheck.measure.bitwise import TensorDiff, compare_tensors
from tpcheck.result.documents import write_json

Capture = dict[tuple[int, str], torch.Tensor]
Positions = dict[tuple[int, str], list[int]]  # the probe position of each row of a capture's point, where known


@dataclass(frozen=True)
class PointRow:
    """One point at one step of the probe, schedule ``schedule`` against the reference. ``token``: the probe's
    position of the first differing element (its row: the step's first position plus the row; the cache points'
    rows are positions), ``element``: its column; ``frac``: differing elements / elements."""

    schedule: str
    step: int
    point: str
    layer: int | None
    max_ulps: float
    differing: int
    numel: int
    token: int | None
    element: int | None
    max_abs: float
    note: str = ""

    @property
    def frac(self) -> float:
        return self.differing / self.numel if self.numel else 0.0

    @property
    def identical(self) -> bool:
        return self.differing == 0 and not self.note

    def within(self, ulps: float) -> bool:
        return self.identical if ulps == 0 else (not self.note and self.max_ulps <= ulps)

    def where(self) -> str:
        """``step 0, layers.0.attn.q, token 3, element 17``."""
        at = f", token {self.token}, element {self.element}" if self.token is not None else ""
        return f"step {self.step}, {self.point}{at}"


def first_position(step: int, point: str, prompt_len: int, rows: int) -> int:
    """The probe position of row 0 of ``point``'s ``rows`` rows at ``step``: 0 for the cache points (every cached
    position); for token rows, which end at the step's last position (``prompt_len - 1`` for the prefill,
    ``prompt_len + step - 1`` for decode step ``step``), that position less ``rows - 1``."""
    if kind_of(point).rows == "cache":
        return 0
    return (prompt_len if step == 0 else prompt_len + step) - rows


def _aligned(point: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` on the positions both computed: a prefix-cache hit's prefill computes only the positions
    after its cached blocks, so its token rows are the last of the other side's (cache points are left whole)."""
    if kind_of(point).rows == "cache" or a.shape[1:] != b.shape[1:] or a.shape[0] == b.shape[0]:
        return a, b
    n = min(a.shape[0], b.shape[0])
    return a[a.shape[0] - n:], b[b.shape[0] - n:]


def compare_captures(ref: Capture, other: Capture, schedule: str, prompt_len: int,
                     positions: Positions | None = None) -> list[PointRow]:
    """Every ``(step, point)`` of either capture, in execution order, ``other`` against ``ref`` on the positions both
    computed (``_aligned``); a point one of them lacks is a row with a note (and infinite ulps). ``positions``:
    the position of each row where the rows are not the step's last ones (two dumps' common positions); else
    ``first_position``."""
    rows = []
    for step, point in sorted(set(ref) | set(other), key=lambda k: (k[0], point_order(k[1]), k[1])):
        a, b = ref.get((step, point)), other.get((step, point))
        layer = split_point(point)[0]
        if a is None or b is None:
            missing = "the reference" if a is None else schedule
            rows.append(PointRow(schedule, step, point, layer, math.inf, 0, 0, None, None, math.nan,
                                 f"{missing} did not capture it"))
            continue
        a, b = _aligned(point, a, b)
        d: TensorDiff = compare_tensors(a, b)
        at = (positions or {}).get((step, point))
        token = None if d.first is None else at[d.first[0]] if at is not None else \
            first_position(step, point, prompt_len, a.shape[0]) + d.first[0]
        rows.append(PointRow(schedule, step, point, layer, d.max_ulps, d.differing, d.numel, token,
                             None if d.first is None else d.first[1], d.max_abs, d.structural))
    return rows


def growth(rows: list[PointRow]) -> list[dict]:
    """How a difference grows from its first point on: per step and stage of the model (``embed``, each decoder
    layer, ``head``: the final norm and the logits), the largest ulps, the largest differing fraction and the point
    that has it."""
    start = next((i for i, r in enumerate(rows) if not r.identical), None)
    if start is None:
        return []
    groups: dict[tuple[int, str], list[PointRow]] = {}
    for r in rows[start:]:
        where = str(r.layer) if r.layer is not None else ("embed" if r.point == "embed" else "head")
        groups.setdefault((r.step, where), []).append(r)
    out = []
    for (step, where), rs in groups.items():
        worst = max(rs, key=lambda r: (r.frac, r.max_ulps))
        out.append({"step": step, "layer": where, "max_ulps": max(r.max_ulps for r in rs), "frac": worst.frac,
                    "point": worst.point})
    return out


@dataclass
class InvarianceResult:
    """Every schedule against the reference (``schedules[0]``). ``ulps``: the declared invariance (0 bitwise, N
    a budget; None: nothing declared, the run reports only); ``meta``: what ran (model, dtype, probe, mode)."""

    schedules: list[str]
    described: list[str]
    rows: list[PointRow]
    ulps: float | None = None
    meta: dict = field(default_factory=dict)

    def of(self, schedule: str) -> list[PointRow]:
        return [r for r in self.rows if r.schedule == schedule]

    def first_break(self, schedule: str, ulps: float = 0) -> PointRow | None:
        """The first point of ``schedule`` past ``ulps`` (0: the first that is not bit-identical)."""
        return next((r for r in self.of(schedule) if not r.within(ulps)), None)

    @property
    def passed(self) -> bool:
        """The declared invariance holds for every schedule (True when none is declared)."""
        return self.ulps is None or all(self.first_break(s, self.ulps) is None for s in self.schedules[1:])

    def summary(self) -> str:
        """One block per schedule: identical, or its first differing point with its ulps and the growth after."""
        ref = self.schedules[0]
        lines = [f"reference: {self.described[0]}"]
        for s, desc in zip(self.schedules[1:], self.described[1:]):
            first = self.first_break(s)
            if first is None:
                lines.append(f"{s}: BITWISE IDENTICAL to {ref} at every point ({len(self.of(s))} compared); {desc}")
                continue
            lines.append(f"{s}: first differs from {ref} at {first.where()}: {_ulps(first)}, {first.differing} of "
                         f"{first.numel} elements ({first.frac:.1%}), max |diff| {first.max_abs:.3g}"
                         + (f" ({first.note})" if first.note else "") + f"; {desc}")
            for g in growth(self.of(s)):
                lines.append(f"    step {g['step']:>3} layer {g['layer']:>3}: max {_fmt_ulps(g['max_ulps'])} ulps, "
                             f"{g['frac']:.1%} of {g['point']} differ")
        if self.ulps is not None:
            want = "bitwise" if self.ulps == 0 else f"within {self.ulps:g} ulps"
            broken = [f"{s} at {r.where()}" for s in self.schedules[1:] if (r := self.first_break(s, self.ulps))]
            lines.append(f"{'PASS' if self.passed else 'FAIL'}: {want} invariance required"
                         + (f"; broken by {'; '.join(broken)}" if broken else " and held"))
        return "\n".join(lines)

    def to_json(self, path: str | Path, command: str | None = None) -> Path:
        """The ``invariance`` document: verdict, each schedule's first break and growth, every row."""
        comps = []
        for s, desc in zip(self.schedules[1:], self.described[1:]):
            first = self.first_break(s)
            comps.append({"schedule": s, "described": desc, "identical": first is None,
                          "first": None if first is None else asdict(first), "growth": growth(self.of(s))})
        body = {"passed": self.passed, "require_ulps": self.ulps, "reference": self.schedules[0],
                "reference_described": self.described[0], "comparisons": comps,
                "rows": [asdict(r) for r in self.rows]}
        return write_json(path, "invariance", body, meta=self.meta, command=command)


def _fmt_ulps(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.0f}"


def _ulps(r: PointRow) -> str:
    return f"{_fmt_ulps(r.max_ulps)} ulp(s) max" + ("" if r.max_ulps else " (+0 vs -0)")
