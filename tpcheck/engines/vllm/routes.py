"""The experts vLLM chose, as a module the capture can hook: ``attach_route_probes``.

vLLM's ``FusedMoE`` (0.32: ``MoERunner``, the sparse block's ``mlp.experts``) routes through a ``FusedMoERouter``
object, not a module: on the modular path (the CPU backend's ``CPUUnquantizedExperts``, Triton, ...) the runner
calls ``self.router.select_experts(hidden_states=, router_logits=, topk_indices_dtype=, input_ids=)``, which returns
``(topk_weights [T, k], topk_ids [T, k])`` (the CPU router: ``torch.topk`` of the router logits in the model's
dtype, unsorted; weights the softmax of the k chosen logits when the config renormalises, else each chosen logit's
softmax probability over all experts, float32), and hands them to the experts kernel. Those are the ids the kernel
uses, so they are captured, not recomputed from the logits: ``RouteProbe`` is an ``nn.Module`` wrapping the
router's own bound ``select_experts``; the router instance's ``select_experts`` is replaced by the probe, so the
runner's call goes through the module, its forward hooks (``VLLM_MAP``: ``mlp.route_probe`` ->
``moe.topk_weights``, ``moe.topk_ids``) see exactly what the kernel gets, and a forward pre-hook can change what
the selection sees on one rank (``vllm.worker.VLLM_FAULTS["route-expert-raised"]``).

The ids are the router's logical (global) expert ids: vLLM maps them to physical ids after ``_compute_routing``
only with EPLB, inside ``_select_experts``, whose result the probe returns unchanged; ``tpcheck.pipeline.routes``
reads them as global ids. Every rank routes the same replicated logits, so the points are ``Replicate()``
(ranks that disagree are a structural finding). A monolithic kernel (routing inside one fused op: the zentorch
and ARM W4A8 paths) never calls ``select_experts``: no probe there, and the run reports no ``moe.topk_ids``."""
from __future__ import annotations

import torch
from torch import nn


class RouteProbe(nn.Module):
    """vLLM's expert selection of one MoE layer, as a module: ``forward`` calls the router's own
    ``select_experts`` and returns its ``(topk_weights, topk_ids)`` unchanged."""

    def __init__(self, select) -> None:
        super().__init__()
        self._select = select  # the router's bound method (not a module: kept out of named_modules)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                topk_indices_dtype: torch.dtype | None = None, *,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select(hidden_states, router_logits, topk_indices_dtype, input_ids=input_ids)


def attach_route_probes(model: nn.Module) -> list[int]:
    """Give each sparse decoder layer of a vLLM model (``model.model.layers[i].mlp.experts.router``) a
    ``mlp.route_probe`` (``RouteProbe``) through which its router's ``select_experts`` is called; idempotent.
    Must run before ``tpcheck.capture.install`` (the capture hooks the modules it finds). Returns the layers
    probed."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    probed = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        router = getattr(getattr(mlp, "experts", None), "router", None)
        if router is None or not callable(getattr(router, "select_experts", None)):
            continue  # a dense layer, or a FusedMoE without a router object
        if not isinstance(getattr(mlp, "route_probe", None), RouteProbe):
            if hasattr(mlp, "route_probe"):
                raise RuntimeError(f"tpcheck: layer {i}'s mlp already has an attribute route_probe "
                                   f"({type(mlp.route_probe).__name__}): the route capture cannot attach")
            mlp.route_probe = RouteProbe(router.select_experts)
            router.select_experts = mlp.route_probe  # the instance attribute shadows the method
        probed.append(i)
    return probed


def raise_expert(module: RouteProbe, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook of a ``RouteProbe`` (a seeded fault): the selection sees expert 0's logit raised above
    every token's largest, so every token of that rank picks expert 0; the router's output (``moe.router``) and
    the other ranks are untouched."""
    logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
    if logits is None:
        raise RuntimeError("tpcheck: route-expert-raised: select_experts was called without router_logits")
    logits = logits.clone()
    logits[:, 0] = logits.max(dim=-1).values + 1
    if "router_logits" in kwargs:
        return args, dict(kwargs, router_logits=logits)
    return (args[0], logits, *args[2:]), kwargs
