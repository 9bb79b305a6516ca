"""Op conformance (``tpcheck diff --exact-ops``): each elementwise op of the engine against Hugging Face's own
module applied to the engine's own input, bit for bit.

The noise-floor gate asks whether the engine is *as accurate as* HF at the dtype. It cannot see an engine
whose arithmetic departs from HF's in a way that is as accurate or more: RMSNorm scaling by its weight before
the cast back to bfloat16 rounds once where HF rounds twice, is closer to float64, and still drifts from HF's
tokens over a long generation. RMSNorm and the residual adds work on whole rows of the replicated hidden
state, mix no ranks and no batch rows, and are correctly rounded (or reduce over one row in a fixed order), so
an engine that does HF's arithmetic in HF's order gets HF's bits exactly, at any tp, batch or step, whatever
happened upstream (each op is fed the engine's own input). The first op that does not is where the engine's
arithmetic departs from HF's. SiLU-and-multiply is not checked: float32 SiLU takes its exp from a vectorized
path for most elements and a scalar one for the tail, which differ in the last bit, so its bits depend on the
tensor's length and layout, which TP sharding and gate/up fusion change (measured: 15-178 of 4,080-17,952
elements differ on clean float32 runs).

Opt-in: an engine with fused kernels (a fused add + RMSNorm, a CUDA rsqrt) differs from HF in the last bit by
design. HF runs on the CPU here, so compare a CPU engine.

Checked points and the HF computation each must equal (``x_i`` is layer ``i``'s input: the engine's
``embed`` / ``layers.{i-1}.out``, or the teacher tensor in an isolated run):

* ``layers.{i}.input_norm``      ``layers[i].input_layernorm(x_i)``
* ``layers.{i}.attn.residual``   ``x_i + attn.out``
* ``layers.{i}.post_attn_norm``  ``layers[i].post_attention_layernorm(attn.residual)``
* ``layers.{i}.out``             ``attn.residual + mlp.out``
* ``final_norm``                 ``model.norm(x_L)``
* Gemma 3 (four norms a layer): ``attn.post_norm`` = ``post_attention_layernorm(attn.out)``, ``attn.residual`` =
  ``x_i + attn.post_norm``, ``post_attn_norm`` = ``pre_feedforward_layernorm(attn.residual)``, ``mlp.post_norm``
  = ``post_feedforward_layernorm(mlp.out)``, ``out`` = ``attn.residual + mlp.post_norm``
* ``layers.{i}.attn.q_norm``     ``layers[i].self_attn.q_norm(attn.q)`` per head (Qwen3; ``k_norm`` likewise on
                                 ``attn.k``): an RMSNorm over each head's ``head_dim`` values, which TP never
                                 splits (a rank holds whole heads)
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tpcheck.capture.points import KIND_TABLE, split_point
from tpcheck.measure.own_input import SANDWICH_INPUTS, layer_norm

#: point kinds whose engine tensors the checked ops read (kept for the step when --exact-ops is on)
INPUT_KINDS = frozenset(k.name for k in KIND_TABLE if k.exact_ops in ("input", "both"))
#: point kinds checked (``attn.q_norm`` / ``attn.k_norm`` only exist in models with per-head q/k norms)
CHECKED_KINDS = frozenset(k.name for k in KIND_TABLE if k.exact_ops in ("checked", "both"))
_HEAD_NORMS = {"attn.q_norm": ("q_norm", "attn.q"), "attn.k_norm": ("k_norm", "attn.k")}


@torch.no_grad()
def expected(model: nn.Module, name: str, get: Callable[[str], torch.Tensor],
             layer_input: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
    """What HF ``model`` (the family's causal LM at the test dtype) computes for point ``name`` from the engine's
    inputs; ``get(point)`` returns the engine's tensor of a point of this step and ``layer_input(i)`` layer
    ``i``'s input (``i = num_layers``: the final norm's). None when ``name`` is not a checked op, or an input
    is missing (KeyError) or of a shape HF's op cannot take: those rows are judged by the gate alone."""
    layer, kind = split_point(name)
    if kind not in CHECKED_KINDS:
        return None
    m = model.model
    p = f"layers.{layer}."
    try:
        if kind in _HEAD_NORMS:
            module, source = _HEAD_NORMS[kind]
            norm, x = getattr(m.layers[layer].self_attn, module), get(p + source)
            d = norm.weight.shape[0]
            if x.shape[-1] % d:
                return None
            # [rows, heads * head_dim] -> per head, as HF's attention views it; .forward: no capture hook
            return norm.forward(x.reshape(x.shape[0], -1, d)).reshape(x.shape)
        sandwich = layer is not None and hasattr(m.layers[layer], "pre_feedforward_layernorm")  # Gemma 3
        if kind in ("final_norm", "input_norm", "post_attn_norm", "attn.post_norm", "mlp.post_norm"):
            if kind == "final_norm":
                norm, x = m.norm, layer_input(len(m.layers))
            elif kind == "input_norm":
                norm, x = m.layers[layer].input_layernorm, layer_input(layer)
            else:
                source = {"post_attn_norm": "attn.residual", "attn.post_norm": "attn.out", "mlp.post_norm": "mlp.out"}
                norm, x = layer_norm(m.layers[layer], kind), get(p + source[kind])
            # .forward: bypasses the capture hooks installed on these modules
            return norm.forward(x) if x.shape[-1:] == norm.weight.shape else None
        second = SANDWICH_INPUTS[kind][1] if sandwich else ("attn.out" if kind == "attn.residual" else "mlp.out")
        a, b = ((layer_input(layer), get(p + second)) if kind == "attn.residual"
                else (get(p + "attn.residual"), get(p + second)))
    except KeyError:  # an input the engine does not emit: the row is judged by the gate alone
        return None
    return a + b if a.shape == b.shape else None  # HF: residual + hidden_states
