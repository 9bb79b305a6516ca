"""A mixture-of-experts layer's ops recomputed in float64 on the engine's own inputs (``tpcheck.measure.own_input``'s
``own_err``), with what a correct kernel may add to each: the router, the routed experts' weighted sum, the shared
expert and its gate (Qwen2-MoE), and the block's output.

Without them an error a sparse layer's output inherits (its input norm within its floor, the experts right on what
they were given) failed where it landed, naming correct code, as attention's did before its ops. Each op reads the
engine's points of the same step (``INPUTS``), so a wrong route is judged at ``moe.topk_ids`` (its own rule) and a
wrong expert, weight or shard at the op that computes it.

**The routed experts** (``moe.experts``), per token t with the engine's ids ``e_1..e_k`` and weights ``w_1..w_k``:
``y(t) = sum_j w_j down_{e_j}(act(gate_{e_j} x) * up_{e_j} x)``. A fused kernel exposes none of the expert's
intermediates, so the op is the whole chain and its allowance ``B`` the roundings a correct kernel may make inside
it, each propagated to the output as an absolute bound per element:

* ``g = gate x``, ``v = up x``: the accumulation of H products in any order (``metrics.dot_allowance``), then the
  output's rounding ``u |g|``: ``dg``, ``dv``;
* ``h = act(g) * v``: ``dh = |act'(g)| dg |v| + |act(g)| dv`` plus two roundings (the activation's, the product's),
  ``2 u |h|``;
* ``y_e = down h``: the accumulation over I products (``dot_allowance``; at tp > 1 each rank's partial over its
  slice of I rounded and summed, ``(tp - 1) u_red`` of the same scale, as a row-parallel linear), and h's error
  carried through ``down``: its parts (g's and v's accumulation and rounding through ``act'`` and the product, the
  activation's and the product's roundings) are independent with random sign, so by the accumulation's
  probabilistic bound, ``lambda sqrt(sum_i down_i^2 var(dh_i))`` (an accumulation bound counts as ``lambda``
  deviations, a rounding of ``u |z|`` as a uniform one, ``(u z)^2 / 3``), then the output's rounding ``u |y_e|``;
* the weighting and the sum over the k slots: ``|w_j| dy_e + 2 u |w_j y_e|`` (the weight as the kernel holds it, the
  product's rounding), summed over j.

Measured (``benchmarks/moe_own_op.py``): ``||B|| / ||y||`` ~5% in bfloat16 (the references' own error there ~1%),
~1.2e-5 in float32 (~3.4e-7). A wrong expert, weight or shard errs by its whole size (tens of percent) and a scale
by its gain (``own_gain``); a noise-like error inside the experts under ~2x the point's threshold in bfloat16, ~3.5x
in float32, on inputs within their floors, reads as inherited.

**The shared expert** (``moe.shared``) is the same chain with one weight of 1; its gate (``moe.shared_gate``) and the
router (``moe.router``) are linear ops of the layer's normed input, allowed their accumulation. **The block's output**
(``mlp.out``) is ``experts + sigmoid(shared_gate) * shared`` (the sigmoid's and the product's roundings, ``2 u``) or
the experts' sum itself; at tp > 1 each rank combines its partial sums (a product and a sum) and the all-reduce adds
them, so ``(2 tp u + (tp - 1) u_red)`` of the partials' scale (``down``'s, weighted: the ranks' partials may cancel,
and the unsharded inputs do not show them: measured, impl's tp 2 and 4 err up to 29 u of the result there)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tpcheck.measure.metrics import LAMBDA, dot_allowance, unit_roundoff

#: point kind -> the points (of the same layer) its op reads in a sparse layer (``mlp.out``: ``block_inputs``)
INPUTS: dict[str, tuple[str, ...]] = {
    "moe.router": ("post_attn_norm",), "moe.shared": ("post_attn_norm",), "moe.shared_gate": ("post_attn_norm",),
    "moe.experts": ("post_attn_norm", "moe.topk_ids", "moe.topk_weights"),
}
KINDS = (*INPUTS, "mlp.out")


def block_inputs(shared: bool) -> tuple[str, ...]:
    """The points a sparse block's output (``mlp.out``) is made of."""
    return ("moe.experts", "moe.shared_gate", "moe.shared") if shared else ("moe.experts",)


