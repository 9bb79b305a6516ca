"""One pass of a diff (propagated, or isolated: teacher-forced) over the prefill and decode steps.

Per step: the golden (HF float64, or a saved golden) runs and its points are kept for that step only; the noise
floor's references (HF at the test dtype, and rounding like the engine's TP all-reduces) are measured against it
(``tpcheck.judge.noise_floor``); then the engine runs and each of its points is unsharded
(``tpcheck.measure.unshard``), measured (``tpcheck.measure.metrics``) and turned into a ``Row``, then dropped.
Decode tokens are the golden's greedy choices (or, replaying a dump, the tokens the engine consumed), so all
runs see the same inputs."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from tpcheck.capture.batches import RequestLog, StepBatch
from tpcheck.capture.points import KINDS, all_point_names, kind_of, point_order, split_point
from tpcheck.judge.coverage import check_known
from tpcheck.judge.noise_floor import NoiseFloor
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure import exact_ops, own_input
from tpcheck.measure.gain import gain_fields
from tpcheck.measure.operands import INPUT_KINDS, LINEAR_INPUTS, operand_sq
from tpcheck.measure.metrics import compare, mismatch
from tpcheck.measure.unshard import unshard
from tpcheck.pipeline.routes import RouteBook, routes_of, sort_routes
from tpcheck.reference.hf import cut_cache, new_cache
from tpcheck.result.table import NAN, Row

logger = logging.getLogger("tpcheck.pipeline.diff")  # progress: tpcheck's CLI shows INFO on stderr


@dataclass
class RunContext:
    """What every pass of one diff shares: the golden and reference captures (``tpcheck.reference``), the engine
    adapter, the prompts, the steps and the model's depth, the noise floor's TP reduction, the selection
    (``select``: a compiled regex, or None for every point), ``--exact-ops``, ``--fail-fast``
    (``stop_when(rows of a step)``), ``--save-golden`` (a ``GoldenWriter``) and a progress bar of steps."""

    golden: object
    ref: object
    engine: object
    prompts: list[list[int]]
    decode_steps: int
    num_layers: int
    dtype: torch.dtype
    reductions: object
    select: re.Pattern | None = None
    exact_ops: bool = False
    stop_when: Callable[[list[Row]], bool] | None = None
    save_golden: object = None
    progress: object = None
    golden_cache: "GoldenCache | None" = None
    sparse: bool = False  # the model has mixture-of-experts layers (tpcheck.pipeline.routes)
    golden_routes: dict | None = None  # step -> the routes the golden followed in the propagated pass
    tolerances: "Tolerances | None" = None  # the run's (None: the defaults); own_err is measured under either


class GoldenCache:
    """The golden's points of every step of the propagated pass, kept for the local (teacher-forced) pass: both
    passes feed the same tokens, so the float64 golden, the costliest forward of a diff, runs once. Held up to
    ``budget`` bytes (float64 points of every step); past that the cache is dropped whole and the local pass
    computes the golden again (its caches need every earlier step)."""

    def __init__(self, budget: int = 2 << 30):
        self.budget, self.nbytes, self.steps = budget, 0, {}
        self.enabled = budget > 0

    def put(self, step: int, gold: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        self.nbytes += sum(t.numel() * t.element_size() for t in gold.values())
        if self.nbytes > self.budget:
            self.enabled, self.steps = False, {}
            logger.info(f"  the golden's points pass {self.budget / 2**30:.1f} GiB: the local pass computes the "
                        "golden again instead of reusing it")
            return
        self.steps[step] = gold

    def holds(self, steps: int) -> bool:
        """Whether every one of ``steps`` steps is held."""
        return self.enabled and all(s in self.steps for s in range(steps))

    def take(self, step: int) -> dict[str, torch.Tensor]:
        return self.steps.pop(step)


def _row_index(flat_row: int, row_lens: list[int], starts: list[int], order: list[int] | None = None) -> tuple[int, int]:
    """(prompt, position) of a row of the prompts' rows concatenated (``order``: the prompt of each group)."""
    for b, n in enumerate(row_lens):
        if flat_row < n:
            return (b if order is None else order[b]), starts[b] + flat_row
        flat_row -= n
    return -1, -1


