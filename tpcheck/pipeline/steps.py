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
from dataclasses import dataclass
from typing import Callable

import torch

from tpcheck.capture.batches import RequestLog, StepBatch
from tpcheck.capture.core import with_handoffs
from tpcheck.capture.points import kind_of, split_point
from tpcheck.inputs.devices import to_device
from tpcheck.judge.noise_floor import NoiseFloor
from tpcheck.judge.tolerances import Tolerances
from tpcheck.pipeline.forced import RecordedInputs, forced_step
from tpcheck.pipeline.local_rows import PREFIX_KINDS, LastRows, split_golden
from tpcheck.measure.operands import INPUT_KINDS, LINEAR_INPUTS, operand_sq
from tpcheck.pipeline.routes import RouteFollower
from tpcheck.pipeline.rows import RowMaker, subset_rows
from tpcheck.reference.hf import cut_cache, new_cache
from tpcheck.result.table import Row

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
    # a replayed dump's local pass: the golden and the references are forced onto the engine's recorded layer
    # inputs (tpcheck.pipeline.forced) instead of the engine onto the golden's
    engine_inputs: bool = False
    handoffs: tuple[int, ...] = ()  # --pp: the layers after which a stage hands over (tpcheck.capture.core.handoff)
    head_dim: int = 0  # the local pass on each prompt's last rows writes keys and values (tpcheck.pipeline.local_rows)
    local_rows_ran: bool = False  # set by a local pass that gave some prompt a prefix (LastRows)
    # where the golden, the references and every statistic are computed (--golden-device): the engine's points
    # and a replayed golden are moved there as they arrive (tpcheck.inputs.devices.to_device), once a step
    golden_device: str = "cpu"


class GoldenCache:
    """The golden's points of every step of the propagated pass, kept for the local (teacher-forced) pass: both
    passes feed the same tokens, so the float64 golden, the costliest forward of a diff, runs once. Held up to
    ``budget`` bytes (float64 points of every step); past that the cache is dropped whole and the local pass
    computes the golden again (its caches need every earlier step). ``prefix``: the local pass will run each
    prompt's last rows (``tpcheck.pipeline.local_rows.planned_prefix``; None: every row): the first step is held as
    what that pass reads of it, the golden's points at its rows and the prefix's keys and values (``split_golden``
    of prompts ``row_lens`` tokens long), a fraction of the whole step on a long prompt; a golden without every
    layer's keys and values is held whole and ``prefix`` becomes None (the local pass then runs every row)."""

    def __init__(self, budget: int = 2 << 30, prefix: list[int] | None = None, row_lens: list[int] = (),
                 num_layers: int = 0):
        self.budget, self.nbytes, self.steps = budget, 0, {}
        self.enabled = budget > 0
        self.prefix, self.row_lens, self.num_layers = prefix, list(row_lens), num_layers

    def put(self, step: int, gold: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        if step == 0 and self.prefix is not None:
            if all(f"layers.{i}.{k}" in gold for i in range(self.num_layers) for k in PREFIX_KINDS):
                gold = split_golden(gold, self.row_lens, self.prefix, self.num_layers)
            else:
                self.prefix = None
        tensors = list(gold[0].values()) + [t for kv in gold[1].values() for t in kv] if isinstance(gold, tuple) \
            else list(gold.values())
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors)
        if self.nbytes > self.budget:
            self.enabled, self.steps = False, {}
            logger.info(f"  the golden's points pass {self.budget / 2**30:.1f} GiB: the local pass computes the "
                        "golden again instead of reusing it")
            return
        self.steps[step] = gold

    def holds(self, steps: int) -> bool:
        """Whether every one of ``steps`` steps is held."""
        return self.enabled and all(s in self.steps for s in range(steps))

    def take(self, step: int):
        """Step ``step``'s points (the first step with a ``prefix``: ``split_golden``'s pair), no longer held."""
        return self.steps.pop(step)


