"""What a synthetic checkpoint's tensors hold: which tensors an HF config's model has (``_tensor_specs``, in the
fixed draw order), the value each is drawn with (``_draw``) and the massive-activation recipe (``_add_outliers``).
``tpcheck.inputs.models.checkpoints`` writes them; its RECIPE_VERSION covers everything here.

Value recipe (float32 ``torch.Generator`` seeded with ``seed``, then cast to ``dtype``;
tensors are drawn in one fixed order, so output is bit-for-bit deterministic for
(preset, seed, dtype) and independent of ``shards``): linear weights N(0, 1/fan_in),
embeddings N(0, 1), biases N(0, 0.5**2), norm weights ``1 + s*u`` with u ~ U(0.2, 0.6)
and a random sign s (Gemma 3's norms, which scale by ``1 + w``, store ``s*u``: the same scales; its two extra norms
per layer are drawn after the other two).  Activations stay O(1)-O(10) through many layers, finite in fp16.
``_tensor_specs`` lists the tensors each family has, in draw order; for a Qwen2 config they are the
ones (and the order) of RECIPE_VERSION 1, so Qwen2 checkpoints are unchanged byte for byte; dense families'
specs do not change with the mixture-of-experts ones (a sparse layer's MLP tensors replace the dense ones in
the same place of the order: the router, each expert's gate / up / down, the shared expert and its gate).
Routers, experts and the shared expert's gate are linear weights (N(0, 1/fan_in)); ``_tie_router`` makes a
router's rows near-tied pairs for the ``ROUTER_TIES`` presets.
"""

from __future__ import annotations

import re

import torch
from impl.config import FAMILIES
from impl.config import family_biases


def _family(cfg):
    """impl's ``Family`` of an HF config (its ``model_type``), or a ValueError naming the supported ones."""
    family = FAMILIES.get(getattr(cfg, "model_type", None))
    if family is None:
        raise ValueError(f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(FAMILIES)}")
    return family


def family_options(cfg) -> dict[str, bool]:
    """Which optional tensors an HF config's model has, spelt as ``impl.config.Family`` says the family spells
    them (the same reading as ``impl.config.load_config``, which ``make_config_checkpoint`` checks against):
    ``qkv_bias``, ``o_proj_bias``, ``mlp_bias`` (gate/up/down biases) and ``qk_norm`` (per-head q/k norms)."""
    family = _family(cfg)
    qkv, o = family_biases(family, cfg)
    return {"qkv_bias": qkv, "o_proj_bias": o, "mlp_bias": family.mlp_bias and bool(getattr(cfg, "mlp_bias", False)),
            "qk_norm": family.qk_norm, "gemma": family.gemma}


def moe_options(cfg) -> dict | None:
    """The experts of an HF config's model as its family spells them (``impl.moe_config.MoeSpelling``): number,
    width, shared expert width, which layers are sparse (HF's rule), checkpoint names; None for a dense family.
    ``make_config_checkpoint`` checks it against impl's reading (``impl.config.load_config``)."""
    spelling = _family(cfg).moe
    if spelling is None:
        return None
    n = cfg.num_hidden_layers
    if spelling.sparse_step:
        only, step = list(getattr(cfg, "mlp_only_layers", None) or []), getattr(cfg, "decoder_sparse_step", 1)
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
    else:
        sparse = (True,) * n
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) if spelling.shared_expert else 0
    return {"num_experts": getattr(cfg, spelling.experts_key), "intermediate_size": getattr(cfg, spelling.intermediate_key),
            "shared_expert_intermediate_size": shared, "sparse_layers": sparse,
            "prefix": spelling.checkpoint_prefix, "expert_names": spelling.expert_names}


def _moe_specs(i: int, h: int, moe: dict) -> list[tuple[str, tuple[int, int], str]]:
    """Layer ``i``'s sparse-MLP tensors in draw order: router, each expert's gate / up / down, shared expert
    gate / up / down and its gate (Qwen2-MoE)."""
    m, inter, shared = f"model.layers.{i}.{moe['prefix']}.", moe["intermediate_size"], moe["shared_expert_intermediate_size"]
    g, u, d = moe["expert_names"]
    specs = [(m + "gate.weight", (moe["num_experts"], h), "linear")]
    for e in range(moe["num_experts"]):
        x = f"{m}experts.{e}."
        specs += [(x + g + ".weight", (inter, h), "linear"), (x + u + ".weight", (inter, h), "linear"),
                  (x + d + ".weight", (h, inter), "linear")]
    if shared:
        x = m + "shared_expert."
        specs += [(x + "gate_proj.weight", (shared, h), "linear"), (x + "up_proj.weight", (shared, h), "linear"),
                  (x + "down_proj.weight", (h, shared), "linear"), (m + "shared_expert_gate.weight", (1, h), "linear")]
    return specs


