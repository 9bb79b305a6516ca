"""Faults of mixture-of-experts layers (``impl.layers.moe``): the routing bugs TP / EP engines make (router
precision, top-k renormalisation, the shared expert's gate, an expert offset on one rank, a double reduction,
weights combined with the wrong experts). Each patches only sparse layers (a dense layer of the same model is left
alone) and shows only on a model with MoE layers, so the fault matrix runs it on the first MoE preset of
``tpcheck.cli.fault_matrix.PRESET_ORDER`` where it can show."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.distributed import all_reduce
from impl.layers.moe import SparseMoeBlock
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault


def _sparse(cfg, plan, dtype) -> bool:
    return getattr(cfg, "moe", None) is not None


def _sparse_float32(cfg, plan, dtype) -> bool:
    return _sparse(cfg, plan, dtype) and dtype == "float32"


def _renormalized(cfg, plan, dtype) -> bool:
    return _sparse(cfg, plan, dtype) and cfg.moe.renormalize


def _shared(cfg, plan, dtype) -> bool:
    return _sparse(cfg, plan, dtype) and cfg.moe.shared_expert_intermediate_size > 0


def _shared_tp(cfg, plan, dtype) -> bool:
    return _shared(cfg, plan, dtype) and plan.tp > 1


def _sparse_tp(cfg, plan, dtype) -> bool:
    return _sparse(cfg, plan, dtype) and plan.tp > 1


def _several(cfg, plan, dtype) -> bool:
    return _sparse(cfg, plan, dtype) and cfg.moe.top_k > 1


def _block(layer, name: str, module: str = "") -> SparseMoeBlock | None:
    """The layer's MoE block when it is one and ``name`` is not yet applied to it (or to its ``module``)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, SparseMoeBlock):
        return None
    return mlp if mark(getattr(mlp, module) if module else mlp, name) else None


@fault(24, "moe_router_low_precision",
       "MoE router computed in bfloat16 under float32 activations (the logits rounded to 8 bits before the softmax)",
       shows_when="MoE models in float32", expected_origin="layers.{layer}.moe.router", shows=_sparse_float32, sparse_only=True)
def moe_router_low_precision(runner, i, layer):
    mlp = _block(layer, "moe_router_low_precision", "gate")
    if mlp is None:
        return
    gate = mlp.gate
    gate.forward = lambda x: F.linear(x.bfloat16(), gate.weight.bfloat16()).to(x.dtype)


@fault(25, "moe_topk_not_renormalized",
       "top-k weights not renormalised to sum 1 although the config says so (norm_topk_prob; Mixtral always)",
       shows_when="MoE models that renormalise the top-k weights", expected_origin="layers.{layer}.moe.topk_weights",
       shows=_renormalized, sparse_only=True)
def moe_topk_not_renormalized(runner, i, layer):
    mlp = _block(layer, "moe_topk_not_renormalized", "topk")
    if mlp is not None:
        mlp.topk.renormalize = False


@fault(26, "moe_shared_gate_skipped",
       "the shared expert added without its sigmoid gate (shared_expert_gate computed, then forgotten)",
       shows_when="MoE models with a shared expert (Qwen2-MoE)", expected_origin="layers.{layer}.mlp.out",
       shows=_shared, sparse_only=True)
def moe_shared_gate_skipped(runner, i, layer):
    mlp = _block(layer, "moe_shared_gate_skipped")
    if mlp is None or mlp.shared_expert is None:
        return

    def forward(x):
        topk_weights, topk_ids = mlp.topk(mlp.gate(x))
        mlp.shared_expert_gate(x)  # computed (its point is reported), never applied
        return all_reduce(mlp.experts(x, topk_weights, topk_ids) + mlp.shared_expert(x))

    mlp.forward = forward


@fault(27, "moe_expert_offset_wrong",
       "the last rank maps a global expert id to the wrong local expert (off by one within its experts): tokens "
       "routed to expert e get e+1's weights there",
       shows_when="MoE models at tp > 1 (TP or EP)", expected_origin="layers.{layer}.moe.experts", shows=_sparse_tp, sparse_only=True)
def moe_expert_offset_wrong(runner, i, layer):
    mlp = _block(layer, "moe_expert_offset_wrong", "experts")
    if mlp is None or runner.rank != runner.tp_size - 1:
        return
    ex = mlp.experts
    orig = ex.forward
    start, n = ex.expert_start, ex.num_local_experts

    def forward(hidden, topk_weights, topk_ids):
        local = topk_ids - start
        mine = (local >= 0) & (local < n)
        return orig(hidden, topk_weights, torch.where(mine, start + (local + 1) % n, topk_ids))

    ex.forward = forward


@fault(28, "moe_experts_reduced_twice",
       "the experts' partial outputs all-reduced inside the experts and again by the block (tp times the output)",
       shows_when="MoE models at tp > 1", expected_origin="layers.{layer}.moe.experts", shows=_sparse_tp, sparse_only=True)
def moe_experts_reduced_twice(runner, i, layer):
    mlp = _block(layer, "moe_experts_reduced_twice", "experts")
    if mlp is None:
        return
    orig = mlp.experts.forward
    mlp.experts.forward = lambda hidden, w, ids: all_reduce(orig(hidden, w, ids))


@fault(29, "moe_wrong_combine_weights",
       "each token's expert outputs combined with the top-k weights in reverse slot order (weight of the k-th "
       "choice on the first)", shows_when="MoE models with top-k > 1", expected_origin="layers.{layer}.moe.experts",
       shows=_several, sparse_only=True)
def moe_wrong_combine_weights(runner, i, layer):
    mlp = _block(layer, "moe_wrong_combine_weights", "experts")
    if mlp is None:
        return
    orig = mlp.experts.forward
    mlp.experts.forward = lambda hidden, w, ids: orig(hidden, w.flip(-1), ids)


@fault(31, "moe_shared_gate_reduced",
       "the shared expert's gate logit (a replicated linear) all-reduced as if row-parallel: tp times the logit "
       "(doubled at tp 2) before its sigmoid", shows_when="MoE models with a shared expert (Qwen2-MoE) at tp > 1",
       expected_origin="layers.{layer}.moe.shared_gate", shows=_shared_tp, sparse_only=True)
def moe_shared_gate_reduced(runner, i, layer):
    if getattr(getattr(layer, "mlp", None), "shared_expert_gate", None) is None:
        return
    mlp = _block(layer, "moe_shared_gate_reduced", "shared_expert_gate")
    if mlp is None:
        return
    gate = mlp.shared_expert_gate
    orig = gate.forward
    gate.forward = lambda x: all_reduce(orig(x))