class DiffPass:
    """One mode (propagated or isolated) over prefill + decode steps; ``run()`` returns its rows. A step is a
    ``tpcheck.capture.batches.StepBatch`` (its requests, in row order): a live engine runs the prompts as one batch
    (then the golden's greedy token each step), a dump what each step ran (``engine.schedule``: late joins, chunked
    prefill, preemption's recomputation). Each request has its golden and reference caches, cut back on a rerun."""

    def __init__(self, ctx: RunContext, isolated: bool):
        self.ctx, self.isolated = ctx, isolated
        self.mode = "isolated" if isolated else "propagated"
        self.floor = NoiseFloor(ctx.reductions, gains=isolated)  # the gain is judged in the local pass alone
        self.routes = RouteFollower(ctx.sparse, ctx.golden_routes, isolated)
        self.with_kv = ctx.decode_steps > 0
        self.maker = RowMaker(ctx, self.floor, self.routes, isolated)  # its reported points: the run's coverage
        self.reported, self.rows_not_produced = self.maker.reported, self.maker.rows_not_produced
        self.stopped_at: int | None = None
        self.recorded = RecordedInputs() if isolated and ctx.engine_inputs else None  # a dump's (forced.py)
        cache = ctx.golden_cache
        self.cache_out = None if isolated else cache        # the propagated pass fills it
        self.cache_in = cache if isolated and cache is not None and cache.holds(ctx.decode_steps + 1) else None
        self.last = LastRows(ctx, self.cache_in)  # the local pass on each prompt's last rows

    def run(self) -> list[Row]:
        c = self.ctx
        self.log = RequestLog()
        self.g_caches: dict[str, object] = {}  # request id -> its golden cache (a saved golden has none)
        self.r_caches: dict[str, dict[str, object]] = {name: {} for name, _ in self.floor.references}
        c.engine.begin(c.prompts, c.decode_steps)
        recorded = c.engine.schedule(0)  # a replayed dump's requests and tokens; None: a live engine's greedy run
        batch = self.last.first(recorded if recorded is not None else StepBatch.of_prompts(c.prompts))
        rows: list[Row] = []
        for step in range(c.decode_steps + 1):
            t0 = time.monotonic()
            step_rows, nxt = self._step(step, batch)
            rows += step_rows
            # the next inputs: golden greedy tokens, or what a recorded run ran (tpcheck.capture.dump)
            if step < c.decode_steps:
                batch = c.engine.schedule(step + 1) if recorded is not None else batch.then([[t] for t in nxt])
            what = f"step {step}" if recorded is not None else "prefill" if step == 0 else \
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

    def _caches(self, batch: StepBatch, held: dict | None = None, given=None) -> tuple[list, dict[str, list]]:
        """The golden's and each reference's cache of every request of ``batch`` (new for a new request; cut back
        to the position a request runs again from). ``held``: a dump's local pass's inputs of cached prefixes;
        ``given``: the golden's keys and values of the positions a local pass skips (``LastRows.give``)."""
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
        if self.log.gaps and given is None:
            fill_gaps(c, self.log.gaps, golden, self.g_caches, self.r_caches, self.floor.references, self.isolated,
                      held)
        r = {name: [self.r_caches[name][rid] for rid in batch.ids] for name, _ in self.floor.references}
        self.maker.kv_history.seed(batch, self.last.lens, self.last.give(r, given))  # the cache's: the prefix given
        return [self.g_caches.get(rid) for rid in batch.ids], r

    def _step(self, step: int, batch: StepBatch) -> tuple[list[Row], list[int]]:
        """One step: golden, engine, references (the floor); its rows and the golden's greedy next tokens."""
        c = self.ctx
        points, eng_teacher, teacher, held = (None,) * 4 if self.recorded is None else \
            forced_step(c.engine, batch, self.with_kv, c.num_layers, self.recorded)  # a dump's local pass
        points = None if points is None else to_device(points, c.golden_device)
        gold, given = self.last.golden(step)  # the local pass on the last rows: its rows' golden, and the prefix
        g_caches, r_caches = self._caches(batch, held, given)
        if self.routes.engine_first:  # MoE: the golden follows the engine's routes (tpcheck.pipeline.routes)
            points = to_device(c.engine.step(batch.tokens, None, self.with_kv), c.golden_device)
            self.routes.record(step, points)
        gold = gold if gold is not None else self.cache_in.take(step) if self.cache_in is not None else \
            self._golden(step, batch, g_caches, self.routes.golden_route(step), teacher)
        gold = self.routes.order(to_device(gold, c.golden_device))  # a replayed golden is read to the host
        if self.cache_out is not None:
            self.cache_out.put(step, gold)
        if self.isolated and self.recorded is None:
            teacher = teacher_of(gold, c.num_layers)
            eng_teacher = {i: t.to(c.dtype) for i, t in teacher.items()}
        if points is None:  # on the golden's device, where every statistic is computed (the adapter places eng_teacher)
            points = to_device(c.engine.step(batch.tokens, eng_teacher, self.with_kv), c.golden_device)
        subsets = dict(c.engine.point_rows or {})  # points that hold only some rows
        self._measure_references(step, batch, r_caches, gold, teacher, subsets)
        order = [self.log.order[rid] for rid in batch.ids]
        rows = self.maker.rows(step, points, gold, batch, order, eng_teacher, subsets)
        return rows, gold["logits"][batch.last_rows()].argmax(-1).tolist()

    def _golden(self, step: int, batch: StepBatch, g_caches: list, routes=None, teacher=None) -> dict:
        """The golden's points of this step (``--save-golden``: written), holding only what is compared, plus the
        logits, the routing points and (with a local pass to come) the teacher inputs. ``routes``: the MoE
        routes it follows where its own differ (``tpcheck.pipeline.routes``); ``teacher``: a dump's inputs."""
        c = self.ctx
        kw = {} if routes is None else {"routes": routes}
        gold = with_handoffs(c.golden.step(batch.tokens, g_caches, batch.starts, teacher, self.with_kv, **kw),
                             c.handoffs)  # --pp: each stage boundary's, from the golden's own points
        if c.save_golden is not None and not self.isolated:
            c.save_golden.write(step, batch.tokens, batch.starts, gold)
        teacher_too = self.isolated or c.golden_cache is not None
        if c.select is not None:
            gold = {n: t for n, t in gold.items() if self._selected(n) or n == "logits" or
                    kind_of(n).route in ("logits", "ids") or
                    (teacher_too and (kind_of(n).teacher or kind_of(n).name in PREFIX_KINDS)) or
                    kind_of(n).name in INPUT_KINDS}
        return gold

    def _measure_references(self, step, batch: StepBatch, r_caches, gold, teacher, subsets) -> None:
        c = self.ctx
        self.floor.begin_step(step)
        # a replayed golden (--golden) is held to the one-device reference: a wrong golden cannot raise the floor
        check = getattr(c.golden, "check_reference", None) if teacher is None else None
        routes = self.routes.reference_routes(gold)  # the references follow the golden's routes
        operands = {n: operand_sq(c.ref.model, n, gold) for n in gold if split_point(n)[1] in LINEAR_INPUTS}
        for ref_name, red in self.floor.references:
            kw = {} if routes is None else {"routes": routes}
            ref = c.ref.step(batch.tokens, r_caches[ref_name], batch.starts, teacher, self.with_kv, red, **kw)
            ref = with_handoffs(self.routes.order(ref), c.handoffs)
            ahead = self.floor.ahead({n: t for n, t in ref.items() if kind_of(n).judged != "set" and
                                      self._selected(n) and subset_rows(n, subsets) is None}, gold)
            for n, t in ref.items():
                if n in gold:
                    self.routes.observe(n, t, gold[n])
                if kind_of(n).judged == "set":  # ids are judged as sets (tpcheck.judge.routing), not by a floor
                    continue
                if check is not None and red is None and n in gold and self._selected(n):
                    check(n, t, gold[n], c.dtype)
                if n in gold and t.shape == gold[n].shape and self._selected(n):
                    rows, sq = subset_rows(n, subsets), operands.get(n)
                    sq = None if sq is None else float(sq.sum() if rows is None else sq[rows].sum())
                    self.floor.observe(ref_name, n, *((t, gold[n]) if rows is None else (t[rows], gold[n][rows])), sq,
                                       measured=ahead.take(n) if n in ahead else None)
            del ref
        self.floor.end_step()

    def _selected(self, name: str) -> bool:
        return self.ctx.select is None or self.ctx.select.fullmatch(name) is not None


