"""A vLLM ``general_plugins`` entry point: ``TPCHECK_DUMP=DIR`` makes every vLLM worker dump its points.

Declared in pyproject (``[project.entry-points."vllm.general_plugins"] tpcheck_dump``), so installing tpcheck
into vLLM's environment is all it takes; the user's script is unchanged::

    TPCHECK_DUMP=runs/vllm python my_vllm_script.py   # LLM(..., enforce_eager=True)
    tpcheck compare runs/vllm --model CKPT

vLLM calls ``register()`` in every process it starts (front end, engine core, each worker, through
``vllm.plugins.load_general_plugins``). Without ``TPCHECK_DUMP`` it returns at once: no import of vLLM, no
patch, no hook. With it, it wraps ``WorkerBase.__init__`` (in every process, harmless outside workers) so
that each worker, once its ``load_model`` has returned, installs ``tpcheck.capture`` with ``VLLM_MAP`` on
``model_runner.model`` (``capture.from_env``: ``TPCHECK_DUMP_POINTS`` and ``TPCHECK_DUMP_BUDGET_MB`` apply)
and wraps its ``model_runner.execute_model``: one call is one step (warm-up and profiling forwards go
through ``_dummy_run``, never through ``execute_model``, and are cleared). The model's forward pre-hook
records the step's ``input_ids`` and ``positions`` and the batch: the request ids in row order
(``input_batch.req_ids``) and each one's rows (the scheduler's ``num_scheduled_tokens``).

Continuous batching is recorded as it happens (dump format 2, ``tpcheck.capture.batches``): each step names
the requests it ran, in row order, with the tokens each consumed and the position of the first, so requests
may join at any step, leave, be prefilled in chunks or preempted and recomputed; the rows stay in the batch's
order. ``logits`` holds only the rows vLLM samples (the last row of each request): the step's ``rows`` say
which. Hooks do not fire inside CUDA graphs or compiled regions: ``enforce_eager=True``.

Prefix caching (vLLM's default) is recorded too: at a request's first scheduled step the step's ``prompts`` hold
its token ids from position 0 (the scheduler's ``scheduled_new_reqs``: ``prompt_token_ids``, or a resumed
request's ``prefill_token_ids``), so a request that starts past 0 on blocks another request computed (its
``num_computed_tokens``, the step's ``starts``) is rebuilt by ``compare``'s golden. Where the scheduler gives no
token ids (prompt embeddings), the first such step logs a warning at once: ``compare`` will refuse the request.

``AFTER_LOAD`` lets another plugin act on the loaded model first: ``TPCHECK_DUMP_FAULT``'s seeded fault
(``tpcheck.engines.vllm.fault_plugin``).
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("tpcheck.engines.vllm.plugin")

_PATCHED = "_tpcheck_patched"
#: callables run on each worker once its model is loaded, before the dump installs (a seeded fault:
#: ``tpcheck.engines.vllm.fault_plugin``); their errors stop the worker, as asked-for work should
AFTER_LOAD: list = []


def register() -> None:
    """The entry point: patch vLLM's workers only when ``TPCHECK_DUMP`` names a directory."""
    if not os.environ.get("TPCHECK_DUMP"):
        return
    from vllm.v1.worker.worker_base import WorkerBase
    if getattr(WorkerBase, _PATCHED, False):  # plugins may be loaded more than once per process
        return
    init = WorkerBase.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        load = self.load_model  # the subclass's (GPU, CPU, XPU worker)

        def load_model(*a, **k):
            out = load(*a, **k)
            for fn in AFTER_LOAD:
                fn(self)
            try:
                _install(self)
            except Exception:  # a debugging dump must never stop the serving run
                logger.exception("tpcheck: dump not installed")
            return out
        self.load_model = load_model

    WorkerBase.__init__ = __init__
    setattr(WorkerBase, _PATCHED, True)
    try:  # vLLM's CPU build only
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:
        return
    patch_omp_bind(OMPProcessManager)


