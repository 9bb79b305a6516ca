"""Two dumps compared with each other, no golden: ``tpcheck compare BASELINE TARGET`` (SGLang's own comparison, with
tpcheck's unsharding and report).

Each side is read as ``tpcheck compare`` reads one dump (SGLang's dumper files, its older Pass files, or tpcheck's
own) but without a checkpoint, so SGLang dumps are compared by *dumped name*, not canonical point: each name's
files unsharded by their dims (or their rule's: ``rules.toml``), the tp placement undone by tpcheck's
``unshard``. A fused output (a rule with ``parts``: ``qkv_proj``, ``gate_up_proj``) is compared only where both
sides ran the same tp (its parts' widths need the model's config: with ``--model`` each side is judged instead).
The two runs must have run the same batches (each step's requests, tokens and positions), else exit 2.

The measure, per step and name, in float64: ``rel_diff = ||target - baseline|| / ||baseline||``, and SGLang's
``1 - 2<x,y>/(<x,x>+<y,y>)`` beside it. The floor: **both sides' unit roundoff**, ``u_a + u_b`` (2^-24 float32,
2^-8 bfloat16, 2^-11 float16): the most that rounding one exact value into each side's dtype can move it,
elementwise and so in norm. Below it the two hold the same values up to that rounding; above it they *computed*
differently. Without a golden that is all that can be said: another tp, kernel or reduction order legitimately
parts above it (an error that grows through the layers), and which side is right only a golden decides
(``--model``). The report names the first point, in execution order, where they part, and the verdict is exit 1
when any point does (0: every point within both sides' rounding)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from impl.placements import Shard
from tpcheck.engines.dump.replay import read_dump
from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.sglang_dump import passes, rules as name_rules, sniff_format
from tpcheck.engines.sglang_dump.batches import AUX_NAMES
from tpcheck.engines.sglang_dump.files import scan
from tpcheck.engines.sglang_dump.reader import NameReport, _dtype, assemble_files, dump_root, read_batches
from tpcheck.inputs.models.checkpoints import DTYPES
from tpcheck.measure.metrics import unit_roundoff
from tpcheck.measure.unshard import unshard
from tpcheck.measure.wording import shape_text

_NO_LAYERS = 10 ** 9  # no checkpoint: any layer index is accepted (the rules give dims here, not points)


def _u(dtype: str) -> float:
    """A dump's unit roundoff by its dtype's name (``tpcheck.measure.metrics.unit_roundoff``)."""
    return unit_roundoff(DTYPES[dtype])


@dataclass
class Side:
    """One dump as named tensors: ``steps[s]`` ``{name: (placement, [tp rank tensors])}`` loaders in execution
    order, ``batches[s]`` the step's ``(request tokens, starts)``, ``fused`` the names a fused rule covers."""

    root: Path
    tp: int
    dtype: str
    batches: list[tuple[list[list[int]], list[int]]]
    steps: list[dict] = field(default_factory=list)
    fused: set[str] = field(default_factory=set)
    names: NameReport = field(default_factory=NameReport)


def read_side(root: str | Path, rule_files=(), allow_unmapped: bool = False) -> Side:
    """A dump of any format read without a checkpoint (see the module doc)."""
    fmt = sniff_format(root)
    if fmt == "tpcheck":
        d = read_dump(root)
        return Side(Path(root), d.tp, d.dtype, [(b.tokens, b.starts) for b in d.batches],
                    [_lazy(d.points, s) for s in range(len(d.batches))])
    layout_rules = [passes.RULES] if fmt == "sglang-passes" else []
    # no checkpoint, no model_type: the rules for some models only come after the rest (``for_run``)
    rules = name_rules.for_run(name_rules.load_rules([Path(p) for p in rule_files] + layout_rules), None, None)
    root = Path(root) if fmt == "sglang-passes" else dump_root(Path(root))
    files = passes.scan(root) if fmt == "sglang-passes" else scan(root)
    aux, by_step, report, fused = {}, {}, NameReport(), set()
    for f in sorted(files, key=lambda f: (f.step, f.dump_index, f.rank)):
        if f.name in AUX_NAMES:
            aux.setdefault(f.step, {}).setdefault(f.name, []).append(f)
            continue
        m = name_rules.match(rules, f.name, f.tags.get("layer_id"), _NO_LAYERS, str(f.path))
        if m is None:
            report.unmapped.setdefault(f.name, str(f.path))
        elif not m.rule.point:
            report.ignored.setdefault(f.name, m.rule.source)
        else:
            report.mapped.setdefault(f.name, f.name)
            by_step.setdefault(f.step, {}).setdefault(f.name, ([], m.rule))[0].append(f)
            if m.rule.parts:
                fused.add(f.name)
    if report.unmapped and not allow_unmapped:
        names = sorted(report.unmapped)
        raise DumpError(f"{report.unmapped[names[0]]}: {len(names)} dumped name(s) no rule knows: {names[:8]}; add "
                        "a rule (--name-rules FILE.toml) or pass --allow-unmapped to compare the rest")
    tp, _, steps, step_batches = read_batches(root, files, aux)
    dtype = _dtype([{n: fs for n, (fs, _) in by_step.get(s, {}).items()} for s in steps])
    return Side(root, tp, dtype, [(b.tokens, b.starts) for b in step_batches],
                [{n: (lambda fs=fs, r=r, n=n: _assembled(n, fs, r)) for n, (fs, r) in by_step.get(s, {}).items()}
                 for s in steps], fused, report)


