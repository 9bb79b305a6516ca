"""Named, injectable tensor-parallel bugs, applied inside the rank workers of a live impl engine.

Each fault is declared once, beside its patch, with ``@fault(...)`` (``registry``); the modules group them
by where they strike: ``loading``, ``attention``, ``collectives``, ``kv_cache``, ``norm``, ``quant`` (the
scales of quantized linears; ``quant_kv``: an FP8 KV cache's), ``moe`` and ``families``
(what the families beyond Qwen2 add: q/k norms, llama3 RoPE, biases, sliding windows), ``gemma`` (Gemma 3's ``1 + w``
norms, its two RoPE bases, its window's edge), ``invariance`` (a request's bits changed by its batch only: found by
``tpcheck invariance``). Applying them:
``engine`` (``apply`` in a rank, ``inject`` / ``injected`` / ``restore`` from the driver). How faults
work, how to add one, and what cannot be injected: docs/faults.md.

    from tpcheck.engines.impl import faults
    with faults.injected(llm, ["rope_skipped"], layer=1): ...
    llm.call("tpcheck.engines.impl.faults:apply", ["gate_up_swapped"])   # every rank, every decoder layer
"""
from __future__ import annotations

# the fault modules register their faults on import (order: their catalogue numbers)
from tpcheck.engines.impl.faults import attention, collectives, families, kv_cache, loading, moe, norm, quant  # noqa: F401
from tpcheck.engines.impl.faults import quant_gptq  # noqa: F401
from tpcheck.engines.impl.faults import quant_awq  # noqa: F401,I001 (after quant_gptq: catalogue order)
from tpcheck.engines.impl.faults import pipeline  # noqa: F401,I001 (after quant_awq: catalogue order)
from tpcheck.engines.impl.faults import quant_kv  # noqa: F401,I001 (after pipeline: catalogue order)
from tpcheck.engines.impl.faults import gemma  # noqa: F401,I001 (after quant_kv: catalogue order)
from tpcheck.engines.impl.faults import invariance  # noqa: F401,I001 (after gemma: catalogue order)
from tpcheck.engines.impl.faults.attention import DEFAULT_ROPE_THETA
from tpcheck.engines.impl.faults.collectives import LOW_PRECISION_REDUCE
from tpcheck.engines.impl.faults.engine import apply, describe, inject, injected, restore
from tpcheck.engines.impl.faults.patching import MARK
from tpcheck.engines.impl.faults.registry import FAULTS, Fault, applicable, block_boundary_step, fault, fault_names, get_fault

__all__ = ["DEFAULT_ROPE_THETA", "FAULTS", "Fault", "LOW_PRECISION_REDUCE", "MARK", "applicable", "apply",
           "block_boundary_step", "describe", "fault", "fault_names", "get_fault", "inject", "injected", "restore"]
