"""The attention-sink recipe of the ``deep-sink`` preset (``_add_sink``): trained-model magnitudes at depth.

A trained LLM's residual stream carries a *massive activation* at the first token: one channel reaches ~10^4
(22,552 in layers 11-27 of a public 135M Llama-family model, 30 layers), a second ~10^3 (1,400-1,800), while
the median |x| stays 1-11; the sink fades over the last layers (~2,500 at the last). It comes from the
position, not the token: random token ids show it too. This recipe builds the same statistics into the
random weights of ``tpcheck.inputs.models.weight_recipe`` (a Llama config with ``attention_bias`` and ``mlp_bias``,
head_dim >= 32, >= 2 query heads per KV head), by overwriting a few rows and columns in place:

* **where position 0 comes from.** A RoPE model's values carry no position; what is special about token 0 is
  that causal attention there sees only itself. The query heads of KV head 0 in layer 0 get zero queries, so
  they attend uniformly to the prefix: their output at token i is the mean of ``v_0..v_i``. Their ``v_proj``
  reads the *cancelled* channels ``P`` (the last quarter of the hidden dim) and ``o_proj`` writes back
  ``-mean(e_P)`` (as -1.5x from one query head and +0.5x from the other: at tp 4 two ranks' partial products
  of mixed sign). Every embedding row has the same norm (its ``P`` part and its other part are each
  rescaled to a fixed norm, so the RMSNorm in front divides every token by the same number), so after layer
  0's attention the ``P`` channels are *exactly* 0 at token 0 (``e_0 - e_0``) and ``e_i - mean(e_0..e_i)``,
  of norm ~30-50, at every later token. It is zero elsewhere only where every token so far is the same id:
  a RoPE model cannot tell such a position from position 0 at all (its hidden states are token 0's).
* **the indicator.** The embedding writes a constant ``K_CONST`` into channel ``K`` for every token; with
  ``P`` cancelled, token 0's rms is smallest, so after ``post_attention_layernorm`` channel K reads ~10 at
  token 0 and <= ~5 elsewhere. Four MLP units of layer 0 (``_outlier_units``: one per quarter of the
  intermediate dim, so one per rank at tp 4) gate on ``K`` above a threshold (the gate bias, ``mlp_bias``):
  a few hundred into the sink channel ``S`` at token 0, ~0 elsewhere (over every pair of distinct first two
  tokens, weight seeds 0-3: position 1 never exceeds 7.5 after layer 0, position 0 is >= 199).
* **growth, plateau, decay.** In every later layer four units read ``S`` (post_attention_layernorm weight
  0.3) through a thresholded gate: at token 0, where S dominates the rms, RMSNorm saturates channel S at
  ``0.3 * sqrt(hidden)`` whatever its size, so each layer adds a fixed amount; elsewhere S is ~0 and the gate
  stays at ~-17 (silu ~-4e-7). ``down_proj`` writes ``scale * pattern`` with mixed signs: ``grow`` (net +1.4,
  the first quarter of the layers: S reaches ~2e4 and the second channel ``S2``, written at -0.08x, ~-1.55e3),
  ``hold`` (1, 0.6, -0.5, -1.1: net 0, large partial products that TP ranks round separately), ``decay``
  (the last 3 layers: S falls to ~2.5e3). The units' other weights are scaled by 0.05 (they read and write
  almost only S), as ``_add_outliers`` does.
* **kept out of what attention and the LM head read.** ``input_layernorm`` weights 0.03 / 0.04 and final
  norm weights 0.02 / -0.03 on S / S2: token 0 becomes a fixed, bias-driven key and value (an attention
  sink), and its logits are small.

Measured (``python benchmarks/depth_stats.py``, HF float64, random prompts of 3-64 tokens + 4 decode steps):
S at token 0 ~265-470 after layer 0, ~1.96e4-1.99e4 in layers 6-20, ~2.4e3-2.6e3 at layer 23; S2 ~-1.55e3; S
at other tokens <= ~12 (<= 24 with weight seeds 1 and 2); median |x| 1.3-5.4; finite in float16 and bfloat16
(the largest MLP product ~1.4e2, down_proj partial products ~4e3). Position 1 repeats position 0 (and shows
the sink) when the first two ids are equal.
"""

from __future__ import annotations

import math
import re

import torch

from tpcheck.inputs.models.weight_recipe import _outlier_units
from tpcheck.inputs.models.weight_recipe import family_options

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")

P_STD, REST_STD, K_CONST = 8.0, 1.0, 12.0   # embedding: std of the P channels and of the rest, constant of K
W_IN_P, W_POST_K = 0.7, 1.3                  # layer 0: input_layernorm on P, post_attention_layernorm on K
W_IN, W_POST, W_FINAL = (0.03, 0.04), (0.3, 0.1), (0.02, -0.03)   # norm weights on (S, S2)
# MLP units: gate = a * (x_read - threshold), up = b * x_read (x_read: K in layer 0, S later, normalised)
INDICATOR = dict(a=4.0, threshold=7.5, b=1.0)
SINK_UNIT = dict(a=8.0, threshold=2.2, b=3.0)
PATTERNS = {"grow": (1.0, 0.6, -0.5, 0.3), "hold": (1.0, 0.6, -0.5, -1.1), "decay": (-1.0, -0.6, 0.5, -0.3)}
SCALES = {"indicator": 2.4, "grow": 24.0, "hold": 24.0, "decay": 44.0}   # down_proj scale of the pattern
S2_RATIO = -0.08     # S2 gets this times S's down_proj weights in the grow and hold layers
DECAY_LAYERS = 3