def _lazy(points, step: int) -> dict:
    """tpcheck's own dump's points of a step, loaded once, as loaders."""
    cache: dict = {}
    load = lambda: cache.setdefault("p", points(step))  # noqa: E731
    return {n: (lambda n=n: load()[n]) for n in sorted(points(step))}


def _assembled(name: str, files, rule):
    return assemble_files(files, rule)[:2]


@dataclass(frozen=True)
class PairRow:
    step: int
    name: str
    rel_diff: float
    sglang_rel_diff: float
    floor: float
    note: str = ""

    @property
    def excess(self) -> float:
        return self.rel_diff / self.floor

    @property
    def parted(self) -> bool:
        return self.note == "" and not self.excess <= 1  # NaN parts


def compare_sides(a: Side, b: Side) -> list[PairRow]:
    """Every (step, name) both dumps hold, in execution order; a step whose batches differ is a DumpError."""
    if len(a.batches) != len(b.batches):
        raise DumpError(f"{b.root}: {len(b.batches)} steps, {a.root} {len(a.batches)}: two runs of one schedule are "
                        "compared step by step")
    for s, (x, y) in enumerate(zip(a.batches, b.batches)):
        if x != y:
            raise DumpError(f"{b.root}: step {s} ran other requests or tokens than {a.root}'s (two runs of one "
                            "schedule are compared; for other schedules judge each against the golden: --model)")
    floor = _u(a.dtype) + _u(b.dtype)
    rows = []
    for s, (pa, pb) in enumerate(zip(a.steps, b.steps)):
        for name in [n for n in pa if n not in pb] + [n for n in pb if n not in pa]:
            rows.append(PairRow(s, name, math.nan, math.nan, floor, f"only in the {'target' if name in pb else 'baseline'}"))
        for name in [n for n in pa if n in pb]:
            if name in a.fused and a.tp != b.tp:
                rows.append(PairRow(s, name, math.nan, math.nan, floor, f"fused, tp {a.tp} vs {b.tp}: needs --model"))
                continue
            x, y = (_whole(name, *p[name]()) for p in (pa, pb))
            if x.shape != y.shape:
                rows.append(PairRow(s, name, math.inf, math.nan, floor, f"shapes {shape_text(x.shape)} vs {shape_text(y.shape)}"))
                continue
            rows.append(PairRow(s, name, *_measures(y, x), floor))
    if all(r.note for r in rows):
        raise DumpError(f"{b.root}: no point or name in common with {a.root} (dumps of one format are compared)")
    return rows


def _whole(name: str, placement, tensors) -> torch.Tensor:
    if isinstance(placement, Shard) and placement.replicas > 1:
        placement = Shard(placement.dim)  # replicas compare whole on both sides only when tp agrees
    return unshard(name, placement, list(tensors))[0].tensor


def _measures(t: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """(``||t - base|| / ||base||``, SGLang's ``1 - 2<t,base>/(<t,t>+<base,base>)``), in float64."""
    x, y = t.detach().to(torch.float64).flatten(), base.detach().to(torch.float64).flatten()
    if torch.equal(x, y):
        return 0.0, 0.0
    d, n = float((x - y).norm()), float(y.norm())
    denom = float(x @ x + y @ y)
    return (d / n if n > 0 else math.inf), (1 - 2 * float(x @ y) / denom if denom > 0 else 0.0)


def report(rows: list[PairRow], a: Side, b: Side) -> tuple[str, int]:
    """(the report, the exit code: 1 when the dumps part anywhere, else 0)."""
    dtype_a, dtype_b = a.dtype, b.dtype
    floor = _u(dtype_a) + _u(dtype_b)
    lines = [f"baseline:   {a.root} (tp={a.tp} {dtype_a})", f"target:     {b.root} (tp={b.tp} {dtype_b})",
             f"no golden:  each point against the baseline; floor {floor:.3g} = both sides' unit roundoff "
             f"({dtype_a} {_u(dtype_a):.3g} + {dtype_b} {_u(dtype_b):.3g}): below it the "
             "same values up to rounding; above it computed differently (right or wrong: --model judges each "
             "against the golden)", "",
             f"{'step':>4}  {'name':<64} {'rel_diff':>9} {'sglang':>9} {'excess':>9}"]
    for r in rows:
        lines.append(f"{r.step:>4}  {r.name[-64:]:<64} {r.rel_diff:>9.3g} {r.sglang_rel_diff:>9.3g} "
                     f"{r.excess:>9.3g}" + ("  PARTS" if r.parted else "") + (f"  ({r.note})" if r.note else ""))
    first = next((r for r in rows if r.parted), None)
    same = sum(r.rel_diff == 0 for r in rows)
    compared = sum(not r.note for r in rows)
    if first is None:
        lines += ["", f"SAME: {compared} points compared, {same} bit-identical, every one within both sides' "
                  "rounding" + (f"; {len(rows) - compared} not compared (noted)" if compared < len(rows) else "")]
        return "\n".join(lines), 0
    lines += ["", f"PART: first at step {first.step}, {first.name}: rel_diff {first.rel_diff:.3g} = "
              f"{first.excess:.3g}x the floor (SGLang's rel_diff {first.sglang_rel_diff:.3g}); "
              f"{sum(r.parted for r in rows)} of {compared} points part"]
    return "\n".join(lines), 1
