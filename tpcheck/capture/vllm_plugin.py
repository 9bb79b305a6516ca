"""A vLLM ``general_plugins`` entry point: ``TPCHECK_DUMP=DIR`` makes every vLLM worker dump its points.

Declared in pyproject (``[project.entry-points."vllm.general_plugins"] tpcheck_dump``), so installing tpcheck
into vLLM's environment is all it takes; the user's script is unchanged::

    TPCHECK_DUMP=runs/vllm VLLM_ENABLE_V1_MULTIPROCESSING=0 python my_vllm_script.py   # enforce_eager=True
    tpcheck compare runs/vllm --model CKPT

vLLM calls ``register()`` in every process it starts (front end, engine core, each worker, through
``vllm.plugins.load_general_plugins``). Without ``TPCHECK_DUMP`` it returns at once: no import of vLLM, no
patch, no hook. With it, it wraps ``WorkerBase.__init__`` (in every process, harmless outside workers) so
that each worker, once its ``load_model`` has returned, installs ``tpcheck.capture`` with ``VLLM_MAP`` on
``model_runner.model`` (``capture.from_env``: ``TPCHECK_DUMP_POINTS`` and ``TPCHECK_DUMP_BUDGET_MB`` apply)
and wraps its ``model_runner.execute_model``: one call is one step (warm-up and profiling forwards go
through ``_dummy_run``, never through ``execute_model``, and are cleared). The model's forward pre-hook
records the step's ``input_ids`` and ``positions``; the batch's rows are split per request by the
scheduler's ``num_scheduled_tokens`` in ``input_batch.req_ids`` order, and each request keeps the index it
got at the first dumped step (rows are permuted back when vLLM reorders its batch).

What the dump format cannot hold (one fixed set of requests, all starting at the first step): a request that
joins or leaves after the first step stops the dump there, with a logged reason, and the serving run goes
on; the steps written until then compare. vLLM's front end hands requests to a separate engine process one
by one, so a second prompt usually starts one step later: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` schedules
``LLM.generate``'s prompts together. Give every request the same ``max_tokens`` (and ``ignore_eos=True``)
so they also end together. Hooks do not fire inside CUDA graphs or compiled regions: ``enforce_eager=True``.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("tpcheck.capture.vllm_plugin")

_PATCHED = "_tpcheck_patched"


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
            try:
                _install(self)
            except Exception:  # a debugging dump must never stop the serving run
                logger.exception("tpcheck: dump not installed")
            return out
        self.load_model = load_model

    WorkerBase.__init__ = __init__
    setattr(WorkerBase, _PATCHED, True)


class StepDump:
    """One worker's dump: the capture, the step counter and the fixed request order."""

    def __init__(self, cap, runner):
        self.cap, self.runner = cap, runner
        self.order: dict[str, int] | None = None   # request id -> its index in the dump
        self.step = 0
        self.inputs = None                         # (input_ids, positions) of the step's forward
        self.stopped = False

    def pre_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if ids is not None and pos is not None:
            self.inputs = (ids.detach().to("cpu", copy=True), pos.detach().to("cpu", copy=True))

    def stop(self, why: str) -> None:
        logger.warning(f"tpcheck: dump stopped at step {self.step}: {why}")
        self.cap.error = why
        self.cap.remove()
        self.stopped = True

    def close_step(self, scheduler_output) -> None:
        """Split the step's rows per request, put them in the dump's order and write the step."""
        req_ids, bounds = batch_rows(self.runner, scheduler_output)
        ids, pos = self.inputs
        n = bounds[-1][1] if bounds else 0
        if self.order is None:
            self.order = {r: i for i, r in enumerate(req_ids)}
        if set(req_ids) != set(self.order):
            joined = sorted(set(req_ids) - set(self.order))
            left = sorted(set(self.order) - set(req_ids))
            return self.stop(f"the batch changed (joined {joined}, left {left}); a dump holds one fixed set of "
                             "requests that start together (VLLM_ENABLE_V1_MULTIPROCESSING=0, same max_tokens)")
        perm = [req_ids.index(r) for r in sorted(self.order, key=self.order.get)]  # dump index -> batch index
        tokens = [ids[bounds[b][0]:bounds[b][1]].tolist() for b in perm]
        starts = [int(pos[bounds[b][0]]) for b in perm]
        rows = None
        if perm != list(range(len(perm))):
            rows = [i for b in perm for i in range(*bounds[b])]
        writer = self.cap.writer
        self.cap.writer = _Permuted(writer, rows, n, perm)
        try:
            self.cap.step_done(self.step, tokens, starts)
        finally:
            self.cap.writer = writer
        self.step += 1


def batch_rows(runner, scheduler_output) -> tuple[list[str], list[tuple[int, int]]]:
    """The request ids of a step's batch in row order (``input_batch.req_ids``) and each one's rows
    ``(first, end)`` in the flattened batch (``num_scheduled_tokens`` per request, in that order)."""
    req_ids = list(runner.input_batch.req_ids)
    bounds, s = [], 0
    for r in req_ids:
        c = int(scheduler_output.num_scheduled_tokens[r])
        bounds.append((s, s + c))
        s += c
    return req_ids, bounds


class _Permuted:
    """A writer in front of the ``DumpWriter`` that puts each point's rows back in the dump's request order:
    ``rows`` (token rows, for points with a row per token) or ``perm`` (one row per request: decode logits)."""

    def __init__(self, writer, rows, n, perm):
        self.writer, self.rows, self.n, self.perm = writer, rows, n, perm

    def write(self, step, tokens, starts, points):
        if self.rows is not None:
            points = {k: (p, t[self.rows] if t.shape[0] == self.n else t[self.perm]) for k, (p, t) in points.items()}
        self.writer.write(step, tokens, starts, points)


def _install(worker) -> None:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from tpcheck import capture
    from tpcheck.capture.maps import VLLM_MAP
    runner = worker.model_runner
    model = runner.get_model()
    dtype = str(worker.model_config.dtype).removeprefix("torch.")
    cap = capture.from_env(model, VLLM_MAP, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                           dtype, "vllm")
    if cap is None:
        return
    dump = StepDump(cap, runner)
    model.register_forward_pre_hook(dump.pre_forward, with_kwargs=True)
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        if dump.stopped or cap.error is not None:
            return execute(scheduler_output, *args, **kwargs)
        cap.clear()  # a warm-up or profiling forward since the last step
        dump.inputs = None
        out = execute(scheduler_output, *args, **kwargs)
        if dump.inputs is not None and scheduler_output.total_num_scheduled_tokens > 0:
            try:
                dump.close_step(scheduler_output)
            except Exception as e:  # never stop the serving run
                logger.exception("tpcheck: dump failed")
                dump.stop(f"{type(e).__name__}: {e}")
        return out
    runner.execute_model = execute_model
    worker._tpcheck_dump = dump
