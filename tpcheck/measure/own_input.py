"""Whose error is it: a point's op recomputed exactly (float64) on the engine's *own* inputs of that step, and the
rounding a correct kernel may add to it.

A point's error against the golden, ``d = y_engine - y_golden``, is the sum of two parts: what the engine's op
did wrong on the inputs it had (``e_own = y_engine - op(x_engine)``, ``op`` exact) and what its inputs already
carried (``op(x_engine) - op(x_golden)``). The noise floor judges ``d`` as a whole against the references, which is
sound while the references' inherited part is a fair sample of a correct engine's. It is not where an op is
ill-conditioned: a massive activation's MLP output is a dot product of a few terms of ~2.5e3 that cancel to ~8
(``deep-sink``, ``layers.11.mlp.out`` at token 0: ``sum|w||x| / |y|`` ~ 900), so an input error of 1e-6 per
element moves the output by ~1e-2 or by ~1e-4 depending on whether the input errors are correlated. Hugging
Face's are (its four units read one normalised channel), vLLM's GEMMs give independent ones: measured 0.00504 of
vLLM's 0.00694 there is inherited, its own op errs 0.00189, HF's 0.00047, and the point failed at 20.6x.

So each point of ``OWN_INPUTS`` also gets ``own_err``: ``|| max(|e_own| - B, 0) || / ||y_golden||``, the op's own
error relative to the golden (the same scale as ``rel_err``) less an allowance ``B`` for what a correct kernel may
add where the noise floor's references cannot sample it. ``B`` per element:

* every op: ``2 u |y|``, the output's rounding to the run's dtype and one intermediate rounding (HF rounds SiLU
  before the product, RMSNorm before its weight), plus for an RMSNorm its float32 mean of squares and rsqrt;
* a linear op (``y = x W^T + b``, ``W`` and ``b`` at the run's dtype, as every engine holds them, so the
  weights' own rounding is not the engine's to explain), at every element, the accumulation of its n products in
  any order: ``lambda sqrt(n / 3) u_acc max(sqrt(sum_i w_i^2 x_i^2 + b^2), |y|)``, lambda standard deviations of
  n roundings (uniform, each of variance ``u^2 / 3``) of partial sums the size of the sum's largest terms (a
  dominant term added first keeps every partial sum at its size) or of the result (terms of one sign); ``u_acc``
  the accumulator's (float32 for every float32/bfloat16/float16 GEMM). Measured: vLLM's float32 GEMM (oneDNN) on a
  one-token row errs 3.8e-5 at a gate unit whose 33 and -17.6 terms give 15.6 (``deep-sink-3`` tp 3, layer 10),
  10x HF's and 2.4 of these deviations: the references, one row each, sampled HF's luckier order alone. In float32
  it is ~``lambda sqrt(n / 3) u`` of the result, 1.8e-5 at n = 4864: a bug in the op larger than that (TF32's
  4.9e-4, a bfloat16 all-reduce's 2e-3) is measured at nearly full size; in bfloat16 and float16 it is far below
  the output's own rounding;
* and where the dot product cancels, ``kappa = (|W||x| + |b|) / |y| >= KAPPA_MIN * sqrt(n)`` (n terms; a dot product
  of random signs has kappa ~ 0.8 sqrt(n)), the larger ``lambda sqrt(n) u_acc (|W||x| + |b|)``, the probabilistic
  bound of a sum of n products accumulated in any order (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019: it holds
  with probability at least ``1 - 2n exp(-lambda^2 / 2)`` for independent roundings; lambda 6);
* both plus ``(tp - 1) u_red`` of their scale for a row-parallel sum rounded in the reduce dtype.

The judge (``tpcheck.judge.verdict``) lets a point whose ``rel_err`` exceeds its threshold pass as *inherited*
when its ``own_err`` is within the same threshold and every input point of its op passed (raw or inherited) at
that step: its op is right on the inputs it had, and those inputs are within their own floors. A bug in the op
shows in ``e_own`` at nearly full size on the well-conditioned elements (where ``B`` is the output's rounding and
a correct accumulation's), so
the point still fails at its origin; a bug upstream fails at its own point first, and then no point downstream of
it can pass as inherited. ``own_err`` is computed only where a point exceeds half its threshold (the smaller
of the default one and the run's tolerances'): elsewhere it cannot change the verdict, and it costs one float64
op on the point's inputs."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from tpcheck.capture.core import handoff
from tpcheck.capture.points import split_point
from tpcheck.measure import own_attention, own_moe
from tpcheck.measure.gain import gain_fields
from tpcheck.measure.metrics import dot_allowance, unit_roundoff

PREV = "<layer input>"  # the layer's input: ``embed`` or the previous layer's ``out`` (the teacher when isolated)
#: point kind -> the points (of the same layer) its op reads, in argument order
OWN_INPUTS: dict[str, tuple[str, ...]] = {
    "input_norm": (PREV,), "attn.q": ("input_norm",), "attn.k": ("input_norm",), "attn.v": ("input_norm",),
    "attn.out": ("attn.context",), "attn.residual": (PREV, "attn.out"), "post_attn_norm": ("attn.residual",),
    "mlp.gate": ("post_attn_norm",), "mlp.up": ("post_attn_norm",), "mlp.act": ("mlp.gate", "mlp.up"),
    "mlp.out": ("mlp.act",), "out": ("attn.residual", "mlp.out"), "final_norm": (PREV,), "logits": ("final_norm",),
    "moe.topk_weights": ("moe.router", "moe.topk_ids"),
    # the per-head q / k norms (Qwen3, Gemma 3): each head's head_dim values of the projection, normalised
    "attn.q_norm": ("attn.q",), "attn.k_norm": ("attn.k",),
    # a pipeline stage's hand-off (--pp): the layer's MLP output and its residual stream, as the stage sent them
    "handoff": ("mlp.out", "attn.residual"),
}
#: Gemma 3 (``sandwich``): its attention and MLP outputs are normalised before their residual adds
SANDWICH_INPUTS: dict[str, tuple[str, ...]] = {
    "attn.post_norm": ("attn.out",), "attn.residual": (PREV, "attn.post_norm"), "mlp.post_norm": ("mlp.out",),
    "out": ("attn.residual", "mlp.post_norm"),
    "handoff": ("mlp.post_norm", "attn.residual"),  # vLLM's Gemma 3 layer sends its normalised MLP output
}
#: point kind -> the decoder layer's norm that computes it (the other families; ``SANDWICH_NORMS`` for Gemma 3)
NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"input_norm": "input_layernorm", "attn.post_norm": "post_attention_layernorm",
                  "post_attn_norm": "pre_feedforward_layernorm", "mlp.post_norm": "post_feedforward_layernorm"}
_LINEARS = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
            "attn.out": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
            "mlp.out": "mlp.down_proj"}
_ROW_PARALLEL = ("attn.out", "mlp.out")


def reads_layer_input(kind: str) -> bool:
    """Whether a point kind's op reads the layer's input (``PREV``: ``embed`` or the previous layer's ``out``;
    in the local pass, the teacher: the golden's own)."""
    return OWN_INPUTS.get(kind, ("",))[0] == PREV


def is_sandwich(model: nn.Module | None) -> bool:
    """Whether an HF model's decoder layers normalise their attention and MLP outputs (Gemma 3's four norms)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and hasattr(layers[0], "pre_feedforward_layernorm")


def layer_norm(layer: nn.Module, kind: str) -> nn.Module:
    """The norm of decoder layer ``layer`` (an HF module) that gives point kind ``kind``; a KeyError for another."""
    names = SANDWICH_NORMS if hasattr(layer, "pre_feedforward_layernorm") else NORMS
    return getattr(layer, names[kind])


def input_points(name: str, num_layers: int, sandwich: bool = False, qk_norm: bool = False,
                 kv: bool = True, moe: str = "") -> list[str] | None:
    """The points ``name``'s op reads (``PREV`` resolved to ``embed`` / ``layers.{i-1}.out``), or None for a point
    kind this module does not recompute; ``sandwich``: a Gemma 3 model (``SANDWICH_INPUTS``); ``qk_norm`` and
    ``kv``: attention's (``tpcheck.measure.own_attention.inputs``); ``moe``: the point's layer is sparse
    (``tpcheck.measure.own_moe.layer_kind``: ``"moe"``, or ``"shared"`` with a shared expert)."""
    layer, kind = split_point(name)
    if kind in own_attention.KINDS:
        return [f"layers.{layer}.{p}" for p in own_attention.inputs(kind, qk_norm, kv)]
    if moe and kind in own_moe.KINDS:
        parts = own_moe.block_inputs(moe == "shared") if kind == "mlp.out" else own_moe.INPUTS[kind]
        return [f"layers.{layer}.{p}" for p in parts]
    table = {**OWN_INPUTS, **SANDWICH_INPUTS} if sandwich else OWN_INPUTS
    if kind not in table:
        return None
    if kind == "final_norm":
        return [f"layers.{num_layers - 1}.out"]
    if kind == "logits":
        return ["final_norm"]
    prev = "embed" if layer == 0 else f"layers.{layer - 1}.out"
    return [prev if p == PREV else f"layers.{layer}.{p}" for p in table[kind]]


def _linear_allowance(lin: nn.Linear, x: torch.Tensor, y: torch.Tensor, row_parallel: bool, tp: int,
                      red_dtype: torch.dtype) -> torch.Tensor:
    """``B``'s dot-product part (see the module docstring) of a linear op."""
    w = lin.weight.double()
    mag = x.abs() @ w.abs().T
    sq = x.square() @ w.square().T
    if lin.bias is not None:
        mag += lin.bias.double().abs()
        sq += lin.bias.double().square()
    u_acc = unit_roundoff(torch.float64) if lin.weight.dtype == torch.float64 else unit_roundoff(torch.float32)
    red = (tp - 1) * unit_roundoff(red_dtype) if row_parallel and tp > 1 else 0.0
    return dot_allowance(mag, sq, y, x.shape[-1], u_acc, red)


class Own(NamedTuple):
    """The engine's point against its op recomputed on the engine's own inputs: ``err`` (``own_err``, module
    docstring) and ``gain`` (``own_gain``: the gain statistic of the engine's tensor against that op's result,
    ``tpcheck.measure.gain``: a systematic scale the op itself added, not one its inputs carried in). NaN where not
    recomputed."""
    err: float
    gain: float


NOT_RECOMPUTED = Own(math.nan, math.nan)


@torch.no_grad()
def own_check(model: nn.Module, name: str, engine: torch.Tensor, golden: torch.Tensor,
              get: Callable[[str], torch.Tensor], tp: int = 1, red_dtype: torch.dtype | None = None,
              layout: own_attention.RowLayout | None = None,
              parts: list[tuple[slice, Callable[[str], torch.Tensor]]] | None = None) -> Own:
    """``Own`` of point ``name`` (module docstring): ``engine`` its engine tensor, ``golden`` the golden's,
    ``get(point)`` the engine's tensor of an input point (the teacher for ``PREV`` in an isolated pass), ``model``
    Hugging Face's model at the run's dtype (its weights and norms, as the engine holds them), ``layout`` where the
    step's rows are (attention's ops). NaN where the op cannot be recomputed: an input missing (KeyError) or of
    another shape, a streamed model. ``parts``: a point whose ranks computed its columns from inputs that differ
    (replicas an ulp apart): ``(columns, get)`` of each rank group, the op redone on each group's own inputs for its
    columns. A sparse layer's router, experts, shared expert and output: ``tpcheck.measure.own_moe``."""
    layer, kind = split_point(name)
    if kind not in OWN_INPUTS and kind not in SANDWICH_INPUTS and kind not in own_attention.KINDS \
            and kind not in own_moe.KINDS or model is None or engine.shape != golden.shape:
        return NOT_RECOMPUTED
    sparse = kind in own_moe.KINDS and bool(own_moe.layer_kind(model, layer))

    def op(get: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | float]:
        if kind in own_attention.KINDS:
            return own_attention.op(model, layer, kind, get, layout, engine.dtype)
        if sparse:
            return own_moe.op(model, layer, kind, get, tp, red_dtype or engine.dtype, engine.dtype)
        return _own_op(model, layer, kind, get, tp, red_dtype or engine.dtype)
    try:
        if parts:
            y, b = torch.empty(engine.shape, dtype=torch.float64), torch.empty(engine.shape, dtype=torch.float64)
            for cols, part_get in parts:
                y_r, b_r = op(part_get)
                y[..., cols] = y_r[..., cols]
                b[..., cols] = torch.as_tensor(b_r, dtype=torch.float64).expand_as(y_r)[..., cols]
        else:
            y, b = op(get)
    except (KeyError, AttributeError, IndexError, RuntimeError):
        return NOT_RECOMPUTED
    if y.shape != engine.shape:
        return NOT_RECOMPUTED
    e = engine.double()
    u = unit_roundoff(engine.dtype) if engine.dtype.is_floating_point else 0.0
    over = (e - y).abs().sub_(b + 2 * u * e.abs()).clamp_(min=0)
    g = float(golden.double().norm())
    err = float(over.norm())
    gain = gain_fields(e, y)["gain"] if engine.dtype.is_floating_point else math.nan
    return Own(err / g if g > 0 else err, gain)


def own_error(model: nn.Module, name: str, engine: torch.Tensor, golden: torch.Tensor,
              get: Callable[[str], torch.Tensor], tp: int = 1, red_dtype: torch.dtype | None = None,
              layout: own_attention.RowLayout | None = None) -> float:
    """``own_check(...).err``: ``own_err`` alone."""
    return own_check(model, name, engine, golden, get, tp, red_dtype, layout).err


def _own_op(model: nn.Module, layer: int | None, kind: str, get: Callable[[str], torch.Tensor], tp: int,
            red_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(the op of ``kind`` in float64 on the engine's inputs, the allowance beyond the output's rounding)."""
    m = model.model
    num_layers = len(m.layers)
    name = kind if layer is None else f"layers.{layer}.{kind}"
    xs = [get(p).double() for p in input_points(name, num_layers, is_sandwich(model))]
    if kind in ("input_norm", "post_attn_norm", "final_norm", "attn.post_norm", "mlp.post_norm"):
        norm = m.norm if kind == "final_norm" else layer_norm(m.layers[layer], kind)
        y, rel = own_attention.rms_norm(norm, xs[0])
        return y, rel * y.abs()
    if kind in ("attn.q_norm", "attn.k_norm"):  # one RMSNorm over each head's head_dim values
        norm = getattr(m.layers[layer].self_attn, kind.removeprefix("attn."))
        y, rel = own_attention.rms_norm(norm, xs[0].reshape(-1, norm.weight.shape[-1]))
        y = y.reshape(xs[0].shape)
        return y, rel * y.abs()
    if kind in ("attn.residual", "out"):
        return xs[0] + xs[1], 0.0
    if kind == "handoff":  # a copy: what the stage computed, as the next one received it
        return handoff(xs[0], xs[1]), 0.0
    if kind == "mlp.act":
        act = getattr(m.layers[layer].mlp, "act_fn", None)
        if act is not None and "Tanh" in type(act).__name__:  # Gemma 3's GeGLU (HF's gelu_pytorch_tanh)
            g = torch.nn.functional.gelu(xs[0], approximate="tanh")
        elif act is None or "SiLU" in type(act).__name__:
            g = torch.nn.functional.silu(xs[0])
        else:
            raise KeyError(f"activation {type(act).__name__}")
        return g * xs[1], 4 * unit_roundoff(torch.float32) * (xs[0].abs() * xs[1].abs())
    if kind == "moe.topk_weights":
        return _topk_weights(m.layers[layer].mlp, xs[0], xs[1].long())
    lin = model.lm_head if kind == "logits" else m.layers[layer].get_submodule(_LINEARS[kind])
    if type(lin) is not nn.Linear or lin.weight.device.type == "meta":
        raise KeyError(kind)
    w = lin.weight.double()
    y = xs[0] @ w.T + (lin.bias.double() if lin.bias is not None else 0.0)
    return y, _linear_allowance(lin, xs[0], y, kind in _ROW_PARALLEL, tp, red_dtype)


def _topk_weights(block: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k weights of the engine's chosen experts ``ids`` from its own router ``logits``: their softmax
    probabilities, renormalised over the k where the router renormalises (HF's ``norm_topk_prob``; Mixtral always),
    in float64. Allowance: HF's float32 softmax and renormalisation, a few float32 roundings of each weight. So a
    weight whose error only carries its router logits' (within their own floor: the judge asks) is inherited, and
    weights computed wrongly from the engine's own logits (not renormalised, another expert's) are the op's."""
    gate = getattr(block, "gate", None)
    renorm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True))
    if ids.shape[:-1] != logits.shape[:-1] or bool((ids < 0).any()) or bool((ids >= logits.shape[-1]).any()):
        raise IndexError("topk ids")
    w = torch.softmax(logits, dim=-1).gather(-1, ids)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, 8 * unit_roundoff(torch.float32) * w.abs()
