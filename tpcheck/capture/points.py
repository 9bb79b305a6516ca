"""Canonical hook points: one name per point, the same for Hugging Face and the engine, in execution order.

Every point's tensor is laid out ``[rows, features]``: rows are the step's tokens of all prompts
concatenated (prompt 0's tokens first), features the hidden / head dims flattened (heads major). For the
KV-cache points (``layers.{i}.kv.k|v``) rows are every cached position of every prompt.

Some points exist only in some model families: ``attn.q_norm`` / ``attn.k_norm`` (``QK_NORM_POINTS``) are
the outputs of the per-head RMSNorms of q and k, before RoPE, of models with ``ModelConfig.qk_norm``
(Qwen3). ``point_names`` lists a model's points (``model_point_names(cfg)`` reads the flags from its
config); ``all_point_names`` every name tpcheck knows, whatever the model (what a name map is checked
against)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impl.config import ModelConfig

LAYER_POINTS = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope",
    "kv.k", "kv.v", "attn.context", "attn.out", "attn.residual", "post_attn_norm",
    "moe.router", "moe.topk_ids", "moe.topk_weights", "moe.experts", "moe.shared", "moe.shared_gate",
    "mlp.gate", "mlp.up", "mlp.act", "mlp.out", "out",
)
KV_POINTS = ("kv.k", "kv.v")
QK_NORM_POINTS = ("attn.q_norm", "attn.k_norm")  # per-head q/k norms: models with ModelConfig.qk_norm only
DENSE_MLP_POINTS = ("mlp.gate", "mlp.up", "mlp.act")  # a dense MLP's inside (a sparse layer has MOE_POINTS)
# a mixture-of-experts layer: router logits [rows, E], the chosen experts [rows, k] (ids, judged as a set per
# token: tpcheck.judge.routing) and their weights [rows, k] (in ascending expert id order), the routed experts'
# weighted sum [rows, hidden], and (Qwen2-MoE) the shared expert's output and its gate logit [rows, 1]
MOE_POINTS = ("moe.router", "moe.topk_ids", "moe.topk_weights", "moe.experts", "moe.shared", "moe.shared_gate")
SHARED_POINTS = ("moe.shared", "moe.shared_gate")
ROUTED_POINTS = ("moe.topk_weights", "moe.experts", "mlp.out", "out")  # what a token's route decides, per layer
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def point_names(num_layers: int, with_kv: bool = False, qk_norm: bool = False, sparse=(),
                shared: bool = False, every: bool = False) -> list[str]:
    """The points of a model of ``num_layers`` decoder layers, in execution order. ``with_kv``: the KV-cache
    points too (a run with decode steps reads the cache back); ``qk_norm``: the model normalises q and k per
    head before RoPE (``ModelConfig.qk_norm``), so it has ``attn.q_norm`` / ``attn.k_norm``; ``sparse``: the
    layers that are mixture-of-experts blocks (``MOE_POINTS`` instead of ``DENSE_MLP_POINTS``), ``shared``:
    those have a shared expert; ``every``: every name of every kind of layer. The default is a dense model
    without q/k norms (Qwen2, Llama, Mistral): every point such a model has, and no other."""
    names = ["embed"]
    for i in range(num_layers):
        moe = i in sparse
        names += [f"layers.{i}.{p}" for p in LAYER_POINTS
                  if (with_kv or p not in KV_POINTS) and (qk_norm or p not in QK_NORM_POINTS) and
                  (every or (p not in MOE_POINTS if not moe else p not in DENSE_MLP_POINTS and
                                                                 (shared or p not in SHARED_POINTS)))]
    return names + ["final_norm", "logits"]


def model_point_names(cfg: ModelConfig, with_kv: bool = False) -> list[str]:
    """``point_names`` of the model ``cfg`` describes (its layer count and family options)."""
    moe = getattr(cfg, "moe", None)
    sparse = () if moe is None else {i for i in range(cfg.num_layers) if cfg.is_sparse(i)}
    return point_names(cfg.num_layers, with_kv, qk_norm=cfg.qk_norm, sparse=sparse,
                       shared=moe is not None and moe.shared_expert_intermediate_size > 0)


def all_point_names(num_layers: int) -> list[str]:
    """Every canonical name of a ``num_layers``-layer model of any family, in execution order: what a reported
    or mapped name is checked against (a name outside it is a misconfigured map)."""
    return point_names(num_layers, with_kv=True, qk_norm=True, every=True)


def point_order(name: str) -> int:
    """A number that sorts point names in execution order (``embed``, each layer's points in ``LAYER_POINTS``
    order, ``final_norm``, ``logits``): the same in every pass of a run, whatever the model."""
    layer, kind = split_point(name)
    if layer is None:
        return {"embed": -1}.get(kind, 10**9 + (kind == "logits"))
    return layer * 1000 + (LAYER_POINTS.index(kind) if kind in LAYER_POINTS else len(LAYER_POINTS))


def split_point(name: str) -> tuple[int | None, str]:
    """``layers.3.attn.q`` -> ``(3, "attn.q")``; ``logits`` -> ``(None, "logits")``. The second part is the
    point's *kind*, the key for per-kind tolerances."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)
