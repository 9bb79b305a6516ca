"""Model configuration: read through transformers' own ``Qwen2Config`` so impl and HF never disagree on
a default, plus the checks HF does not do for us (a missing ``rope_theta`` is an error, not 10000)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


_TF_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])
# transformers 5 resolves rope_theta / rope_scaling into config.rope_parameters; 4.x reads them at the top level
TRANSFORMERS_5 = _TF_VERSION >= (5, 0)
# the keyword (from_pretrained, configs) naming the weights' dtype: ``dtype`` since transformers 4.56; before,
# ``dtype`` is taken for an unknown config attribute and the model silently loads in float32
HF_DTYPE_KEY = "dtype" if _TF_VERSION >= (4, 56) else "torch_dtype"


class ConfigError(ValueError):
    """A checkpoint config or engine setting that impl refuses, with the numbers in the message."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def hf_rope_theta(hf: Qwen2Config) -> float:
    """The theta HF's Qwen2 rotary embedding uses: ``rope_parameters["rope_theta"]`` in transformers 5 (which
    wins when a file has both), the top-level ``rope_theta`` in 4.x (where a ``rope_parameters`` key is
    just an unread attribute)."""
    params = _rope_parameters(hf)
    return float(params["rope_theta"] if "rope_theta" in params else hf.rope_theta)


def _rope_parameters(hf: Qwen2Config) -> dict:
    """``rope_parameters`` as HF reads it: transformers 5 only (in 4.x the key is an unread attribute)."""
    return (getattr(hf, "rope_parameters", None) or {}) if TRANSFORMERS_5 else {}


def _rope_theta(raw: dict, hf: Qwen2Config, path: Path) -> float:
    """The theta HF itself will use, after checking on the raw file that HF will not fill in 10000 silently."""
    nested = "rope_theta" in (raw.get("rope_parameters") or {})
    if "rope_theta" not in raw and not nested:
        raise ConfigError(f"{path}: no rope_theta (neither 'rope_theta' nor 'rope_parameters.rope_theta'); "
                          "impl does not guess a default")
    if "rope_theta" not in raw and not TRANSFORMERS_5:
        raise ConfigError(f"{path}: rope_theta is only in 'rope_parameters' (the transformers 5 layout); "
                          f"transformers {transformers.__version__} reads the top-level 'rope_theta' and would use "
                          "10000: add a top-level rope_theta or use transformers >= 5")
    params = _rope_parameters(hf)
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"{path}: rope type {kind!r} is not supported (only the default neox RoPE)")
    return hf_rope_theta(hf)


@dataclass(frozen=True)
class ModelConfig:
    """The numbers impl needs, taken from the HF config (``hf``) of a checkpoint directory."""

    hf: Qwen2Config
    model_dir: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size the head layout cannot be split over, with the numbers."""
        if tp < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp}")
        if self.intermediate_size % tp:
            raise ConfigError(f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp}")
        kv = self.num_kv_heads
        if tp <= kv and kv % tp:
            raise ConfigError(f"num_key_value_heads={kv} is not divisible by tp_size={tp}")
        if tp > kv and tp % kv:
            raise ConfigError(f"tp_size={tp} > num_key_value_heads={kv} needs tp_size % num_key_value_heads == 0 "
                              "to replicate KV heads")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` of a Qwen2 checkpoint directory; anything not Qwen2 is refused."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") != "qwen2":
        raise ConfigError(f"{path}: model_type is {raw.get('model_type')!r}, impl supports only 'qwen2'")
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{path}: use_sliding_window=true is not supported")
    hf = Qwen2Config.from_pretrained(str(model_dir))
    theta = _rope_theta(raw, hf, path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        hf=hf, model_dir=str(model_dir), hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size, rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps, max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings), eos_token_ids=eos_ids,
    )