def _tensor_specs(cfg) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the HF config ``cfg``'s model, in the fixed generation order:
    per layer q/k/v (each with its bias where the model has one), o_proj (+ bias), Qwen3's q_norm / k_norm,
    gate / up / down (+ biases), the two norms. Where a family lacks an optional tensor nothing is drawn for
    it, so a Qwen2 config draws exactly the tensors, in the order, of RECIPE_VERSION 1."""
    opt, moe = family_options(cfg), moe_options(cfg)
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads  # an explicit head_dim wins, as in HF
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    specs = [("model.embed_tokens.weight", (v, h), "embed")]

    def linear(name: str, shape: tuple[int, int], bias: bool) -> list:
        return [(name + ".weight", shape, "linear")] + ([(name + ".bias", (shape[0],), "bias")] if bias else [])

    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        specs += linear(a + "q_proj", (q, h), opt["qkv_bias"]) + linear(a + "k_proj", (kv, h), opt["qkv_bias"])
        specs += linear(a + "v_proj", (kv, h), opt["qkv_bias"]) + linear(a + "o_proj", (h, q), opt["o_proj_bias"])
        if opt["qk_norm"]:
            norm = "gemma_norm" if opt["gemma"] else "norm"
            specs += [(a + "q_norm.weight", (d,), norm), (a + "k_norm.weight", (d,), norm)]
        if moe is not None and moe["sparse_layers"][i]:
            specs += _moe_specs(i, h, moe)
        else:
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                specs += linear(m + name, shape, opt["mlp_bias"])
        norm = "gemma_norm" if opt["gemma"] else "norm"
        specs += [(f"model.layers.{i}.input_layernorm.weight", (h,), norm),
                  (f"model.layers.{i}.post_attention_layernorm.weight", (h,), norm)]
        if opt["gemma"]:  # Gemma 3's norms before and after the MLP (the one above is after attention)
            specs += [(f"model.layers.{i}.pre_feedforward_layernorm.weight", (h,), norm),
                      (f"model.layers.{i}.post_feedforward_layernorm.weight", (h,), norm)]
    specs.append(("model.norm.weight", (h,), "gemma_norm" if opt["gemma"] else "norm"))
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.weight", (v, h), "linear"))
    return specs


def _draw(shape: tuple[int, ...], kind: str, gen: torch.Generator, bias_std: float = 0.5) -> torch.Tensor:
    """One float32 tensor following the value recipe in the module docstring."""
    if kind == "embed":
        return torch.randn(shape, generator=gen)
    if kind == "linear":
        return torch.randn(shape, generator=gen).mul_(shape[1] ** -0.5)
    if kind == "bias":
        return torch.randn(shape, generator=gen).mul_(bias_std)
    u = torch.rand(shape, generator=gen).mul_(0.4).add_(0.2)
    sign = torch.randint(0, 2, shape, generator=gen).mul_(2).sub_(1)
    # Gemma stores the offset from 1 (its norms scale by 1 + w): the same scales, written as Gemma writes them
    return u.mul_(sign) if kind == "gemma_norm" else u.mul_(sign).add_(1.0)


_ROUTER = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate\.weight")


def _tie_router(name: str, t: torch.Tensor, spread: float) -> torch.Tensor:
    """The near-tie routing recipe (in place on the float32 tensor ``name``): a router ``[E, hidden]``'s odd rows
    become their even neighbour plus ``spread`` times their own draw, so experts ``2i`` and ``2i+1`` get logits
    that differ by ``spread * (w_{2i+1} . x)``, about ``spread * |x| / sqrt(hidden)``; no extra draw, so the other
    tensors are those of the same seed without it."""
    if _ROUTER.fullmatch(name) is not None:
        n = t.shape[0] // 2 * 2  # an odd last expert keeps its own row
        t[1:n:2] = t[0:n:2] + spread * t[1:n:2]
    return t


def outlier_channels(hidden: int) -> list[int]:
    """The two residual channels the massive-activation recipe makes large."""
    return [hidden // 3, (2 * hidden) // 3 + 1]


def _outlier_units(layer: int, inter: int) -> list[int]:
    """One MLP unit in each quarter of the intermediate dim, so at tp 2 and 4 every rank's down_proj
    shard holds part of the outlier's sum (the partial products a TP engine rounds)."""
    q = inter // 4
    return [k * q + (layer * 7) % q for k in range(4)]


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def _add_outliers(name: str, t: torch.Tensor, cfg, strength: float) -> torch.Tensor:
    """The massive-activation recipe (in place on the float32 tensor ``name``): trained LLMs carry a few
    residual channels in the hundreds while the rest stay near 1, grown by the MLPs layer after layer and
    kept out of the normalized activations by small norm weights on those channels.

    * the embedding writes ``+2s`` / ``-1.5s`` into the two channels (``outlier_channels``) for every token;
    * in each layer four MLP units (``_outlier_units``, one per quarter of the intermediate dim) read the
      channels through ``post_attention_layernorm`` (weights 0.25 / -0.3 there) with gate and up weights
      of 2 / 1.6, and ``down_proj`` writes them back with weights ``s * (1, 0.6, -0.5, 0.3)`` of mixed sign,
      so the down_proj sum is a difference of larger partial products (the units' other down_proj weights
      are scaled by 0.05: they write almost only into the outlier channels);
    * ``input_layernorm`` (0.03 / 0.04) and the final norm (0.02 / -0.03) keep the channels small in what
      attention and the LM head read."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    c = outlier_channels(h)
    if name == "model.embed_tokens.weight":
        t[:, c[0]] += 2.0 * strength
        t[:, c[1]] -= 1.5 * strength
    elif name == "model.norm.weight":
        t[c] = torch.tensor([0.02, -0.03])
    elif (m := _LAYER.fullmatch(name)) is not None:
        units, rest = _outlier_units(int(m.group(1)), inter), m.group(2)
        if rest == "input_layernorm.weight":
            t[c] = torch.tensor([0.03, 0.04])
        elif rest == "post_attention_layernorm.weight":
            t[c] = torch.tensor([0.25, -0.3])
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            t[units, c[0]] += 2.0
            t[units, c[1]] += 1.6
        elif rest == "mlp.down_proj.weight":
            d = torch.tensor([1.0, 0.6, -0.5, 0.3]) * strength
            t[:, units] *= 0.05  # the units write (almost) only into the outlier channels
            t[c[0], units] += d
            t[c[1], units] -= 0.7 * d
    return t
