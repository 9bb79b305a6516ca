"""Canonical hook points: one name per point, the same for Hugging Face and the engine, in execution order.

Every point's tensor is laid out ``[rows, features]``: rows are the step's tokens of all prompts
concatenated (prompt 0's tokens first), features the hidden / head dims flattened (heads major). For the
KV-cache points (``layers.{i}.kv.k|v``) rows are every cached position of every prompt."""
from __future__ import annotations

import re

LAYER_POINTS = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_rope", "attn.k_rope", "kv.k", "kv.v", "attn.context",
    "attn.out", "attn.residual", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.out", "out",
)
KV_POINTS = ("kv.k", "kv.v")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def point_names(num_layers: int, with_kv: bool = False) -> list[str]:
    names = ["embed"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in LAYER_POINTS if with_kv or p not in KV_POINTS]
    return names + ["final_norm", "logits"]


def split_point(name: str) -> tuple[int | None, str]:
    """``layers.3.attn.q`` -> ``(3, "attn.q")``; ``logits`` -> ``(None, "logits")``. The second part is the
    point's *kind*, the key for per-kind tolerances."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)
