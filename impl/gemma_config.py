"""What Gemma 3 (``model_type: gemma3_text``) spells in its config beyond the other families, read and checked here
so that ``impl.config`` stays one reader for all families.

* Two RoPE bases: the global (``full_attention``) layers use ``rope_theta`` (1e6 in Gemma 3), the local
  (``sliding_attention``) layers ``rope_local_base_freq`` (1e4). transformers 5 nests both in
  ``rope_parameters[layer_type]["rope_theta"]``; 4.x reads the two top-level keys. HF fills in 1e6 / 1e4 when a file
  has neither: impl refuses such a file (a missing base is an error, never a default).
* The attention scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
* The activation is ``hidden_activation`` (``gelu_pytorch_tanh``), not ``hidden_act``.
* What impl does not implement is refused by name: attention / final logit soft-capping, bidirectional attention, a
  RoPE type other than the default on either kind of layer (the 4B+ checkpoints' ``linear`` scaling)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from impl.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GemmaOptions:
    """Gemma 3's own numbers: the local layers' RoPE base and the attention scale."""

    rope_local_theta: float
    attn_scale: float


def _raw_theta(raw: dict, layer_type: str, flat_key: str) -> object:
    nested = (raw.get("rope_parameters") or {}).get(layer_type) or {}
    return nested.get("rope_theta", raw.get(flat_key))


def read_gemma(raw: dict, hf: PretrainedConfig, path: Path, transformers_5: bool) -> tuple[float, GemmaOptions]:
    """(the global layers' RoPE theta, ``GemmaOptions``) of a ``gemma3_text`` config; the raw file is checked for what
    HF would fill in silently, HF's config object gives the values it will use."""
    for layer_type, key in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
        if _raw_theta(raw, layer_type, key) is None:
            raise ConfigError(f"{path}: no RoPE base for the {layer_type} layers (neither '{key}' nor "
                              f"'rope_parameters.{layer_type}.rope_theta'); impl does not guess a default")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf, key, None) is not None:
            raise ConfigError(f"{path}: {key}={getattr(hf, key)!r} is not supported (Gemma 3 has none; Gemma 2's "
                              "soft-capping is not implemented)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError(f"{path}: use_bidirectional_attention=true is not supported (causal attention only)")
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ConfigError(f"{path}: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    if transformers_5:
        params = getattr(hf, "rope_parameters", None) or {}
        thetas = {}
        for layer_type in LAYER_TYPES:
            p = params.get(layer_type) or {}
            kind = p.get("rope_type", "default")
            if kind != "default":
                raise ConfigError(f"{path}: rope type {kind!r} on the {layer_type} layers is not supported "
                                  "(default RoPE only)")
            thetas[layer_type] = float(p["rope_theta"])
        full, local = thetas["full_attention"], thetas["sliding_attention"]
    else:
        scaling = getattr(hf, "rope_scaling", None) or {}
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind != "default":
            raise ConfigError(f"{path}: rope type {kind!r} is not supported (default RoPE only)")
        full, local = float(hf.rope_theta), float(hf.rope_local_base_freq)
    for name, theta in (("rope_theta", full), ("rope_local_base_freq", local)):
        if not theta > 0:
            raise ConfigError(f"{path}: {name}={theta!r} must be positive")
    return full, GemmaOptions(rope_local_theta=local, attn_scale=float(scalar) ** -0.5)


def gemma_layer_types(hf: PretrainedConfig) -> list[str]:
    """Gemma 3's layer types where the config lists none (transformers < 4.53): every ``sliding_window_pattern``-th
    layer global (6 if unset, as HF's own default), the others sliding."""
    pattern = getattr(hf, "sliding_window_pattern", None) or getattr(hf, "_sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf.num_hidden_layers)]
