"""The faults ``tpcheck.engines.vllm.worker.TPCheckWorker`` applies inside one vLLM rank, by name (``VLLM_FAULTS``):
tensor-parallel ones on a decoder layer's modules, a mixture-of-experts route, quantization scales
(``tpcheck.engines.vllm.quant_faults``); the pipeline's (``tpcheck.engines.vllm.pp``) act on a stage boundary."""
from __future__ import annotations

from tpcheck.engines.vllm.stages import stage_range
from tpcheck.engines.vllm.routes import raise_expert
from tpcheck.engines.vllm.pp import VLLM_PP_FAULTS, apply_pp_fault
from tpcheck.engines.vllm.quant_faults import QUANT_FAULTS

# ---------------------------------------------------------------- faults, applied inside one rank

class ScaledGemm:
    """A linear layer's ``quant_method`` whose ``apply`` (the rank's own GEMM, before any all-reduce) is
    scaled by ``scale``; everything else is the wrapped method's."""

    def __init__(self, inner, scale: float):
        self._inner, self._scale = inner, scale

    def apply(self, layer, x, bias=None):
        return self._inner.apply(layer, x, bias) * self._scale

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _swap_q_heads(module, args, out):
    t = out[0] if isinstance(out, tuple) else out
    q = module.output_partition_sizes[0]
    d = module.head_size
    if q >= 2 * d:  # the rank's first two query heads trade places
        a, b = t[..., :d].clone(), t[..., d:2 * d].clone()
        t[..., :d], t[..., d:2 * d] = b, a
    return out


def _shift_k(module, args, kwargs):
    args = list(args)
    args[1] = args[1] + 0.5
    return tuple(args), kwargs


def _zero_up(module, args, out):
    t = out[0] if isinstance(out, tuple) else out
    g = module.output_partition_sizes[0]
    t[..., g:] = 0
    return out


# name -> (submodule of decoder layer, how): "gemm" scales the GEMM's output by the value, "hook" registers a
# forward hook, "prehook" a forward pre-hook (both ahead of the capture's own hooks)
VLLM_FAULTS = {
    "o-proj-partial": ("self_attn.o_proj", "gemm", 1.5),      # a rank's o_proj partial sum off: attn.out
    "down-proj-partial": ("mlp.down_proj", "gemm", 0.0),      # a rank's down_proj partial dropped: mlp.out
    "qkv-head-swap": ("self_attn.qkv_proj", "hook", _swap_q_heads),  # two query heads swapped: attn.q
    "k-rope-shift": ("self_attn.attn", "prehook", _shift_k),  # the key reaching attention shifted: attn.k_rope
    "gate-up-up-zero": ("mlp.gate_up_proj", "hook", _zero_up),  # a rank's up half zeroed: mlp.up
    # MoE: expert 0 chosen by every token of the rank (moe.topk_ids), the router logits themselves unchanged
    "route-expert-raised": ("mlp.route_probe", "prehook", raise_expert),
}
# "param": a quantized layer's live scale changed in place; the fault returns its undo
VLLM_FAULTS.update(QUANT_FAULTS)


def apply_fault(model, worker, name: str, layer: int) -> list[tuple[str, object]]:
    """Fault ``name`` (``VLLM_FAULTS``, or a pipeline one of ``tpcheck.engines.vllm.pp.VLLM_PP_FAULTS``) applied to
    decoder layer ``layer`` of this rank's ``model`` (none where the layer is another pipeline stage's); what
    ``undo_faults`` takes to undo it. ``worker``: the vLLM worker (a quantization scale fault reads its device)."""
    if name in VLLM_PP_FAULTS:  # a stage boundary's, on the side it acts on
        return apply_pp_fault(model, name, layer)
    if name not in VLLM_FAULTS:
        raise ValueError(f"unknown vLLM fault {name!r}; known: {', '.join([*VLLM_FAULTS, *VLLM_PP_FAULTS])}")
    if layer not in range(*stage_range(model)):  # another pipeline stage's layer
        return []
    path, how, what = VLLM_FAULTS[name]
    mod = model.model.layers[layer].get_submodule(path)
    if how == "gemm":
        mod.quant_method = ScaledGemm(mod.quant_method, what)
        return [("gemm", mod)]
    if how == "param":
        return [("undo", what(mod, worker))]
    if how == "hook":
        return [("handle", mod.register_forward_hook(what, prepend=True))]
    return [("handle", mod.register_forward_pre_hook(what, prepend=True, with_kwargs=True))]


def undo_faults(applied: list[tuple[str, object]]) -> None:
    """Undo what ``apply_fault`` returned."""
    for kind, obj in applied:
        if kind == "gemm":
            obj.quant_method = obj.quant_method._inner
        elif kind == "undo":
            obj()
        else:
            obj.remove()