class DiffPass:
    """One mode (propagated or isolated) over prefill + decode steps; ``run()`` returns its rows.

    A step is a ``tpcheck.capture.batches.StepBatch``: the requests it ran, in row order. A live engine runs the
    prompts as one fixed batch (the prompts, then the golden's greedy token each step); a replayed dump says what
    each step ran (``engine.schedule(step)``: requests that join late, chunked prefill, recomputation after
    preemption). Every request has its own golden and reference caches, cut back when it runs positions again."""

    def __init__(self, ctx: RunContext, isolated: bool):
        self.ctx, self.isolated = ctx, isolated
        self.mode = "isolated" if isolated else "propagated"
        self.floor = NoiseFloor(ctx.reductions, gains=isolated)  # the gain is judged in the local pass alone
        self.routes = RouteBook()
        self.with_kv = ctx.decode_steps > 0
        # every family's points (Qwen3's attn.q_norm / k_norm included), in execution order
        names = all_point_names(ctx.num_layers)
        self.canonical = set(names)
        self.reported: set[str] = set()  # the canonical points the engine reported (coverage)
        self.rows_not_produced: dict[str, int] = {}  # point -> golden rows the engine did not produce (coverage)
        self.stopped_at: int | None = None
        cache = ctx.golden_cache
        self.cache_out = None if isolated else cache        # the propagated pass fills it
        self.cache_in = cache if isolated and cache is not None and cache.holds(ctx.decode_steps + 1) else None

    def run(self) -> list[Row]:
        c = self.ctx
        self.log = RequestLog()
        self.g_caches: dict[str, object] = {}  # request id -> its golden cache (a saved golden has none)
        self.r_caches: dict[str, dict[str, object]] = {name: {} for name, _ in self.floor.references}
        c.engine.begin(c.prompts, c.decode_steps)
        schedule = getattr(c.engine, "schedule", None)
        batch = schedule(0) if schedule is not None else StepBatch.of_prompts(c.prompts)
        rows: list[Row] = []
        for step in range(c.decode_steps + 1):
            t0 = time.monotonic()
            step_rows, nxt = self._step(step, batch)
            rows += step_rows
            # the next inputs: golden greedy tokens, or what a recorded run ran (tpcheck.capture.dump)
            if step < c.decode_steps:
                batch = schedule(step + 1) if schedule is not None else batch.then([[t] for t in nxt])
            what = f"step {step}" if schedule is not None else "prefill" if step == 0 else \
                f"decode {step}/{c.decode_steps}"
            logger.info(f"  [{self.mode}] {what}: {time.monotonic() - t0:.1f}s")
            if c.progress is not None:
                c.progress.update(1)
            if c.stop_when is not None and c.stop_when(step_rows):
                self.stopped_at = step
                logger.info(f"  [{self.mode}] --fail-fast: a point failed at step {step}; the remaining steps are "
                            "not run")
                break
        c.engine.close()
        return rows

    def _caches(self, batch: StepBatch) -> tuple[list, dict[str, list]]:
        """The golden's and each reference's cache of every request of ``batch`` (new for a new request; cut back
        to the position a request runs again from)."""
        c = self.ctx
        cuts = self.log.advance(batch)
        golden = None if c.golden.model is None or self.cache_in is not None else c.golden.model  # reused: no cache
        pools = [(self.g_caches, golden)]
        pools += [(self.r_caches[name], c.ref.model) for name, _ in self.floor.references]
        for rid, cut in zip(batch.ids, cuts):
            for caches, model in pools:
                if model is None:
                    continue
                if rid not in caches or cut == 0:
                    caches[rid] = new_cache(model)
                elif cut is not None:
                    cut_cache(caches[rid], cut)
        g = [self.g_caches.get(rid) for rid in batch.ids]
        return g, {name: [self.r_caches[name][rid] for rid in batch.ids] for name, _ in self.floor.references}

    def _step(self, step: int, batch: StepBatch) -> tuple[list[Row], list[int]]:
        """One step: golden, engine, references (the floor); its rows and the golden's greedy next tokens."""
        c = self.ctx
        tokens = batch.tokens
        g_caches, r_caches = self._caches(batch)
        points = None
        if c.sparse and not self.isolated:  # the engine first: the golden follows its routes (pipeline.routes)
            points = c.engine.step(tokens, None, self.with_kv)
            if c.golden_routes is not None:
                c.golden_routes[step] = _engine_routes(points)
                if step == 0 and c.golden_routes[step] is None:
                    logger.warning("tpcheck diff: note: the engine reports no moe.topk_ids: the golden cannot follow "
                                   "its routes, so a token that legitimately picks other experts (a near tie, "
                                   "bfloat16/float16) shows as an error after its MoE layer")
        gold = self.cache_in.take(step) if self.cache_in is not None else \
            self._golden(step, batch, g_caches, None if c.golden_routes is None else c.golden_routes.get(step))
        if c.sparse:
            gold = sort_routes(gold)
        if self.cache_out is not None:
            self.cache_out.put(step, gold)
        teacher = self._teacher(gold) if self.isolated else None
        eng_teacher = None if teacher is None else {i: t.to(c.dtype) for i, t in teacher.items()}
        if points is None:
            points = c.engine.step(tokens, eng_teacher, self.with_kv)
        subsets = dict(getattr(c.engine, "point_rows", None) or {})  # points that hold only some rows
        self._measure_references(step, batch, r_caches, gold, teacher, subsets)
        rows = self._rows(step, points, gold, batch, eng_teacher, subsets)
        return rows, gold["logits"][batch.last_rows()].argmax(-1).tolist()

    def _golden(self, step: int, batch: StepBatch, g_caches: list, routes=None) -> dict[str, torch.Tensor]:
        """The golden's points of this step (``--save-golden``: written), holding only what is compared, plus the
        logits, the routing points and (with a local pass to come) the teacher inputs. ``routes``: the MoE
        routes it follows where its own differ (``tpcheck.pipeline.routes``)."""
        c = self.ctx
        kw = {} if routes is None else {"routes": routes}
        gold = c.golden.step(batch.tokens, g_caches, batch.starts, None, self.with_kv, **kw)
        if c.save_golden is not None and not self.isolated:
            c.save_golden.write(step, batch.tokens, batch.starts, gold)
        teacher_too = self.isolated or c.golden_cache is not None
        if c.select is not None:
            gold = {n: t for n, t in gold.items() if self._selected(n) or n == "logits" or
                    kind_of(n).route in ("logits", "ids") or (teacher_too and kind_of(n).teacher) or
                    kind_of(n).name in INPUT_KINDS}
        return gold

    def _teacher(self, gold: dict) -> dict[int, torch.Tensor]:
        """Isolate mode: decoder layer i's input is the golden's (``embed`` or layer i-1's ``out``); the final
        norm's (key ``num_layers``) is the last layer's output."""
        L = self.ctx.num_layers
        teacher = {i: gold["embed" if i == 0 else f"layers.{i - 1}.out"] for i in range(L)}
        teacher[L] = gold[f"layers.{L - 1}.out"]
        return teacher

    def _measure_references(self, step, batch: StepBatch, r_caches, gold, teacher, subsets) -> None:
        c = self.ctx
        self.floor.begin_step(step)
        # a replayed golden (--golden) is held to the one-device reference: a wrong golden cannot raise the floor
        check = getattr(c.golden, "check_reference", None) if teacher is None else None
        routes = routes_of(gold) if c.sparse else None  # the references follow the golden's routes
        operands = {n: operand_sq(c.ref.model, n, gold) for n in gold if split_point(n)[1] in LINEAR_INPUTS}
        for ref_name, red in self.floor.references:
            kw = {} if routes is None else {"routes": routes}
            ref = c.ref.step(batch.tokens, r_caches[ref_name], batch.starts, teacher, self.with_kv, red, **kw)
            if c.sparse:
                ref = sort_routes(ref)
            for n, t in ref.items():
                if n in gold and c.sparse:
                    self.routes.observe(n, t, gold[n])
                if kind_of(n).judged == "set":  # ids are judged as sets (tpcheck.judge.routing), not by a floor
                    continue
                if check is not None and red is None and n in gold and self._selected(n):
                    check(n, t, gold[n], c.dtype)
                if n in gold and t.shape == gold[n].shape and self._selected(n):
                    rows, sq = _subset(n, subsets), operands.get(n)
                    sq = None if sq is None else float(sq.sum() if rows is None else sq[rows].sum())
                    self.floor.observe(ref_name, n, *((t, gold[n]) if rows is None else (t[rows], gold[n][rows])), sq)
            del ref
        self.floor.end_step()

    def _rows(self, step, points, gold, batch: StepBatch, eng_teacher, subsets) -> list[Row]:
        """Each reported point, unsharded and measured against the golden (``--exact-ops``: its op checked too);
        a point with only some of the step's rows (``subsets``) against those rows of the golden."""
        row_lens, kv_lens, starts = batch.row_lens, batch.kv_lens, batch.starts
        order = [self.log.order[rid] for rid in batch.ids]
        held: dict[str, torch.Tensor] = {}  # --exact-ops: the engine tensors the checked ops read
        layer_input = (lambda i, t=eng_teacher: t[i]) if eng_teacher is not None else \
            (lambda i, h=held: h["embed" if i == 0 else f"layers.{i - 1}.out"])
        rows: list[Row] = []
        units = []
        for name, (placement, per_rank) in points.items():
            parts = unshard(name, placement, per_rank)
            check_known({u.name for u in parts}, self.canonical)
            units += [(u, subsets.get(name)) for u in parts]
        if self.ctx.sparse:
            units = self._routes(units, gold)
        engine_of = {u.name: u.tensor for u, sub in units if sub is None}  # the op inputs own_input reads
        for u, subset in units:
            if u.name not in gold or not self._selected(u.name):
                continue
            if kind_of(u.name).judged == "set":
                rows.append(self._route_row(u, gold[u.name], step, row_lens, starts, order))
                self.reported.add(u.name)
                continue
            excluded = self.routes.excluded(u.name, self.isolated)
            if excluded:  # a token whose route legitimately differs: its rows are left out, and counted
                if self.ctx.exact_ops and split_point(u.name)[1] in exact_ops.INPUT_KINDS:
                    held[u.name] = u.tensor
                keep = [r for r in range(gold[u.name].shape[0]) if r not in set(excluded)]
                u = replace(u, tensor=u.tensor[keep])
                rows.append(self._row(u, gold[u.name][keep], step, row_lens, starts, None, order, keep,
                                      rows_excluded=len(excluded)))
                self.reported.add(u.name)
                continue
            self.reported.add(u.name)
            want = None
            if self.ctx.exact_ops and subset is None:
                if split_point(u.name)[1] in exact_ops.INPUT_KINDS:
                    held[u.name] = u.tensor
                want = exact_ops.expected(self.ctx.ref.model, u.name, held.__getitem__, layer_input)
            g = gold[u.name]
            if subset is not None:
                self.rows_not_produced[u.name] = self.rows_not_produced.get(u.name, 0) + g.shape[0] - len(subset)
                g = g[subset]
            where = (kv_lens, [0] * len(kv_lens)) if kind_of(u.name).rows == "cache" else (row_lens, starts)
            rows.append(self._row(u, g, step, *where, want, order, subset))
            if subset is None and not self.ctx.sparse:
                self._own(rows[-1], u.tensor, g, engine_of, eng_teacher)
        return rows

    def _own(self, row: Row, tensor: torch.Tensor, golden: torch.Tensor, engine_of: dict, eng_teacher) -> None:
        """``row.own_err`` (``tpcheck.measure.own_input``) where the point exceeds half its threshold (the smaller
        of the default and the run's tolerances'): its op recomputed on the engine's own inputs of this step (the
        teacher as the layer input when isolated)."""
        dt = str(self.ctx.dtype).removeprefix("torch.")
        layer, kind = split_point(row.point)
        tols = (Tolerances(),) if self.ctx.tolerances is None else (Tolerances(), self.ctx.tolerances)
        if not row.rel_err > 0.5 * min(t.threshold(kind, dt, row.ref_rel_err) for t in tols):
            return
        inputs = own_input.input_points(row.point, self.ctx.num_layers) or []
        teacher_at = (self.ctx.num_layers if kind == "final_norm" else layer) \
            if eng_teacher is not None and own_input.reads_layer_input(kind) else None

        def get(p: str) -> torch.Tensor:
            return eng_teacher[teacher_at] if teacher_at is not None and p == inputs[0] else engine_of[p]
        red = self.ctx.reductions
        rd = None if getattr(red, "dtype", None) is None else getattr(torch, red.dtype)
        row.own_err = own_input.own_error(self.ctx.ref.model, row.point, tensor, golden, get,
                                          getattr(red, "tp", 1), rd)

    def _routes(self, units: list, gold: dict) -> list:
        """MoE: the engine's top-k put in the one order (``routes.sort_routes``), and each layer's route checked
        against the golden's (before any routed point of the step is measured: they leave its flips out)."""
        self.routes.begin_step()
        sorted_ = sort_routes({u.name: u.tensor for u, _ in units if kind_of(u.name).route in ("ids", "weights")})
        units = [(replace(u, tensor=sorted_[u.name]) if u.name in sorted_ else u, sub) for u, sub in units]
        for u, _ in units:
            layer = split_point(u.name)[0]
            if kind_of(u.name).route == "ids" and u.name in gold and f"layers.{layer}.moe.router" in gold:
                if u.tensor.shape == gold[u.name].shape:
                    self.routes.check(layer, u.tensor, gold)
        return units

    def _route_row(self, u, gold: torch.Tensor, step: int, row_lens: list[int], starts: list[int], order) -> Row:
        """``moe.topk_ids``: the expert sets compared per token (``tpcheck.judge.routing``): ``route_flips`` tokens
        differ, ``near_ties`` of them legitimately; any other is a finding in the note (the row fails)."""
        layer = split_point(u.name)[0]
        rc = self.routes.checks.get(layer)
        n = u.tensor.shape[0]
        if rc is None:  # a shape that differs from the golden's
            return self._row(u, gold, step, row_lens, starts, None, order)
        where = lambda r: "(batch, token) " + str(list(_row_index(r, row_lens, starts, order)))  # noqa: E731
        bad = len(rc.illegitimate)
        note = rc.note(where) or (u.rank_mismatch or "")
        return Row(point=u.name, layer=layer, step=step, mode=self.mode, kind=kind_of(u.name).name,
                   rel_err=bad / n if n else 0.0, ref_rel_err=0.0, route_flips=float(len(rc.flipped)),
                   near_ties=float(rc.near_ties), nan=0, inf=0, note=note, order=point_order(u.name),
                   max_abs=max(rc.margins) if rc.margins else 0.0, **u.rank_fields())

    def _row(self, u, gold: torch.Tensor, step: int, row_lens: list[int], starts: list[int], want=None,
             order: list[int] | None = None, subset: list[int] | None = None, rows_excluded: int = 0) -> Row:
        layer, kind = split_point(u.name)
        note, op_mismatch = "", float("nan")
        if u.tensor.shape != gold.shape:
            stats = {"rel_err": float("inf"), "cosine": float("nan"), "max_abs": float("inf"), "max_abs_index": [],
                     "mean_abs": float("inf"), "p99_abs": float("inf"), "ref_norm": float(gold.double().norm()),
                     "nan": 0, "inf": 0}
            note = f"shape {list(u.tensor.shape)} != golden {list(gold.shape)}"
        else:
            stats = compare(u.tensor, gold)
            stats["rel_err"] = self.floor.engine_rel_err(u.name, stats["rel_err"], stats["ref_norm"], gold.shape[0])
            if self.isolated:
                stats.update(gain_fields(u.tensor, gold))
        if stats["max_abs_index"]:
            r, f = stats["max_abs_index"]
            b, t = _row_index(r if subset is None else subset[r], row_lens, starts, order)
            stats["max_abs_index"] = [b, t, f]
        if u.rank_mismatch:
            note = u.rank_mismatch
        if want is not None and not note:
            n_bad, n = mismatch(u.tensor, want)
            op_mismatch = n_bad / n if n else 0.0
            if n_bad:
                note = (f"exact-ops: {n_bad} of {n} elements differ from HF's op on the engine's input "
                        f"(max |diff| {float((u.tensor.double() - want.double()).abs().max()):.3g})")
        # threshold, excess and passed are the judge's (tpcheck.judge): a row holds measurements and, in its
        # note, structural findings
        return Row(point=u.name, layer=layer, step=step, mode=self.mode, kind=kind, **stats,
                   **self.floor.row_fields(u.name), **u.rank_fields(), op_mismatch=op_mismatch, note=note,
                   rows_excluded=float(rows_excluded) if rows_excluded else NAN, order=point_order(u.name))

    def _selected(self, name: str) -> bool:
        return self.ctx.select is None or self.ctx.select.fullmatch(name) is not None


def _engine_routes(points) -> dict[int, torch.Tensor] | None:
    """``{layer: [rows, k] ids}`` of an engine step's ``moe.topk_ids`` points (replicated: rank 0's, or the
    first rank that holds it)."""
    ids = {name: next(t for t in per_rank if t is not None) for name, (_, per_rank) in points.items()  # fused: no kind
           if getattr(KINDS.get(split_point(name)[1]), "route", "") == "ids" and any(t is not None for t in per_rank)}
    return routes_of(ids)


def _subset(name: str, subsets: dict[str, list[int]]) -> list[int] | None:
    """The rows an engine point holds of golden point ``name`` (a fused point's parts share its rows)."""
    for point, rows in subsets.items():
        if name == point or (point.endswith(".") and name.startswith(point)):
            return rows
    return None
