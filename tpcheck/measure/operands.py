"""The operand scale of a narrow point that is a linear map of another point: what its legitimate rounding is
proportional to (``tpcheck.judge.noise_floor``, narrow points).

A logit ``z_j = w_j . x`` rounded anywhere (the dot product's accumulation, x's own rounding upstream, a TP split)
is off by ``sum_i w_ji dx_i + ...``, terms of random sign whose size is ``u sqrt(sum_i w_ji^2 x_i^2)``: set by the
operands, not by z, which can be near zero for one token. ``operand_sq`` returns, per row r,
``sigma_r^2 = sum_j sum_i w_ji^2 x_ri^2``: its expectation is ``||z_r||^2`` over random signs, so it is the row's
squared norm on a scale that does not vanish with one element. Known maps (Qwen2-MoE's shared-expert gate, every
MoE router: the post-attention RMSNorm's output times the module's weight, ``model.layers.{i}.<module>.weight`` in
Hugging Face's model); a point without one, or a golden without its input (a saved golden that did not keep it),
falls back to the golden's own row norms."""
from __future__ import annotations

import torch
from torch import nn

from tpcheck.capture.points import split_point

# narrow point kind -> (the point kind of its input, the HF module under model.layers.{i} whose weight maps it)
LINEAR_INPUTS = {"moe.shared_gate": ("post_attn_norm", "mlp.shared_expert_gate"),
                 "moe.router": ("post_attn_norm", "mlp.gate")}
INPUT_KINDS = frozenset(k for k, _ in LINEAR_INPUTS.values())


def operand_sq(model: nn.Module | None, point: str, gold: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``[rows]`` float64: ``sigma_r^2`` of ``point``'s rows (module docstring), from the golden's input of that
    point and ``model``'s weight; None where the point has no known linear map or either operand is missing."""
    layer, kind = split_point(point)
    spec = LINEAR_INPUTS.get(kind)
    if spec is None or layer is None or model is None:
        return None
    x = gold.get(f"layers.{layer}.{spec[0]}")
    try:
        w = model.get_submodule(f"model.layers.{layer}.{spec[1]}").weight
    except AttributeError:
        return None
    if x is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or x.shape[-1] != w.shape[-1]:
        return None
    return x.detach().to(torch.float64).pow(2) @ w.detach().to(torch.float64).pow(2).sum(0)
