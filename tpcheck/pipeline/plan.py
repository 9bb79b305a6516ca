"""A diff resolved once (``RunPlan.resolve``): the checkpoint directory, its config, the prompts' token ids, the
compiled point selection and the points it expects, the engine's entry and the injected faults that cannot show,
each looked up and checked once, before any engine starts. Every later stage (the engine's ``start``, the passes,
the judge, the result's metadata and its repro command) reads the plan instead of resolving again."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace

from impl.config import ConfigError, ModelConfig, load_config
from impl.pipeline import layer_partition
from tpcheck.capture.points import model_point_names, stage_handoffs
from tpcheck.capture.selection import selection
from tpcheck.engines.registry import EngineEntry
from tpcheck.engines.registry import engine as engine_entry
from tpcheck.inputs.models.checkpoints import cached_checkpoint
from tpcheck.inputs.devices import resolve_device
from tpcheck.engines.impl.faults import get_fault
from tpcheck.inputs.prompts import random_prompts
from tpcheck.inputs.files.quant_check import check_quantized_checkpoint
from tpcheck.options import DiffOptions

logger = logging.getLogger("tpcheck.pipeline.diff")  # progress: tpcheck's CLI shows INFO on stderr


@dataclass(frozen=True)
class RunPlan:
    """One diff, resolved. ``opts`` is the run as it will be repeated: ``model`` the checkpoint directory and
    ``prompts`` the token ids (the random prompts' ``seq_len`` / ``batch`` / ``seed`` back at their defaults: the
    ids now name the prompts, so the repro command carries them and not the fields that drew them)."""

    opts: DiffOptions
    cfg: ModelConfig
    select: str | None                 # the compared points' regex (tpcheck.capture.selection); None: every point
    expected: tuple[str, ...]          # the model's points the selection keeps, in execution order
    entry: EngineEntry | None = None   # None: an adapter the caller started (compare_engine, a dump)
    handoffs: tuple[int, ...] = ()     # the layers that end a pipeline stage before the last (--pp)
    silent: dict[str, str] = field(default_factory=dict)  # injected faults that cannot show here, and why
    device: str = "cpu"                # where the engine runs (--device resolved: tpcheck.inputs.devices)
    golden_device: str = "cpu"         # where the golden, the references and the statistics run (--golden-device)

    @property
    def model_dir(self) -> str:
        return self.opts.model

    @property
    def prompts(self) -> list[list[int]]:
        return [list(p) for p in self.opts.prompts]

    @property
    def keep(self) -> re.Pattern | None:
        return re.compile(self.select) if self.select else None

    @property
    def capture_points(self) -> str | None:
        """The regex of the points an engine's ranks capture (hooks only where they come from; None: every
        point): the selection, plus every MoE layer's router and top-k ids (the routing check reads them
        whatever is compared). ``--exact-ops`` reads the inputs of the checked ops, so it captures everything."""
        if self.opts.exact_ops or not self.select:
            return None
        return f"(?:{self.select})|layers\\.\\d+\\.moe\\.(?:router|topk_ids)"

    def command(self) -> str:
        """The ``tpcheck diff`` command line that repeats this run."""
        return self.opts.command()

    @classmethod
    def resolve(cls, opts: DiffOptions, pool_device: str | None = None) -> "RunPlan":
        """Resolve and check ``opts`` for ``tpcheck diff``: the engine (``--inject`` on an engine faults cannot
        patch, ``--ep`` off impl or on a dense model, a layout the engine refuses), every flag against the model
        (``DiffOptions.validate``), the devices (``--device auto``: ``pool_device``, the device an ``EnginePool``
        was made for, where given), the prompts, the selection; a ``ValueError`` naming the flag otherwise."""
        device, golden_device = run_devices(opts, pool_device)  # a GPU asked for and absent: refused first
        entry = engine_entry(opts.engine)
        entry.load()  # the engine's module first: an engine that is not installed is refused before anything else
        if opts.inject and not entry.faults:
            raise ValueError(f"--inject applies to impl only (faults patch impl's modules), not --engine {opts.engine}")
        if opts.block_size != DiffOptions.block_size and opts.engine != "impl":
            raise ValueError(f"--block-size {opts.block_size} applies to --engine impl only (impl's paged KV cache); "
                             f"--engine {opts.engine} keeps its own cache layout")
        model_dir = str(opts.model or cached_checkpoint(opts.preset))
        cfg = load_config(model_dir)
        if opts.ep != 1:
            if getattr(cfg, "moe", None) is None:
                raise ValueError(f"--ep {opts.ep}: expert parallelism needs a mixture-of-experts model; this is "
                                 f"model_type {cfg.model_type!r}")
            if opts.engine != "impl":
                raise ValueError(f"--ep {opts.ep} applies to --engine impl only (not {opts.engine})")
        cfg.check_tp(opts.tp, opts.ep)
        _check_pipeline(opts, cfg)
        opts.validate(cfg)  # every flag against this model, before any engine work
        for name in opts.inject:  # a fault with nothing to act on here: refused, not a rank's AttributeError
            why = get_fault(name).refused_because(cfg)
            if why:
                raise ValueError(f"--inject {name} {why}")
        entry.check_layout(cfg, opts.tp)
        prompts = _prompts(opts, cfg)
        opts = opts.replace(model=model_dir, prompts=prompts, seq_len=32, batch=2, seed=0)
        plan = cls.of(opts, cfg, entry, (device, golden_device))  # a selection that keeps no point: refused here
        logger.info(f"tpcheck diff: {model_dir} tp={opts.tp}{f' pp={opts.pp}' if opts.pp != 1 else ''} {opts.dtype}, {len(prompts)} prompt(s), "
                    f"{opts.decode_steps} decode step(s){', isolate' if opts.isolate else ''}"
                    f"{', exact-ops' if opts.exact_ops else ''}{', inject ' + ','.join(opts.inject) if opts.inject else ''}")
        return replace(plan, silent=_silent_faults(opts, cfg))

    @classmethod
    def of(cls, opts: DiffOptions, cfg: ModelConfig | None = None, entry: EngineEntry | None = None,
           devices: tuple[str, str] | None = None) -> "RunPlan":
        """The plan of ``opts`` whose ``model`` and ``prompts`` are given (an adapter the caller started): the
        config (loaded unless given), a quantized checkpoint's tensors checked (``tpcheck.inputs.files.quant_check``),
        the devices (``run_devices`` unless given) and the selection; a selection that keeps no point is a
        ``ValueError``."""
        cfg = cfg if cfg is not None else load_config(opts.model)
        check_quantized_checkpoint(opts.model, cfg)  # a broken scale or index: exit 2 naming it, not a verdict
        device, golden_device = devices or run_devices(opts)
        select = selection(opts.points, opts.layers)
        keep = re.compile(select) if select else None
        handoffs = () if opts.pp == 1 and opts.pp_partition is None else \
            stage_handoffs(layer_partition(cfg.num_layers, opts.pp, opts.pp_partition))
        expected = tuple(n for n in model_point_names(cfg, opts.decode_steps > 0, handoffs)
                         if keep is None or keep.fullmatch(n))
        if not expected:
            raise ValueError(f"--points/--layers select no point of this {cfg.num_layers}-layer model ({select!r})")
        return cls(opts, cfg, select, expected, entry, handoffs=handoffs, device=device, golden_device=golden_device)


def run_devices(opts: DiffOptions, pool_device: str | None = None) -> tuple[str, str]:
    """``(engine's device, golden's device)`` of a run (``tpcheck.inputs.devices.resolve_device``): ``--device``
    (``auto``: ``pool_device`` where an ``EnginePool`` was made for a device, else CUDA when present) and
    ``--golden-device`` (default: the engine's). A GPU asked for and absent is a ``ValueError`` naming the flag;
    ``--golden-device`` other than the CPU with ``--golden-streamed`` too (the streamed golden reads its weights into
    host memory)."""
    asked = pool_device if opts.device == "auto" and pool_device is not None else opts.device
    device = resolve_device(asked, "--device")
    golden = resolve_device(opts.golden_device, "--golden-device") if opts.golden_device else device
    if opts.streamed and golden != "cpu":
        if opts.golden_device:
            raise ValueError(f"--golden-streamed with --golden-device {opts.golden_device}: the streamed golden "
                             "runs on the host (a layer at a time from the checkpoint); give --golden-device cpu")
        golden = "cpu"  # the streamed golden is a host golden (recorded in the result's meta.devices)
        logger.info("tpcheck diff: --golden-streamed: the golden and the references run on the host")
    return device, golden


def _check_pipeline(opts: DiffOptions, cfg) -> None:
    """``--pp`` / ``--pp-partition`` on impl or vLLM, a partition of this model's layers (``impl.pipeline``; vLLM's
    own split is checked against it once its ranks have loaded: ``tpcheck.engines.vllm.adapter.start``)."""
    if opts.pp == 1 and opts.pp_partition is None:
        return
    if opts.engine not in ("impl", "vllm"):
        raise ValueError(f"--pp {opts.pp} applies to --engine impl and vllm only (not {opts.engine})")
    if opts.dump is not None:  # each rank writes rank{tp rank}/: the stages' ranks would share directories
        raise ValueError(f"--dump with --pp {opts.pp} is not supported (a dump is per TP rank of one stage)")
    try:
        layer_partition(cfg.num_layers, opts.pp, opts.pp_partition)
    except ConfigError as e:
        raise ValueError(f"--pp {opts.pp}" + (f" --pp-partition {opts.pp_partition}" if opts.pp_partition else "")
                         + f": {e}") from None


def _prompts(opts: DiffOptions, cfg) -> list[list[int]]:
    """The prompts' token ids (random ones from ``seq_len``/``batch``/``seed`` when none are given), checked
    (``--decode-steps`` itself was, by ``DiffOptions.validate``)."""
    prompts = [list(p) for p in opts.prompts] if opts.prompts else \
        random_prompts(cfg.vocab_size, opts.batch, opts.seq_len, opts.seed)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocab [0, {cfg.vocab_size})")
        if len(p) + opts.decode_steps > cfg.max_position:
            raise ValueError(f"prompt {i}: {len(p)} tokens + {opts.decode_steps} decode steps exceed "
                             f"max_position_embeddings={cfg.max_position}")
    return prompts


def _silent_faults(opts: DiffOptions, cfg) -> dict[str, str]:
    """The injected faults that cannot show in this run, and why (a warning each)."""
    silent = {}
    for name in opts.inject:
        why = get_fault(name).silent_because(cfg, opts.tp, opts.dtype, opts.decode_steps, opts.exact_ops,
                                             prompt_lens=[len(p) for p in opts.prompts],
                                             block_size=opts.block_size, layer=opts.inject_layer, pp=opts.pp)
        if why:
            silent[name] = why
            logger.warning(f"tpcheck diff: note: {name} {why}; expect this run to pass")
    return silent
