"""``tpcheck.diff`` (defined here, exported by the package): the engine against a float64 golden run, point by
point, step by step.

The stages, in order: resolve the inputs (``tpcheck.inputs``: checkpoint, prompts) and the engine
(``tpcheck.engines.registry``); run the passes (``tpcheck.pipeline.steps``: golden, references, engine; capture,
unshard, measure); judge the rows (``tpcheck.judge``); return a ``DiffResult`` (``tpcheck.result``).
The local pass (``isolate``; on by default where the engine can be teacher-forced) is a second, teacher-forced pass:
every layer of the engine and of the noise-floor references gets the golden input of that layer, so each row shows
the layer's local error apart from what it inherited, judged against a floor that does not grow with depth (README
"A verdict whose margin does not decay with depth"). The golden's points are computed once and reused by it. ``exact_ops`` also
holds the RMSNorms and residual adds to bit-identity with HF's own modules applied to the engine's own inputs
(``tpcheck.measure.exact_ops``)."""
from __future__ import annotations

import logging
from dataclasses import replace

from impl.config import parse_dtype
from tpcheck.engines.adapter import EngineAdapter, as_adapter
from tpcheck.engines.pool import EnginePool
from tpcheck.capture.rounding import NEAREST, Rounding, local_pass_default_off, overridden
from tpcheck.judge import judge
from tpcheck.judge.coverage import Coverage
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure.precision import effective_precision
from tpcheck.options import DiffOptions
from tpcheck.pipeline.forced import layer_outputs
from tpcheck.pipeline.local_rows import planned_prefix
from tpcheck.pipeline.plan import RunPlan
from tpcheck.pipeline.steps import DiffPass, GoldenCache, RunContext
from tpcheck.progress import bar
from tpcheck.reference.cache import hf_capture
from tpcheck.reference.reductions import Reductions
from tpcheck.reference.saved import GoldenWriter, SavedGolden
from tpcheck.result.documents import run_meta
from tpcheck.result.meta import DiffMeta, RunOrigin
from tpcheck.result.table import DiffResult

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr


def diff(model: str | None = None, tp: int = 1, dtype: str = "float32", prompts: list[list[int]] | None = None,
         decode_steps: int = 0, isolate: bool | None = None, *, tolerances: Tolerances | None = None, pool=None,
         command: str | None = None, **options) -> DiffResult:
    """Compare an engine (``engine="impl"``, or another of ``tpcheck.engines.registry.ENGINES``) at
    ``tp``/``dtype`` with Hugging Face, every point, every step.

    ``model`` is a checkpoint directory (default: the synthetic ``preset``); ``prompts`` token ids (default:
    ``batch`` random prompts of ``seq_len`` tokens from ``seed``). ``options``: the other fields of
    ``tpcheck.options.DiffOptions`` (``preset``, ``engine``, ``exact_ops``, ``points``, ``layers``, ``fail_fast``,
    ``golden``, ``save_golden``, ``streamed``, ``dump``, ``inject``, ...; an unknown one is a ``TypeError``).
    ``tolerances``: a ``Tolerances`` (default: the built-in ones); ``pool``: an ``EnginePool`` to reuse;
    ``command``: the command line to record (default: the options' own ``to_argv``)."""
    opts = DiffOptions.of(model=model, tp=tp, dtype=dtype, prompts=prompts, decode_steps=decode_steps,
                          isolate=isolate, **options)
    if tolerances is not None and opts.tolerances is None and getattr(tolerances, "file", None):
        opts = opts.replace(tolerances=tolerances.file)
    return run(opts, tolerances, pool, command)


def run(opts: DiffOptions, tolerances: Tolerances | None = None, pool=None, command: str | None = None) -> DiffResult:
    """``diff`` on a ``DiffOptions``: resolve it once (``tpcheck.pipeline.plan.RunPlan``), start the engine, run,
    judge."""
    plan = RunPlan.resolve(opts, getattr(pool, "device", None))  # --device auto: the pool's, where it has one
    opts = plan.opts
    own = pool is None
    pool = pool or EnginePool()
    try:
        adapter = as_adapter(plan.entry.start(pool, plan))
        origin = RunOrigin(tp=opts.tp, ep=opts.ep, stages=adapter.stages, engine=opts.engine,
                           inject=opts.inject,
                           inject_layer=opts.inject_layer, inject_silent=plan.silent,
                           command=command or plan.command())
        return _compare(adapter, plan, tolerances, origin)
    finally:
        if own:
            pool.close()


def compare(engine, opts: DiffOptions, tolerances: Tolerances | None = None,
            origin: RunOrigin | None = None) -> DiffResult:
    """``compare_engine`` on a ``DiffOptions`` (its model, dtype, prompts, decode steps and what to compare; the
    engine is already running): the passes over any adapter, judged. ``origin``: the engine side of the result's
    meta (``tpcheck.result.meta.RunOrigin``; a replayed dump's tp, engine name, directory and command)."""
    return _compare(engine, RunPlan.of(opts), tolerances, origin)