def teacher_of(gold: dict, num_layers: int) -> dict[int, torch.Tensor]:
    """Isolate mode: decoder layer i's input is the golden's (``embed`` or layer i-1's ``out``); the final norm's
    (key ``num_layers``) is the last layer's output."""
    teacher = {i: gold["embed" if i == 0 else f"layers.{i - 1}.out"] for i in range(num_layers)}
    teacher[num_layers] = gold[f"layers.{num_layers - 1}.out"]
    return teacher


def fill_gaps(c: RunContext, gaps: dict[str, tuple[int, list[int]]], golden, g_caches: dict, r_caches: dict,
              references: list, isolated: bool, forced: dict | None = None) -> None:
    """Run each prefix-cache hit's cached positions (``RequestLog.gaps``: ``{request: (position, tokens)}``, tokens
    the engine computed for another request) into the request's golden cache (``golden``: None where the golden
    keeps none) and each reference's (with that reference's reductions), before the step: the engine produced no
    rows of them for this request, so none is compared. ``forced``: a dump's local pass, per request the recorded
    layer inputs of those positions (``tpcheck.pipeline.forced.RecordedInputs``) the runs are forced onto."""
    if isolated and forced is None:  # a live engine's local pass (a dump's, the one source of hits, is forced)
        raise ValueError(f"requests {sorted(gaps)} start on a cached prefix: the local pass cannot teacher-force "
                         "positions the engine did not run for them")
    for rid, (pos, toks) in gaps.items():
        teacher = None if forced is None else forced[rid]
        if golden is not None:
            c.golden.step([toks], [g_caches[rid]], [pos], teacher)
        for name, red in references:
            c.ref.step([toks], [r_caches[name][rid]], [pos], teacher, False, red)
