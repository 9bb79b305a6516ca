"""Whose error is it, at attention's points: RoPE (``attn.q_rope`` / ``attn.k_rope``) and the attention context
(``attn.context``) recomputed exactly (float64) on the engine's own inputs, with the rounding a correct kernel of
any design may add (``tpcheck.measure.own_input`` gives the rule and the other ops).

Why these ops need it: the noise floor's references all run Hugging Face's eager attention and its RoPE tables, so
they sample one kernel's rounding. A correct kernel of another design rounds otherwise: vLLM's CPU attention (its
own ``exp``, scores accumulated in blocks, the scale applied to q first) errs 2e-6 where HF's float32 eager errs
4e-7 (Gemma 3 270M, a 3-token context, layer 11: 1.05x the floor), and an error inherited at ``attn.q`` fails one op
later at ``attn.q_rope``, in correct code. The bounds below are what any correct float32-accumulating kernel may
differ by from the exact op; a bug of attention (a wrong scale, a dropped or stale key, a mask off by one, the wrong
RoPE base or position) moves the output by the weight of a key or a rotation, orders of magnitude above them.

With ``u`` the unit roundoff of float32 (every kernel's accumulator) and ``u_d`` that of the run's dtype (where a
kernel may round an intermediate: bfloat16 scores, weights, tables), per element:

* **RoPE**, ``y = x cos(theta) + rotate_half(x) sin(theta)``, ``theta = pos * inv_freq``: the angle computed in
  float32 errs ``2 u |theta|`` (the product and ``inv_freq``'s own rounding), ``cos`` / ``sin`` a few ``u`` more and
  ``u_d`` when a table is kept in the dtype, the two products and their sum ``2 u_d``:
  ``B = (|x| + |rotate_half(x)|) * s * (2 u |theta| + 4 u + 3 u_d)`` (``s`` the rotary's attention scaling);
* **attention**, per query row and head, over its ``m`` visible keys (causal, the layer's sliding window):
  a score ``s_j = c q.k_j`` (``c`` the layer's scaling) errs ``E_j = c * dot(q, k_j) + 2 u_d |s_j|``, where
  ``dot`` is a dot product's accumulation in any order (``metrics.dot_allowance``, as for a linear); the
  softmax turns score errors into weight errors ``p_j (d_j - sum_k p_k d_k)``, whose effect on the context is at
  most ``sum_j p_j (E_j + E) (|v_j| + |ctx|)`` (``E = sum_k p_k E_k``); each weight's own ``exp`` (``4 u``), its
  rounding to the dtype (``u_d``), the normalising sum's and the rescaling of an online softmax's running sums
  (``lambda sqrt(m / 3) u`` each) and ``P V``'s accumulation (the same) add
  ``(4 u + u_d + 3 lambda sqrt(m / 3) u) sum_j p_j |v_j|``.

The **KV cache** read back (``kv.k`` / ``kv.v``) holds the keys after RoPE and the values of every position the run
wrote: at a prefill exactly ``attn.k_rope`` / ``attn.v``, with the same error against the same threshold. Its op is
that copy: the history of the keys and values the run computed (``tpcheck.pipeline.kv_history``, under
``written(name)``), ``B = 0`` beyond the output's rounding. A key over its threshold that passes as inherited thus
passes in the cache that stores it; a cache that holds other values than those written (a slot off by one, a stale
block, a head repeated) errs by them as its own. An FP8 cache rounds with the checkpoint's scales, not redone here.

A point whose ``own_err`` (its error beyond ``B``) is within its threshold, and whose inputs passed, passes as
inherited (``tpcheck.judge.verdict``): its op was right on the inputs it had."""
from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from tpcheck.measure.metrics import LAMBDA, dot_allowance, unit_roundoff

ROPE_KINDS = ("attn.q_rope", "attn.k_rope")
CACHE_KINDS = ("kv.k", "kv.v")
KINDS = (*ROPE_KINDS, "attn.context", *CACHE_KINDS)


def written(name: str) -> str:
    """The key under which a step's inputs hold what KV-cache point ``name`` (``layers.{i}.kv.k``) should be: the
    keys and values the run wrote (``tpcheck.pipeline.kv_history``), never a point of its own."""
    return f"{name}@written"


class RowLayout(NamedTuple):
    """Where a step's rows are: ``row_lens[b]`` rows of group ``b`` at positions ``starts[b]..``; its KV-cache
    points' rows ``kv_lens[b]`` positions ``0..`` of the same group, in the same group order."""
    row_lens: list[int]
    starts: list[int]
    kv_lens: list[int]

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n) for n, s in zip(self.row_lens, self.starts)]) if self.row_lens \
            else torch.zeros(0, dtype=torch.long)