def sparse_block(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's mixture-of-experts block (``mlp``, transformers 5: the MoE families need it), or None for
    a dense layer."""
    block = getattr(layer, "mlp", None)
    return block if hasattr(block, "experts") else None


def layer_kind(model: nn.Module | None, layer: int | None) -> str:
    """``"shared"`` (a sparse layer with a shared expert), ``"moe"`` (sparse) or ``""`` (dense, or no model)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layer is None or not layers or layer >= len(layers):
        return ""
    block = sparse_block(layers[layer])
    if block is None:
        return ""
    return "shared" if getattr(block, "shared_expert", None) is not None else "moe"


_PLAIN = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weights(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in _PLAIN or t.device.type == "meta":
        raise KeyError("expert weights")  # a quantized (FP8: scales elsewhere) or offloaded weight: not redone here
    return t.detach().double()


def _expert(experts: nn.Module, e: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s (gate, up, down) weights, ``[I, H]``, ``[I, H]``, ``[H, I]``, from transformers 5's fused 3-D
    parameters (``gate_up_proj [E, 2I, H]``, gate first; ``down_proj [E, H, I]``). A KeyError for another layout."""
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise KeyError("experts layout")
    gate, up = _weights(gu[e]).chunk(2, dim=0)
    down = _weights(down[e])
    if gate.shape[-1] != hidden or down.shape != (hidden, gate.shape[0]):
        raise KeyError("expert shapes")
    return gate, up, down


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    act = getattr(module, "act_fn", None)
    if act is None:
        raise KeyError("activation")
    return act


def _dot_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What ``y = x w^T`` accumulated in float32 in any order may err (``metrics.dot_allowance``)."""
    return dot_allowance(x.abs() @ w.abs().T, x.square() @ w.square().T, y, x.shape[-1], unit_roundoff(torch.float32))


def gated_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Callable, x: torch.Tensor, u: float,
              red: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``down(act(gate x) * up x)`` in float64 for rows ``x``, its allowance per element (module docstring; the
    output's rounding included; ``u`` the run's unit roundoff, ``red`` the partial sums' reduction) and the scale of
    the partial sums it is made of (``down``'s: ``dot_allowance``'s scale, the sum's largest terms or the result)."""
    u_acc = unit_roundoff(torch.float32)
    g, v = x @ gate.T, x @ up.T
    dg, dv = _dot_bound(x, gate, g), _dot_bound(x, up, v)
    with torch.enable_grad():  # act'(g), elementwise: the gradient of the sum
        g_ = g.detach().requires_grad_(True)
        a_ = act(g_)
        (slope,) = torch.autograd.grad(a_.sum(), g_)
    a = a_.detach()
    h = a * v
    # h's error per unit, as a variance: g's and v's (their accumulation, whose bound is LAMBDA deviations, and their
    # rounding, uniform: (u |.|)^2 / 3) carried through act and the product, and the activation's and the product's
    # roundings; carried through down by LAMBDA deviations, as an accumulation is
    var_g, var_v = (dg / LAMBDA).square() + (u * g).square() / 3, (dv / LAMBDA).square() + (u * v).square() / 3
    var_h = (slope * v).square() * var_g + a.square() * var_v + 2 * (u * h).square() / 3
    y = h @ down.T
    mag, sq = h.abs() @ down.abs().T, h.square() @ down.square().T
    carried = LAMBDA * (var_h @ down.square().T).sqrt()
    acc = dot_allowance(mag, sq, y, h.shape[-1], u_acc, red)
    return y, carried + acc + u * y.abs(), dot_allowance(mag, sq, y, h.shape[-1], 0.0, 1.0)


def _routed(block: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, u: float,
            red: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' weighted sum for rows ``x`` (the engine's ``ids`` and ``weights``), its allowance and its
    partial sums' scale (``gated_mlp``'s, weighted)."""
    experts = block.experts
    n_experts = experts.gate_up_proj.shape[0]  # an AttributeError (not recomputed) for another layout
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0] or bool((ids < 0).any()) \
            or bool((ids >= n_experts).any()):
        raise IndexError("topk ids")
    act = _activation(experts)
    y, b, scale = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        y_e, b_e, s_e = gated_mlp(*_expert(experts, e, x.shape[-1]), act, x[rows], u, red)
        w = weights[rows, slots, None]
        y.index_add_(0, rows, w * y_e)
        b.index_add_(0, rows, w.abs() * b_e + 2 * u * (w * y_e).abs())
        scale.index_add_(0, rows, w.abs() * s_e)
    return y, b, scale


def _shared(block: nn.Module, x: torch.Tensor, u: float, red: float):
    mlp = block.shared_expert
    return gated_mlp(_weights(mlp.gate_proj.weight), _weights(mlp.up_proj.weight), _weights(mlp.down_proj.weight),
                     _activation(mlp), x, u, red)


def op(model: nn.Module, layer: int, kind: str, get: Callable[[str], torch.Tensor], tp: int,
       red_dtype: torch.dtype, run_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(``kind``'s op in float64 on the engine's inputs ``get(point)``, its allowance beyond the output's rounding):
    module docstring. A KeyError where the layer is dense, an input is missing or a weight is not a plain float
    tensor (a quantized expert)."""
    block = sparse_block(model.model.layers[layer])
    if block is None:
        raise KeyError(f"layers.{layer} is dense")
    at = f"layers.{layer}."
    u = unit_roundoff(run_dtype)
    red = (tp - 1) * unit_roundoff(red_dtype) if tp > 1 else 0.0
    x = get(at + "post_attn_norm").double()
    routed = lambda: _routed(block, x, get(at + "moe.topk_ids").long(),  # noqa: E731
                             get(at + "moe.topk_weights").double(), u, red)
    if kind == "mlp.out":
        shared = getattr(block, "shared_expert", None) is not None
        parts = [get(at + p).double() for p in block_inputs(shared)]
        if tp == 1 and not shared:
            return parts[0], 0.0  # the routed sum itself
        scale = routed()[2]
        y, b = parts[0], torch.zeros_like(parts[0])
        if shared:
            g = torch.sigmoid(parts[1])
            y = y + g * parts[2]
            b = 2 * u * (g * parts[2]).abs()  # the sigmoid's and the product's roundings
            scale = scale + g * _shared(block, x, u, red)[2]
        # at tp > 1 each rank combines its partial sums (a product and a sum, rounded at their scale) and the
        # all-reduce adds them at u_red: the partials' scale, not the result's (they may cancel across ranks)
        return y, b + (2 * tp * u + red) * scale if tp > 1 else b
    if kind in ("moe.router", "moe.shared_gate"):
        w = _weights((block.gate if kind == "moe.router" else block.shared_expert_gate).weight)
        y = x @ w.T
        return y, _dot_bound(x, w, y)
    if kind == "moe.shared":
        return _shared(block, x, u, red)[:2]
    if kind == "moe.experts":
        return routed()[:2]
    raise KeyError(kind)