def compare_engine(engine, model_dir: str, prompts: list[list[int]], dtype: str, decode_steps: int = 0,
                   isolate: bool | None = None, *, tolerances: Tolerances | None = None,
                   origin: RunOrigin | None = None, **options) -> DiffResult:
    """Run any ``tpcheck.engines.adapter.EngineAdapter`` against HF float64 (golden) and HF at ``dtype`` (noise
    floor: on one device, and with the engine's declared ``reductions`` emulated when its tp > 1) on the
    checkpoint ``model_dir``; the engine must already be loaded with that checkpoint. ``options``: fields of
    ``tpcheck.options.DiffOptions`` — ``exact_ops`` (``tpcheck.measure.exact_ops``), ``require_points`` (a
    regex of the canonical points the engine must report; ``meta["coverage"]`` says what it did not),
    ``points`` / ``layers`` (compare only those), ``fail_fast`` (stop after the first step with a failing point;
    no isolated pass then), ``golden`` (a saved golden replayed instead of the float64 run), ``save_golden``
    (save this run's golden there; ``tpcheck.reference.saved``), ``streamed``. ``origin``: as ``compare``'s."""
    opts = DiffOptions.of(model=str(model_dir), dtype=dtype, decode_steps=decode_steps, isolate=isolate,
                          prompts=prompts, **options)
    return compare(engine, opts, tolerances, origin)