def inputs(kind: str, qk_norm: bool, kv: bool) -> tuple[str, ...]:
    """The points (of the same layer) an attention op reads: RoPE its projection's (per-head normed, where the model
    normalises q and k: Qwen3, Gemma 3) output; the context its roped queries and the KV cache (``kv``: the run
    reads the cache back), else the step's own keys and values (a prefill without a cached prefix); the cache this
    step's keys or values (the earlier steps' were judged at theirs)."""
    if kind in CACHE_KINDS:
        return ("attn.k_rope",) if kind == "kv.k" else ("attn.v",)
    if kind in ROPE_KINDS:
        return (kind.replace("_rope", "_norm") if qk_norm else kind.removesuffix("_rope"),)
    return ("attn.q_rope", "kv.k", "kv.v") if kv else ("attn.q_rope", "attn.k_rope", "attn.v")


def rms_norm(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """An RMSNorm over ``x``'s last dim in float64 and the relative error a float32 mean of squares and rsqrt may add
    (Gemma's norms scale by ``1 + w``): every norm's op here and in ``tpcheck.measure.own_input``. A KeyError where
    ``norm`` is not an RMSNorm of that width."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None or x.shape[-1:] != norm.weight.shape:
        raise KeyError("norm")
    w = norm.weight.double() + (1.0 if "Gemma" in type(norm).__name__ else 0.0)
    y = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y, (LAMBDA * math.sqrt(x.shape[-1]) / 2 + 4) * unit_roundoff(torch.float32)


def has_qk_norm(model: nn.Module | None) -> bool:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and hasattr(layers[0].self_attn, "q_norm")


def op(model: nn.Module, layer: int, kind: str, get: Callable[[str], torch.Tensor], layout: RowLayout | None,
       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``kind``'s op in float64 on the engine's inputs ``get(point)``, its allowance ``B``): see the module
    docstring. A KeyError where the op cannot be recomputed here (no layout, an
    input missing, logit soft-capping, a cached prefix whose keys the run did not read back, a KV cache whose
    written history the run lacks or that rounds to FP8)."""
    if layout is None:
        raise KeyError("layout")
    attn = model.model.layers[layer].self_attn
    at = f"layers.{layer}."
    if kind in CACHE_KINDS:
        if getattr(attn, "kv_cache_scales", None) is not None:
            raise KeyError("an FP8 cache")  # its rounding, with the checkpoint's scales, is not redone here
        y = get(written(at + kind)).double()
        return y, torch.zeros_like(y)
    if kind in ROPE_KINDS:
        x, rel = _rope_input(attn, at, kind, get, has_qk_norm(model), dtype)
        return _rope(model, attn, x, layout.positions(), dtype, rel)
    try:
        q, k, v = (get(at + p).double() for p in inputs(kind, False, True))
        kv_lens = layout.kv_lens
    except KeyError:
        if any(layout.starts):
            raise
        q, k, v = (get(at + p).double() for p in inputs(kind, False, False))
        kv_lens = layout.row_lens
    return _attention(model, attn, q, k, v, layout._replace(kv_lens=kv_lens), dtype)


def _rope_input(attn: nn.Module, at: str, kind: str, get: Callable[[str], torch.Tensor], qk_norm: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(RoPE's input, the relative error it may carry from an op redone here): the projection, or where the model
    normalises q and k per head, the norm's output. A run that did not record the norm (SGLang's dumper: its q / k
    norms run heads-first, ``[1, heads, tokens, head_dim]``, and are not read) gets the norm redone on the
    projection, so an error inherited at ``attn.q`` still passes as inherited at ``attn.q_rope`` (the judge then
    reads ``attn.q`` as its input): the norm's allowance, its output's rounding to the dtype and one intermediate."""
    (read,), (proj,) = inputs(kind, qk_norm, False), inputs(kind, False, False)
    try:
        return get(at + read).double(), 0.0
    except KeyError:
        if read == proj:
            raise
        x = get(at + proj).double()
    norm = getattr(attn, read.removeprefix("attn."))
    y, rel = rms_norm(norm, x.reshape(-1, norm.weight.shape[-1]))
    return y.reshape(x.shape), rel + 2 * unit_roundoff(dtype)


def _rope(model: nn.Module, attn: nn.Module, x: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype,
          rel_in: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in float64 and its allowance (module docstring), plus ``rel_in``: a relative error ``x`` may carry from
    an op redone on the way (``_rope_input``), at most ``rel_in (|x| + |rotate_half(x)|)`` after the rotation."""
    hd = attn.head_dim
    if x.shape[0] != len(pos) or x.shape[-1] % hd:
        raise KeyError("rows")
    cos1, sin1 = _cos_sin(model, attn, torch.ones(1, dtype=torch.long))
    inv_freq = torch.atan2(sin1, cos1)  # the angle at position 1: inv_freq (< pi), whatever the rope type
    scale = torch.sqrt(cos1 ** 2 + sin1 ** 2)  # the rotary's attention scaling (YaRN's), 1 for most
    theta = pos.double()[:, None] * inv_freq
    cos, sin = torch.cos(theta) * scale, torch.sin(theta) * scale
    h = x.reshape(x.shape[0], -1, hd)
    rot = torch.cat([-h[..., hd // 2:], h[..., :hd // 2]], dim=-1)
    y = h * cos[:, None] + rot * sin[:, None]
    u, ud = unit_roundoff(torch.float32), unit_roundoff(dtype)
    b = (h.abs() + rot.abs()) * (scale * (2 * u * theta.abs() + 4 * u + 3 * ud + rel_in))[:, None]
    return y.reshape(x.shape), b.reshape(x.shape)


def _cos_sin(model: nn.Module, attn: nn.Module, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary tables (float64) at positions ``pos``, for ``attn``'s layer type where the rotary keeps
    one per type (Gemma 3's local and global bases)."""
    rot = getattr(model.model, "rotary_emb", None)
    if rot is None:
        raise KeyError("rotary_emb")
    x = torch.zeros(1, dtype=torch.float64)
    args = [x, pos[None]]
    if "layer_type" in inspect.signature(rot.forward).parameters:
        args.append(getattr(attn, "layer_type", None))
    cos, sin = rot(*args)
    return cos[0].double(), sin[0].double()


def _attention(model: nn.Module, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               layout: RowLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hd, scaling = attn.head_dim, float(attn.scaling)
    if getattr(attn, "attn_logit_softcapping", None) is not None:
        raise KeyError("soft-capping")
    window = getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window") else \
        getattr(model.config, "sliding_window", None)  # Mistral: the config's, every layer
    if q.shape[0] != sum(layout.row_lens) or k.shape[0] != sum(layout.kv_lens) or v.shape != k.shape:
        raise KeyError("rows")
    heads, kv_heads = q.shape[-1] // hd, k.shape[-1] // hd
    if heads * hd != q.shape[-1] or kv_heads * hd != k.shape[-1] or heads % kv_heads:
        raise KeyError("heads")
    u, ud = unit_roundoff(torch.float32), unit_roundoff(dtype)
    ys, bs, r0, k0 = [], [], 0, 0
    for n, start, m in zip(layout.row_lens, layout.starts, layout.kv_lens):
        qb = q[r0:r0 + n].reshape(n, heads, hd).transpose(0, 1)  # [h, n, hd]
        kb = k[k0:k0 + m].reshape(m, kv_heads, hd).repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vb = v[k0:k0 + m].reshape(m, kv_heads, hd).repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        r0, k0 = r0 + n, k0 + m
        qpos, kpos = torch.arange(start, start + n)[:, None], torch.arange(m)[None]
        visible = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
        raw = qb @ kb.transpose(1, 2)  # [h, n, m]
        s = (raw * scaling).masked_fill(~visible, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        y = p @ vb  # [h, n, hd]
        mag, sq = qb.abs() @ kb.abs().transpose(1, 2), qb.square() @ kb.square().transpose(1, 2)
        e = (scaling * dot_allowance(mag, sq, raw, hd) + 2 * ud * s.abs()).masked_fill(~visible, 0.0)
        w = p * (e + (p * e).sum(-1, keepdim=True))  # |v_j - ctx| <= |v_j| + |ctx|: no [h, n, m, hd] product
        seen = visible.sum(-1, keepdim=True).double()  # each row's m
        per_weight = 4 * u + ud + 3 * LAMBDA * torch.sqrt(seen / 3) * u
        b = w @ vb.abs() + w.sum(-1, keepdim=True) * y.abs() + per_weight * (p @ vb.abs())
        ys.append(y.transpose(0, 1).reshape(n, heads * hd))
        bs.append(b.transpose(0, 1).reshape(n, heads * hd))
    return torch.cat(ys), torch.cat(bs)