def sink_channels(hidden: int) -> dict:
    """The residual channels of the recipe: the sink ``S``, the second massive channel ``S2``, the constant
    channel ``K`` and the cancelled channels ``P`` (the last quarter)."""
    q = hidden // 4
    return {"S": 37 % hidden, "S2": (hidden // 2 + 6) % hidden, "K": 5, "P": list(range(hidden - q, hidden))}


def schedule(layers: int) -> list[str]:
    """What each layer's sink units do: ``indicator`` (layer 0), ``grow`` (the first quarter of the layers),
    ``hold``, then ``decay`` (the last ``DECAY_LAYERS``)."""
    grow = max(1, round(layers / 4))
    return ["indicator"] + ["grow" if i <= grow else "decay" if i >= layers - DECAY_LAYERS else "hold"
                            for i in range(1, layers)]


def embed_rms(hidden: int) -> float:
    """The rms of every embedding row (the same for every token, by construction)."""
    n_p = len(sink_channels(hidden)["P"])
    return math.sqrt((P_STD ** 2 * n_p + REST_STD ** 2 * (hidden - n_p - 1) + K_CONST ** 2) / hidden)


def _embed(t: torch.Tensor, ch: dict) -> None:
    p = ch["P"]
    rest = [i for i in range(t.shape[1]) if i not in p and i != ch["K"]]
    for cols, std in ((p, P_STD), (rest, REST_STD)):
        part = t[:, cols]
        t[:, cols] = part * (std * math.sqrt(len(cols)) / part.norm(dim=1, keepdim=True))
    t[:, ch["K"]] = K_CONST


def _layer0_attention(rest: str, t: torch.Tensor, cfg, ch: dict) -> None:
    """KV head 0's query heads attend uniformly and write ``-mean(e_P)`` into P; nothing else writes P or K."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    p, n = ch["P"], len(ch["P"])
    if rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        t[:group * d] = 0.0
    elif rest == "self_attn.v_proj.weight":
        t[:d] = 0.0
        t[torch.arange(n), p] = embed_rms(cfg.hidden_size) / W_IN_P  # v = e_P: the norm divides by embed_rms
    elif rest == "self_attn.v_proj.bias":
        t[:d] = 0.0
    elif rest == "self_attn.o_proj.weight":
        t[p + [ch["K"]]] = 0.0
        t[:, :group * d] *= 0.02  # the uniform heads write (almost) only into P
        for g, w in enumerate((-1.5, 0.5) if group >= 2 else (-1.0,)):
            t[p, g * d + torch.arange(n)] = w
    elif rest == "self_attn.o_proj.bias":
        t[p + [ch["K"]]] = 0.0


def _sink_units(rest: str, t: torch.Tensor, units: list[int], ch: dict, kind: str) -> None:
    read = ch["K"] if kind == "indicator" else ch["S"]
    u = INDICATOR if kind == "indicator" else SINK_UNIT
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        t[units] *= 0.05
        t[units, read] = u["a"] if rest == "mlp.gate_proj.weight" else u["b"]
    elif rest == "mlp.gate_proj.bias":
        t[units] = -u["a"] * u["threshold"]
    elif rest == "mlp.up_proj.bias":
        t[units] *= 0.05
    elif rest == "mlp.down_proj.weight":
        d = torch.tensor(PATTERNS["grow" if kind == "indicator" else kind]) * SCALES[kind]
        t[:, units] *= 0.05  # the units write (almost) only into the sink channels
        t[ch["S"], units] += d
        if kind in ("grow", "hold"):
            t[ch["S2"], units] += S2_RATIO * d


def _add_sink(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """The attention-sink recipe (module docstring), in place on the float32 tensor ``name`` of ``cfg``'s
    model (a Llama config with ``attention_bias`` and ``mlp_bias``)."""
    ch = sink_channels(cfg.hidden_size)
    s = [ch["S"], ch["S2"]]
    if name == "model.embed_tokens.weight":
        _embed(t, ch)
    elif name == "model.norm.weight":
        t[s] = torch.tensor(W_FINAL)
    elif (m := _LAYER.fullmatch(name)) is not None:
        layer, rest = int(m.group(1)), m.group(2)
        if rest == "input_layernorm.weight":
            t[s] = torch.tensor(W_IN)
            if layer == 0:
                t[ch["P"]] = W_IN_P
        elif rest == "post_attention_layernorm.weight":
            t[s] = torch.tensor(W_POST)
            if layer == 0:
                t[ch["K"]] = W_POST_K
        elif rest.startswith("self_attn.") and layer == 0:
            _layer0_attention(rest, t, cfg, ch)
        elif rest.startswith("mlp."):
            kind = schedule(cfg.num_hidden_layers)[layer]
            _sink_units(rest, t, _outlier_units(layer, cfg.intermediate_size), ch, kind)
    return t


def check_sink_config(cfg) -> None:
    """ValueError unless ``cfg`` can carry the recipe: biases on q/k/v/o and the MLP (``family_options``), at
    least two query heads per KV head, and a head_dim that holds the P channels."""
    opt = family_options(cfg)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    need = {"q/k/v and o_proj biases": opt["qkv_bias"] and opt["o_proj_bias"], "MLP biases": opt["mlp_bias"],
            "2+ query heads per KV head": cfg.num_attention_heads >= 2 * cfg.num_key_value_heads,
            f"head_dim >= hidden / 4 ({cfg.hidden_size // 4})": d >= cfg.hidden_size // 4,
            "intermediate size divisible by 4": cfg.intermediate_size % 4 == 0}
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        raise ValueError(f"the attention-sink recipe needs {', '.join(missing)}")
