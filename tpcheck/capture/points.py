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
    "kv.k", "kv.v", "attn.context", "attn.out", "attn.residual", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act",
    "mlp.out", "out",
)
KV_POINTS = ("kv.k", "kv.v")
QK_NORM_POINTS = ("attn.q_norm", "attn.k_norm")  # per-head q/k norms: models with ModelConfig.qk_norm only
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def point_names(num_layers: int, with_kv: bool = False, qk_norm: bool = False) -> list[str]:
    """The points of a model of ``num_layers`` decoder layers, in execution order. ``with_kv``: the KV-cache
    points too (a run with decode steps reads the cache back); ``qk_norm``: the model normalises q and k per
    head before RoPE (``ModelConfig.qk_norm``), so it has ``attn.q_norm`` / ``attn.k_norm``. The default is
    a model without them (Qwen2, Llama, Mistral): every point such a model has, and no other."""
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in LAYER_POINTS
                  if (with_kv or p not in KV_POINTS) and (qk_norm or p not in QK_NORM_POINTS)]
    return names + ["final_norm", "logits"]


def model_point_names(cfg: ModelConfig, with_kv: bool = False) -> list[str]:
    """``point_names`` of the model ``cfg`` describes (its layer count and family options)."""
    return point_names(cfg.num_layers, with_kv, qk_norm=cfg.qk_norm)


def all_point_names(num_layers: int) -> list[str]:
    """Every canonical name of a ``num_layers``-layer model of any family, in execution order: what a reported
    or mapped name is checked against (a name outside it is a misconfigured map)."""
    return point_names(num_layers, with_kv=True, qk_norm=True)


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