def cpu_bind(tp: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: the CPUs this process may use split into ``tp``
    contiguous ranges (``"0-7|8-15"``), ``nobind`` with fewer CPUs than ranks. vLLM's own default, ``auto``,
    binds a rank per NUMA node and asserts on a machine with fewer nodes than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    ranges = [cpus[r * per:(r + 1) * per] for r in range(tp)]
    return "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in ranges)


def patch_omp_bind(manager_cls) -> None:
    """Where ``VLLM_CPU_OMP_THREADS_BIND`` is unset and vLLM's default (``auto``: a rank per NUMA node) fails on
    this machine (it asserts with fewer NUMA nodes than ranks), bind the ranks to contiguous CPU ranges instead,
    as ``--engine vllm`` does (``cpu_bind``), and say so: the dumped script runs where it
    would otherwise have stopped before its first step. A value the user set is never changed."""
    if getattr(manager_cls, _PATCHED, False):
        return
    parse = manager_cls._parse_omp_threads_bind_env

    def _parse_omp_threads_bind_env(self):
        try:
            return parse(self)
        except (AssertionError, RuntimeError) as e:
            if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
                raise
            bind = cpu_bind(self.local_world_size)
            logger.warning(f"tpcheck: vLLM's CPU thread binding 'auto' failed here ({e or type(e).__name__}); "
                           f"VLLM_CPU_OMP_THREADS_BIND={bind!r} set for {self.local_world_size} rank(s), as "
                           "tpcheck diff --engine vllm sets it (set it yourself to choose)")
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            return parse(self)

    manager_cls._parse_omp_threads_bind_env = _parse_omp_threads_bind_env
    setattr(manager_cls, _PATCHED, True)


class StepDump:
    """One worker's dump: the capture, the step counter and the batch of the running step."""

    def __init__(self, cap, runner):
        self.cap, self.runner = cap, runner
        self.step = 0
        self.sched = None                          # the scheduler output of the running step
        self.inputs = None                         # (input_ids, positions) of the step's forward
        self.batch = None                          # (request ids in row order, their rows)
        self.prompts: dict[str, list[int]] = {}    # the running step's new requests' token ids from position 0
        self.seen: set[str] = set()                # the requests of the steps written so far
        self.warned = False                        # a prefix-cache hit without token ids has been reported
        self.stopped = False
        self.handoffs = None                       # a pipeline stage's hand-offs (tpcheck.engines.vllm.pp)

    def pre_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if ids is not None and pos is not None and self.sched is not None:
            # queued like the points' copies (read in close_step, after step_done waited for them)
            self.inputs = (self.cap.host_copy(ids.detach()), self.cap.host_copy(pos.detach()))
            self.batch = batch_rows(self.runner, self.sched)  # after the runner's _update_states

    def stop(self, why: str) -> None:
        logger.warning(f"tpcheck: dump stopped at step {self.step}: {why}")
        self.cap.error = why
        self.cap.remove()
        self.stopped = True

    def close_step(self) -> None:
        """Write the step: per request (row order) its id, tokens and first position; every point's rows."""
        req_ids, bounds = self.batch
        ids, pos = self.inputs
        writer, self.cap.writer = self.cap.writer, None  # the rows are this step's business, not the capture's
        try:
            points = self.cap.step_done(self.step)
        finally:
            self.cap.writer = writer
        points.update(self.handoffs.take() if self.handoffs is not None else {})
        points, rows = step_rows(points, bounds, ids.shape[0])
        tokens = [ids[a:b].tolist() for a, b in bounds]
        starts = [int(pos[a]) for a, _ in bounds]
        prompts = {r: self.prompts[r] for r in req_ids if r in self.prompts}
        self.check_prefixes(req_ids, starts, prompts, writer.rank)
        writer.write(self.step, tokens, starts, points, ids=req_ids, rows=rows, prompts=prompts)
        self.seen.update(req_ids)
        self.step += 1

    def check_prefixes(self, req_ids: list[str], starts: list[int], prompts: dict[str, list[int]], rank: int) -> None:
        """Warn (once) at the first step where a request starts past 0 with no recorded token ids for the
        positions before: ``tpcheck compare`` will refuse it, and the user should know before the run ends."""
        if self.warned:
            return
        for rid, start in zip(req_ids, starts):
            if start > 0 and rid not in self.seen and len(prompts.get(rid, ())) < start:
                logger.warning(f"tpcheck: step {self.step}, rank {rank}: request {rid!r} starts at position "
                               f"{start} (a prefix-cache hit) and the scheduler gave no token ids for the positions "
                               "before: tpcheck compare will refuse it (run with enable_prefix_caching=False)")
                self.warned = True
                return


def new_prompts(scheduler_output) -> dict[str, list[int]]:
    """The token ids from position 0 of the requests the scheduler sends the workers for the first time (or
    again, after a preemption): what a prefix-cache hit's golden runs first. A request without token ids
    (prompt embeddings) is left out."""
    out = {}
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        toks = getattr(r, "prefill_token_ids", None) or r.prompt_token_ids
        if toks is not None:
            out[str(r.req_id)] = [int(t) for t in toks]
    return out


def batch_rows(runner, scheduler_output) -> tuple[list[str], list[tuple[int, int]]]:
    """The request ids of a step's batch in row order (``input_batch.req_ids``) and each one's rows
    ``(first, end)`` in the flattened batch (``num_scheduled_tokens`` per request, in that order)."""
    req_ids = list(runner.input_batch.req_ids)
    bounds, s = [], 0
    for r in req_ids:
        c = int(scheduler_output.num_scheduled_tokens.get(r, 0))
        bounds.append((s, s + c))
        s += c
    keep = [i for i, (a, b) in enumerate(bounds) if b > a]  # a request in the batch but not scheduled this step
    return [req_ids[i] for i in keep], [bounds[i] for i in keep]


def step_rows(points: dict, bounds: list[tuple[int, int]], padded: int) -> tuple[dict, dict[str, list[int]]]:
    """A step's points cut to its token rows, and ``{point: its rows}`` for the points that hold only some.
    A point with a row per token keeps the step's rows (the padding vLLM may add past them, ``padded`` rows
    in all, is cut off); one with a row per request holds each request's last row: ``logits``, which vLLM
    computes only for the rows it samples. Any other row count is dropped (logged): it cannot be placed."""
    n = bounds[-1][1] if bounds else 0
    last = [b - 1 for _, b in bounds]
    kept, rows = {}, {}
    for name, (p, t) in points.items():
        if t is None or t.shape[0] == n:
            kept[name] = (p, t)
        elif t.shape[0] == padded:
            kept[name] = (p, t[:n])
        elif t.shape[0] == len(bounds):
            kept[name], rows[name] = (p, t), last
        else:
            logger.info(f"tpcheck: {name} dropped: {t.shape[0]} rows, the step has {n} tokens in {len(bounds)} "
                        "requests")
    return kept, rows


def cpu_rounds_bf16() -> bool | None:
    """What the dump records of how this rank's kernels round to bfloat16 (``tpcheck.capture.rounding``): on vLLM's
    CPU platform whether the CPU has the hardware conversion (its flags); None elsewhere (a GPU: not recorded)."""
    from vllm.platforms import current_platform

    from tpcheck.capture.rounding import cpu_has_bf16_rounding
    return cpu_has_bf16_rounding() if current_platform.is_cpu() else None


def _install(worker) -> None:
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from tpcheck import capture
    from tpcheck.capture.maps import VLLM_MAP
    from tpcheck.engines.vllm.routes import attach_route_probes
    runner = worker.model_runner
    model = runner.get_model()
    attach_route_probes(model)  # the experts vLLM chose (moe.topk_ids), before the capture hooks
    dtype = str(worker.model_config.dtype).removeprefix("torch.")
    ckpt = str(worker.model_config.model)  # a local checkpoint directory: the dump records its fingerprint
    pp = get_pp_group()  # pipeline stages: each stage's ranks write DIR/stage{s} (tpcheck.engines.dump.stages)
    stage = pp.rank_in_group if pp.world_size > 1 else None
    cap = capture.from_env(model, VLLM_MAP, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                           dtype, "vllm", ckpt if os.path.isdir(ckpt) else None, stage=stage,
                           cpu_bf16_rounding=cpu_rounds_bf16())
    if cap is None:
        return
    dump = StepDump(cap, runner)
    if stage is not None:
        from tpcheck.capture.core import ENV_DIR, ENV_POINTS
        from tpcheck.capture.stages import write_stage
        from tpcheck.engines.vllm.stages import StageHandoffs, stage_range
        dump.handoffs = StageHandoffs(model, os.environ.get(ENV_POINTS) or None)
        if get_tensor_model_parallel_rank() == 0:
            write_stage(os.environ[ENV_DIR], stage, pp.world_size, stage_range(model))
    model.register_forward_pre_hook(dump.pre_forward, with_kwargs=True)
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        if dump.stopped or cap.error is not None:
            return execute(scheduler_output, *args, **kwargs)
        cap.clear()  # a warm-up or profiling forward since the last step
        if dump.handoffs is not None:
            dump.handoffs.take()
        dump.inputs, dump.batch, dump.sched = None, None, scheduler_output
        try:
            dump.prompts = new_prompts(scheduler_output)
        except Exception:  # never stop the serving run: a prefix-cache hit is then warned of and refused
            logger.exception("tpcheck: the new requests' token ids could not be read")
            dump.prompts = {}
        try:
            out = execute(scheduler_output, *args, **kwargs)
        finally:
            dump.sched = None
        if dump.inputs is not None and dump.batch[0]:
            try:
                dump.close_step()
            except Exception as e:  # never stop the serving run
                logger.exception("tpcheck: dump failed")
                dump.stop(f"{type(e).__name__}: {e}")
        return out
    runner.execute_model = execute_model
    worker._tpcheck_dump = dump
