"""The trained-statistics recipe of the ``gemma3-trained`` preset (``_add_gemma_sink``): a Gemma 3 whose middle
layers carry what the public Gemma 3 270M carries there, drawn into the random weights of
``tpcheck.inputs.models.weight_recipe`` by overwriting a few rows, columns and norm weights in place.

What the trained model has (``python benchmarks/trained_stats.py --model <gemma-3-270m> --prompts 6``, HF float32,
real text): the residual stream's largest element sits at token 0, channel 163 from layer 3 on, growing from 3e3
(layer 0) to 2.5e4 (layer 4), 8.8e4 (layer 9) and 1.0e5 (layer 14), 6.6e4 at the last (18 layers); max / RMS over
all tokens 90-138 at mid depth; 26-81% of a layer's attention goes to token 0 (~50% mid depth). Its
``post_feedforward_layernorm`` scales channel 163 by 500-1,600 (the median channel by 1-340), its
``input_layernorm`` by ~0.5 (median 6-25). Gemma normalises each sub-block's output before adding it to the
residual, so a channel grows only as fast as that norm's weight lets it; the recipe grows its own that way.

* **position 0** (layer 0). Random prompts have no ``<bos>``: what sets token 0 apart is that causal attention there
  sees only itself. Query head 0 gets a zero ``q_proj`` (its q_norm keeps 0), so it attends uniformly; its value
  reads the ``P`` channels (``head_dim - 1``, one to one) and the constant channel ``K`` (every embedding row holds
  ``K_CONST`` there and fixed norms elsewhere, so the norm in front divides every token alike): ``[mean(e_P), C]``,
  whose first part has norm ``|e_P|`` at token 0 and ~``|e_P| / sqrt(n)`` after ``n`` distinct tokens (``zeta``,
  that norm over ``|e_P|``). ``o_proj`` writes the mean into ``P`` and ``C`` alone into channel ``J``, and
  ``post_attention_layernorm`` divides both by the output's rms: ``J`` is smallest at token 0 and ~1.4x that
  from position 1 on. Gemma's MLP has no bias, so the threshold compares two residual channels, a ratio no norm
  changes: four GeGLU units (one per quarter of the intermediate dim: a rank's share at tp 2 and 4) gate on
  ``K`` against ``J`` and cross 0 at ``zeta = ZETA_THR``: +7.6..+7.9 at token 0, <= -8.4 at every later position
  (measured, random prompts of 3-64 tokens; tanh GELU gives exactly 0 there). Only a prefix of one repeated id has
  ``zeta = 1`` too (a RoPE model cannot tell its positions from position 0). The units write the massive
  channel ``S`` alone and no other unit writes ``S`` (``down_proj`` row ``S`` x 0.001), so after
  ``post_feedforward_layernorm`` token 0 holds ``sqrt(hidden) * W_0`` there, other tokens <= ~10.
* **growth, plateau, decay** (layers 1..). Four units a layer gate on ``S - GROW["kappa"] * K`` after
  ``pre_feedforward_layernorm``: at token 0, where ``S`` dominates the rms, the norm holds ``S`` at
  ``sqrt(hidden) * W_PF["S"]`` whatever its size and the MLP's output is (almost) all ``S``, so
  ``post_feedforward_layernorm`` adds ``sqrt(hidden) * W_l``; at other tokens the gate is <= -12 (exactly 0 out).
  ``W_l`` follows the trained model's profile (``PROFILE``, resampled to the preset's depth, peak ``PEAK`` = 5e4,
  under float16's 65,504); the units of the last layers write ``-S``. ``down_proj`` writes them as ``PATTERN``:
  partial sums of mixed sign at tp 2 and 4.
* **the attention sink** (layers 1..). Token 0's normalised input is ~``e_S`` (the norm divides the rest by ~|S|):
  its key is ``k_proj``'s column ``S``, a fixed direction ``u`` on the lowest RoPE frequencies (a query keeps it at
  any distance); every query reads ``GAMMA[head] * u`` from ``K`` and no key reads ``K``, so token 0's score
  stands ~3-4 above the rest: 40-55% of the attention at mid depth. Its value is ``v_proj``'s column ``S`` x
  ``VALUE_SINK``, ~1/4 of a token's (trained sinks' values are small, not 0: with 0, a sink-heavy row's context
  is a small remainder whose rounding set the bfloat16 floor of ``attn.out`` at 1.1-1.8% (median margin of
  ``skip_o_proj_allreduce`` 16x); with it, 0.7-1.3% (25x)).
* **exact in bfloat16**: every scale set here is one whose stored ``w = scale - 1`` bfloat16 holds (``bf16_exact``).
  A ``(1 + w)`` near 0 loses its digits when w is rounded (0.1 stored as -0.9 is 0.1016 in bfloat16: token 0's row
  of ``input_norm``, ``attn.q`` and ``attn.k`` off by 1.6% in the references alone, 7x a correct rounding), and
  a trained model's weights are bfloat16 numbers. ``GAMMA * u`` is rounded to bfloat16 too: the sink's score is
  a row's largest, and its weights' rounding shifted it in every row (the 30- and 40-token prompts' ``attn.out``
  floor 1.3% -> 0.9%).
* **out of what the LM head reads**: final norm 0.03125 on ``S`` (the trained model's 0.19, median 9.3); the
  embedding's column ``S`` is 0.

Measured (HF float64, random prompts of 3-64 tokens, seed 0): ``S`` at token 0 after each of the 12 layers 1.7e3,
2.8e3, 6.7e3, 1.8e4, 2.8e4, 3.8e4, 4.3e4, 4.6e4, 4.8e4, 5.0e4, 4.6e4, 3.4e4, the same for every prompt to 0.4%.
What it reproduces of the trained model, next to it, is in ``tests/test_tpcheck/inputs/models/test_gemma_trained_preset.py``.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch

from tpcheck.inputs.models.weight_recipe import _outlier_units
from tpcheck.inputs.models.weight_recipe import family_options

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PRESETS = ("gemma3-trained",)  # drawn with this recipe (``make_checkpoint``: ``sink=True`` on a Gemma config)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")

# Gemma 3 270M: max |x| of the residual stream after each of its 18 layers (token 0, channel 400 then 163), / 1.04e5
PROFILE = (0.029, 0.049, 0.060, 0.10, 0.24, 0.40, 0.53, 0.66, 0.80, 0.85, 0.87, 0.95, 0.96, 0.98, 1.0, 0.97,
           0.80, 0.64)
PEAK = 5.0e4
K_CONST, REST_STD = 12.0, 1.0       # embedding: the constant channel K, the std of every other channel
BETA = 4.0                          # layer 0: |mean(e_P)| / C in o_proj's output at token 0
W_PA_J = 10.0                       # layer 0: post_attention_layernorm on J
ZETA_THR = 0.87                     # layer 0: the indicator fires where |mean| / |e_P| exceeds this
W_PF = dict(K=1.5, J=1.5, S=0.25)   # pre_feedforward_layernorm (all layers)
W_IN = dict(P=1.5, K=1.25, S=0.125)  # input_layernorm (P: layer 0 only)
W_QK_SINK, W_FINAL_S = 1.25, 0.03125  # q_norm / k_norm on the sink dims; final norm on S
INDICATOR = dict(gate=8.0, up=1.0)  # layer 0 units: gate (at token 0) and up weight on K
GROW = dict(gate=2.0, kappa=0.5, up=1.0)
PATTERN = (1.0, 0.6, -0.5, 0.3)     # down_proj of the four units on S (net 1.4)
KEY_SINK = 8.0                      # k_proj column S: norm of the sink key
VALUE_SINK = 2.5                    # v_proj column S: its draw times this (the sink's value, ~1/4 of a token's)
GAMMA = (0.15, 0.19, 0.13, 0.17)    # q_proj column K: the sink direction per query head


def gemma_channels(cfg: PretrainedConfig) -> dict:
    """The residual channels of the recipe: the massive channel ``S`` (163, the trained model's), the constant
    ``K``, the layer-0 indicator ``J`` and the ``P`` channels (the last ``head_dim - 1``) layer 0's values read."""
    h, d = cfg.hidden_size, _head_dim(cfg)
    return {"S": 163 % h, "K": 5, "J": 9, "P": list(range(h - (d - 1), h))}


def _head_dim(cfg: PretrainedConfig) -> int:
    """An explicit ``head_dim`` wins, as in HF."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sink_dims(d: int) -> list[int]:
    """The head dims of the sink direction ``u``: the lowest quarter of the RoPE frequencies (HF's half-split
    layout pairs dim ``i`` with ``i + d/2``; frequency ``base^(-2i/d)`` falls with ``i``)."""
    lo = d // 2 - d // 8
    return list(range(lo, d // 2)) + list(range(d - d // 8, d))


def s_profile(layers: int) -> list[float]:
    """``S`` at token 0 after each layer: ``PROFILE`` resampled linearly to ``layers`` layers, times ``PEAK``."""
    out = []
    for i in range(layers):
        x = (i + 0.5) * len(PROFILE) / layers - 0.5
        lo = min(max(int(math.floor(x)), 0), len(PROFILE) - 1)
        hi, f = min(lo + 1, len(PROFILE) - 1), min(max(x - lo, 0.0), 1.0)
        out.append(PEAK * (PROFILE[lo] * (1 - f) + PROFILE[hi] * f))
    return out


def post_ff_weights(cfg: PretrainedConfig) -> list[float]:
    """Each layer's signed ``post_feedforward_layernorm`` scale on ``S``: the step of ``s_profile`` over
    ``sqrt(hidden)`` (the saturated norm's output); its sign is the units' (decay layers write ``-S``)."""
    s = s_profile(cfg.num_hidden_layers)
    steps = [s[0]] + [b - a for a, b in zip(s, s[1:])]
    return [x / math.sqrt(cfg.hidden_size) for x in steps]


def embed_rms(cfg: PretrainedConfig) -> float:
    """The rms of every embedding row (the same for every token, by construction)."""
    ch = gemma_channels(cfg)
    n_rest = cfg.hidden_size - len(ch["P"]) - 3
    return math.sqrt((REST_STD ** 2 * (len(ch["P"]) + n_rest) + K_CONST ** 2) / cfg.hidden_size)


def _indicator(cfg: PretrainedConfig) -> tuple[float, float]:
    """Layer 0's units' (gate weight on K, gate weight on J): the gate is ``+INDICATOR["gate"]`` at token 0
    (``zeta = 1``) and crosses 0 at ``ZETA_THR``; the residual there is embedding ``* sqrt(hidden)`` (rms
    ``sqrt(hidden) * embed_rms``) plus the attention's normalised output (rms ~1, ignored)."""
    h = cfg.hidden_size

    def j(zeta: float) -> float:
        return math.sqrt(h) * W_PA_J / math.sqrt(BETA ** 2 * zeta ** 2 + 1)

    rms = math.sqrt(h) * embed_rms(cfg)
    k_hat = math.sqrt(h) * K_CONST * W_PF["K"] / rms
    # gate = a * (kappa * k_hat - j_hat); zero at ZETA_THR, +gate at zeta = 1
    a = INDICATOR["gate"] * rms / (W_PF["J"] * (j(ZETA_THR) - j(1.0)))
    kappa = W_PF["J"] * j(ZETA_THR) / rms / k_hat
    return a * kappa, -a


def _embed(t: torch.Tensor, ch: dict) -> None:
    """Every row: its P part and the rest rescaled to fixed norms, K constant, J and S 0 (module docstring)."""
    p = ch["P"]
    fixed = set(p) | {ch["K"], ch["J"], ch["S"]}
    rest = [i for i in range(t.shape[1]) if i not in fixed]
    for cols in (p, rest):
        part = t[:, cols]
        t[:, cols] = part * (REST_STD * math.sqrt(len(cols)) / part.norm(dim=1, keepdim=True))
    t[:, ch["K"]] = K_CONST
    t[:, [ch["J"], ch["S"]]] = 0.0


def _layer0_attention(rest: str, t: torch.Tensor, cfg: PretrainedConfig, ch: dict) -> None:
    """Query head 0 attends uniformly; its value is ``[e_P, const]``; o_proj writes them into P and J alone."""
    d, p, n = _head_dim(cfg), ch["P"], len(ch["P"])
    if rest == "self_attn.q_proj.weight":
        t[:d] = 0.0
    elif rest == "self_attn.v_proj.weight":
        t[:d] = 0.0
        t[torch.arange(n), p] = embed_rms(cfg) / W_IN["P"]   # v = e_P: the norm divided by embed_rms
        t[d - 1, ch["K"]] = embed_rms(cfg) / W_IN["K"] * REST_STD * math.sqrt(n) / (BETA * K_CONST)  # |e_P| / BETA
    elif rest == "self_attn.o_proj.weight":
        t[:, d:] *= 0.01   # the other heads write (almost) nothing: J's rms is head 0's
        t[:, :d] = 0.0
        t[[ch["J"], ch["K"], ch["S"]]] = 0.0
        t[p, torch.arange(n)] = 1.0
        t[ch["J"], d - 1] = 1.0


def _units(rest: str, t: torch.Tensor, units: list[int], ch: dict, layer: int, cfg: PretrainedConfig) -> None:
    """The four units of a layer: the indicator (layer 0) or the growth units, written into S alone."""
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        t[units] *= 0.05
        if layer == 0:
            on_k, on_j = _indicator(cfg)
            if rest == "mlp.gate_proj.weight":
                t[units, ch["K"]], t[units, ch["J"]] = on_k, on_j
            else:
                t[units, ch["K"]] = INDICATOR["up"]
        elif rest == "mlp.gate_proj.weight":
            t[units, ch["S"]], t[units, ch["K"]] = GROW["gate"], -GROW["gate"] * GROW["kappa"]
        else:
            t[units, ch["S"]] = GROW["up"]
    elif rest == "mlp.down_proj.weight":
        sign = 1.0 if post_ff_weights(cfg)[layer] >= 0 else -1.0
        t[ch["S"]] *= 0.001           # no other unit writes S (its norm weight multiplies by up to ~10^3)
        t[ch["K"]] = 0.0              # K stays the embedding's constant
        t[:, units] *= 0.05
        t[ch["S"], units] = sign * torch.tensor(PATTERN)


def _attention(rest: str, t: torch.Tensor, cfg: PretrainedConfig, ch: dict) -> None:
    """Layers 1..: the sink key (k_proj column S), its small value, every query's pull towards it."""
    d, heads = _head_dim(cfg), cfg.num_attention_heads
    u = torch.zeros(d)
    dims = sink_dims(d)
    u[dims] = 1.0 / math.sqrt(len(dims))
    if rest == "self_attn.k_proj.weight":
        t[:, ch["K"]] = 0.0
        t[:, ch["S"]] = KEY_SINK * u.repeat(t.shape[0] // d)
    elif rest == "self_attn.v_proj.weight":
        t[:, ch["S"]] *= VALUE_SINK
    elif rest == "self_attn.q_proj.weight":
        # bfloat16-exact: the sink's score is the largest of a row, and a rounded weight would shift it in every run
        t[:, ch["K"]] = torch.cat([GAMMA[h % len(GAMMA)] * u for h in range(heads)]).bfloat16().float()
    elif rest == "self_attn.o_proj.weight":
        t[ch["K"]] = 0.0
    elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        t[dims] = W_QK_SINK - 1.0


def _norm(rest: str, t: torch.Tensor, cfg: PretrainedConfig, ch: dict, layer: int) -> None:
    """Gemma stores ``w`` of a ``(1 + w)`` scale: each value here is a scale minus 1."""
    if rest == "input_layernorm.weight":
        t[ch["S"]], t[ch["K"]] = W_IN["S"] - 1.0, W_IN["K"] - 1.0
        if layer == 0:
            t[ch["P"]] = W_IN["P"] - 1.0
    elif rest == "post_attention_layernorm.weight" and layer == 0:
        t[ch["J"]] = W_PA_J - 1.0
    elif rest == "pre_feedforward_layernorm.weight":
        for k, w in W_PF.items():
            t[ch[k]] = w - 1.0
    elif rest == "post_feedforward_layernorm.weight":
        t[ch["S"]] = bf16_exact(abs(post_ff_weights(cfg)[layer])) - 1.0


def bf16_exact(scale: float) -> float:
    """``scale`` moved to the nearest one whose stored ``w = scale - 1`` bfloat16 (and float16) holds exactly."""
    return 1.0 + float(torch.tensor(scale - 1.0).to(torch.bfloat16))


def _add_gemma_sink(name: str, t: torch.Tensor, cfg: PretrainedConfig) -> torch.Tensor:
    """The trained-statistics recipe (module docstring), in place on the float32 tensor ``name`` of ``cfg``'s
    Gemma 3 model."""
    ch = gemma_channels(cfg)
    if name == "model.embed_tokens.weight":
        _embed(t, ch)
    elif name == "model.norm.weight":
        t[ch["S"]] = W_FINAL_S - 1.0
    elif (m := _LAYER.fullmatch(name)) is not None:
        layer, rest = int(m.group(1)), m.group(2)
        if rest.endswith("layernorm.weight"):
            _norm(rest, t, cfg, ch, layer)
        elif rest.startswith("self_attn.") and layer == 0:
            _layer0_attention(rest, t, cfg, ch)
        elif rest.startswith("self_attn."):
            _attention(rest, t, cfg, ch)
        elif rest.startswith("mlp."):
            _units(rest, t, _outlier_units(layer, cfg.intermediate_size), ch, layer, cfg)
    return t


def check_gemma_sink_config(cfg: PretrainedConfig) -> None:
    """ValueError unless ``cfg`` can carry the recipe: a Gemma 3 config (``family_options``), a head_dim of at
    least 16 whose P channels leave room for S, K and J, an intermediate size divisible by 4."""
    d, ch = _head_dim(cfg), gemma_channels(cfg)
    own = (ch["S"], ch["K"], ch["J"])
    need = {"a Gemma 3 config": family_options(cfg)["gemma"], "head_dim >= 16": d >= 16,
            f"hidden > head_dim + 162 ({d + 162}): S, K and J apart from the P channels":
                len(set(own)) == 3 and max(own) < ch["P"][0],
            "intermediate size divisible by 4": cfg.intermediate_size % 4 == 0}
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        raise ValueError(f"the Gemma trained-statistics recipe needs {', '.join(missing)}")
