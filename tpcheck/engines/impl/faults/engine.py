"""Applying faults to a live impl engine: ``apply`` / ``describe`` run inside each rank (through
``LLM.call("tpcheck.engines.impl.faults:apply", ...)``); ``inject`` / ``restore`` / ``injected`` drive an ``impl.LLM``."""
from __future__ import annotations

import contextlib
import functools
import types

from tpcheck.engines.impl.faults.patching import mark, marks
from tpcheck.engines.impl.faults.registry import get_fault

APPLY = "tpcheck.engines.impl.faults:apply"
_OVERRIDE_TYPES = (types.FunctionType, types.MethodType, functools.partial)


# ---- worker side (through LLM.call) --------------------------------------------------------------------

def apply(runner, names: list[str] | str, layer: int | None = None) -> list[str]:
    """Inject faults into this rank's loaded model: every decoder layer (``layer`` None) or only
    ``runner.model.model.layers[layer]``; layer-independent faults ignore ``layer``. Returns the names
    applied. Run on every rank: ``llm.call("tpcheck.engines.impl.faults:apply", ["rope_skipped"], 1)``.
    Undo by reloading the runner (``llm.reload()``).

    The driver's prefix cache is not the rank's to clear: after a plain ``llm.call`` a request sharing a
    full block with an earlier one reuses KV the clean model wrote (for ``gqa_cache_repeated_heads``,
    zeros: the cache is re-allocated). ``inject`` / ``injected`` reset it; use them for ``generate``."""
    names = [names] if isinstance(names, str) else list(names)
    faults = [get_fault(n) for n in names]  # validate all before touching anything
    layers = runner.model.model.layers
    if layer is not None and not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(layers)} decoder layers")
    idx = list(range(len(layers))) if layer is None else [layer % len(layers)]
    idx = [i for i in idx if runner.stage.holds_layer(i)]  # a pipeline stage patches only the layers it runs
    for f in faults:
        if f.per_layer:
            for i in idx:
                f.patch(runner, i, layers[i])
        else:
            f.patch(runner, None, None)
            mark(runner.model, f.name)
    return names


def describe(runner) -> dict:
    """What this rank carries, for checking that a fault landed where it was aimed:

    * ``model``: faults marked on the model itself (layer-independent ones);
    * ``layers``: per decoder layer, the fault names marked on its modules;
    * ``overrides``: per decoder layer, the instance-level method overrides on its modules
      (``"self_attn.rotary_emb.forward"``): a clean layer has none;
    * ``kv_heads``: per attention layer, the head count of its KV cache (None before allocation)."""
    layers, overrides = [], []
    for layer in runner.model.model.layers:
        found, over = [], []
        for mname, m in layer.named_modules():
            found += [n for n in marks(m) if n not in found]
            over += [f"{mname}.{a}".lstrip(".") for a, v in vars(m).items() if isinstance(v, _OVERRIDE_TYPES)]
        layers.append(found)
        overrides.append(over)
    return {"model": marks(runner.model), "layers": layers, "overrides": overrides,
            "kv_heads": [int(a.k_cache.shape[2]) if a.k_cache.dim() == 4 else None
                         for a in runner.attention_layers()]}


# ---- driver side (an impl.LLM) ---------------------------------------------------------------------------

def inject(llm, names: list[str] | str, layer: int | None = None) -> list[list[str]]:
    """``apply`` on every rank of ``llm``, then forget the driver's prefix cache: its blocks were computed by
    the clean model (and ``gqa_cache_repeated_heads`` re-allocates the cache, zeroing them), so a request
    sharing a prefix with an earlier one would otherwise reuse them. Returns the per-rank results."""
    out = llm.call(APPLY, names, layer)
    llm.reset_scheduler()
    return out


def restore(llm) -> None:
    """Reload every rank's runner, dropping all faults; checkpoint, dtype and cache layout unchanged."""
    llm.reload()


@contextlib.contextmanager
def injected(llm, names: list[str] | str, layer: int | None = None):
    """``with injected(llm, ["rope_skipped"]): ...`` — the faults are live inside, the engine clean after."""
    try:
        inject(llm, names, layer)
        yield llm
    finally:
        if not llm.executor.closed:
            restore(llm)