class _Notes(logging.Handler):
    """The notes a run logs (``tpcheck diff: note: ...`` warnings: no declared reductions, no local pass, no MoE
    route reported): kept for the saved result (``meta["notes"]``, shown in the HTML report) as well as the log."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.notes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.notes.append(record.getMessage().removeprefix("tpcheck diff: note: "))


def _compare(engine, plan: RunPlan, tolerances: Tolerances | None, origin: RunOrigin | None) -> DiffResult:
    """The passes of one diff over an engine adapter (``as_adapter``: one that does not derive from
    ``EngineAdapter`` gets its defaults), judged (its notes saved with it)."""
    engine = as_adapter(engine)
    notes = _Notes()
    logger.addHandler(notes)  # every module of the pipeline logs to this one logger
    try:
        return _passes(engine, plan, tolerances, origin, notes)
    finally:
        logger.removeHandler(notes)


def _passes(engine: EngineAdapter, plan: RunPlan, tolerances: Tolerances | None, origin: RunOrigin | None,
            notes: _Notes) -> DiffResult:
    opts, cfg, select, prompts = plan.opts, plan.cfg, plan.select, plan.prompts
    model_dir, dtype, steps = opts.model, opts.dtype, opts.decode_steps
    coverage = Coverage(list(plan.expected), require=opts.require_points)
    reductions = engine.reductions
    if reductions is None:
        reductions = Reductions()
        logger.warning("tpcheck diff: note: the engine adapter declares no `reductions` "
                       "(tpcheck.reference.reductions.Reductions): the noise floor is HF on one device only and "
                       "does not admit the rounding of TP all-reduces")
    # on the golden's device (--golden-device); streamed: both references stream their weights (on the host)
    ref = hf_capture(model_dir, dtype, opts.streamed, plan.golden_device)
    golden = SavedGolden(opts.golden, model_dir, prompts, steps, steps > 0) if opts.golden else \
        hf_capture(model_dir, "float64", opts.streamed, plan.golden_device)
    for cap in (ref, golden):
        if hasattr(cap, "quant_shards"):  # the engine's ranks quantize their own slices of a row-parallel input
            cap.quant_shards = reductions.tp
    writer = GoldenWriter(opts.save_golden, model_dir, prompts, steps, steps > 0, cfg.num_layers) \
        if opts.save_golden else None
    rounding = engine_rounding(engine, opts.rounding)
    isolate = local_pass(engine, opts.isolate, cfg.num_layers, rounding)
    modes = [False] + ([True] if isolate else [])
    stop_when = _step_fails(dtype, rounding, tolerances) if opts.fail_fast else None
    # a replayed dump: its local pass runs the golden again, forced onto the engine's recorded inputs
    forced = isolate and not engine.teacher_forcing
    sparse = getattr(cfg, "moe", None) is not None
    # the golden's points kept for the local pass (which may run each prompt's last rows: tpcheck.pipeline.local_rows)
    cache = GoldenCache(prefix=planned_prefix(engine, prompts, opts.local_rows, sparse, plan.handoffs),
                        row_lens=[len(p) for p in prompts], num_layers=cfg.num_layers) if isolate and not forced else None
    ctx = RunContext(golden, ref, engine, prompts, steps, cfg.num_layers,
                     parse_dtype(dtype), reductions, plan.keep, opts.exact_ops, stop_when, writer,
                     bar(len(modes) * (steps + 1), "diff", "step"), cache, sparse=sparse, tolerances=tolerances,
                     engine_inputs=forced, handoffs=plan.handoffs, head_dim=cfg.head_dim,
                     golden_device=plan.golden_device)
    ctx.golden_routes = {} if ctx.sparse else None
    rows, stopped = _run_passes(ctx, modes, coverage)
    coverage.comparisons = len(rows)
    meta = DiffMeta(origin=origin, model=str(model_dir), dtype=dtype, coverage=coverage.as_meta(), decode_steps=steps,
                    isolate=isolate, exact_ops=opts.exact_ops, select=select, stopped_at_step=stopped,
                    golden=str(opts.golden) if opts.golden else None,
                    reductions={"tp": reductions.tp, "dtype": reductions.dtype or dtype}, num_layers=cfg.num_layers,
                    prompt_lens=[len(p) for p in prompts], notes=tuple(notes.notes), rounding=rounding.as_meta(),
                    local_rows=opts.local_rows if ctx.local_rows_ran else None,
                    devices={"engine": plan.device if plan.entry is not None else "unknown (a dump or an adapter given)",
                             "golden": plan.golden_device})
    table = DiffResult.from_rows(rows, {}, stamp=False).table
    meta = replace(meta, effective_precision=effective_precision(table, dtype))  # informational, not the verdict
    return judge(DiffResult(table, {**run_meta(), **meta.to_dict()}), tolerances)  # stamped: made here, now


def local_pass(engine: EngineAdapter, isolate: bool | None, num_layers: int, rounding: Rounding = NEAREST) -> bool:
    """Whether the run has the local (teacher-forced) pass: ``isolate`` when given (True on an engine that cannot be
    teacher-forced is refused), else whether the adapter says it can be (``teacher_forcing``). A replayed dump
    (``lacking``) has it where it recorded every layer's ``out`` at every row of every step: its local pass forces
    the golden and the references onto those (``tpcheck.pipeline.forced``)."""
    engine = as_adapter(engine)
    can = bool(engine.teacher_forcing)
    why = "this engine cannot be teacher-forced"
    gaps = None if can else engine.lacking(layer_outputs(num_layers))
    if gaps is not None:
        can = not gaps
        why = "the dump lacks " + ", ".join(f"{n} (step {s})" for n, s in list(gaps.items())[:4]) + \
            (f" and {len(gaps) - 4} more" if len(gaps) > 4 else "") + ", which the local pass forces each layer " \
            "onto (it needs every layer's out at every row of every step)"
        if isolate and not can:
            raise ValueError(f"--isolate: {why}")
    if isolate is None:
        off = local_pass_default_off(rounding) if can else None
        if off:
            logger.warning(f"tpcheck diff: note: the verdict is the propagated pass alone: {off}")
            return False
        if not can:
            logger.warning(f"tpcheck diff: note: {why}: the verdict is the propagated "
                           "pass alone, whose floor grows with depth (a bug deep in the model shows by a thinner "
                           "margin; docs/measured/depth.md \"A verdict whose margin does not decay with depth\")")
        return can
    return isolate


def engine_rounding(engine: EngineAdapter, mode: str | None = None) -> Rounding:
    """The adapter's declared rounding (its ``rounding`` attribute: ``tpcheck.capture.rounding``; none declared:
    to nearest), or ``mode`` where ``--rounding`` names one."""
    declared = as_adapter(engine).rounding
    return overridden(declared if isinstance(declared, Rounding) else NEAREST, mode)


def _step_fails(dtype: str, rounding: Rounding, tolerances: Tolerances | None):
    """``--fail-fast``: does a step's rows hold a failing point (judged as the whole run will be)?"""
    step_meta = {"dtype": dtype, "rounding": rounding.as_meta()}
    return lambda step_rows: bool(step_rows) and not judge(
        DiffResult.from_rows(step_rows, step_meta, stamp=False), tolerances).table["passed"].all()


def _run_passes(ctx: RunContext, modes: list[bool], coverage: Coverage) -> tuple[list, int | None]:
    """The propagated pass, then (``--isolate``) the teacher-forced one, unless ``--fail-fast`` stopped."""
    rows: list = []
    stopped = None
    try:
        for isolated in modes:
            p = DiffPass(ctx, isolated)
            try:
                rows += p.run()
            except BaseException:
                try:
                    ctx.engine.close()
                except Exception:  # the engine may be gone (a dead rank); the first error is the one to report
                    pass
                raise
            coverage.reported |= p.reported
            # the local pass judges the same steps' rows again: the rows an engine did not produce count once
            for name, n in ({} if isolated else p.rows_not_produced).items():
                coverage.rows_not_produced[name] = coverage.rows_not_produced.get(name, 0) + n
            stopped = p.stopped_at
            if stopped is not None:
                break
    finally:
        ctx.progress.close()
    return rows, stopped
