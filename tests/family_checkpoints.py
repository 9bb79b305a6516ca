"""Synthetic Hugging Face checkpoints of the non-Qwen2 families (Llama, Mistral, Qwen3) for impl's tests.

The checkpoint is what HF itself writes: the family's own config class and ``save_pretrained`` of its own
randomly initialised ``*ForCausalLM`` (so the tensor names, the tied head and the config layout are HF's),
with every parameter redrawn so that each tensor is distinguishable: loading any tensor wrongly (transposed,
swapped with a sibling, skipped, left at HF's init) changes the output.

Value recipe (the one of ``tpcheck.inputs.models.checkpoints``; float32 ``torch.Generator`` seeded with ``seed``, parameters
drawn in the model's registration order, then cast to ``dtype``): linear weights N(0, 1/fan_in), embeddings
N(0, 1), biases N(0, 0.5**2) (never HF's zeros), norm weights ``1 + s*u`` with u ~ U(0.2, 0.6) and a random
sign ``s`` (never HF's ones) -- Qwen3's per-head ``q_norm`` / ``k_norm`` included.

Presets (tiny, vocab padded at tp 2/4, every one with KV heads replicated at tp 4):

* ``llama``          8 heads / 2 KV heads, head_dim 8 = hidden / heads, untied, no biases.
* ``llama3-rope``    ``rope_type: llama3`` (factor 8, low/high freq factor 1/4) with
                     original_max_position_embeddings 32, so the remap changes 7 of the 8 frequency pairs
                     and shows at short positions; tied.
* ``llama-bias``     ``attention_bias`` (q/k/v and o_proj biases) and ``mlp_bias``; ``head_dim`` 16 != 64/8.
* ``mistral``        ``sliding_window`` 12 (every layer sees only its 12 most recent tokens), tied.
* ``qwen3``          4 heads / 1 KV head (replicated at tp 2 and 4), head_dim 16, q/k norm, tied.
* ``qwen3-swa``      3 layers, ``use_sliding_window`` with window 10 from layer 1 on (``max_window_layers`` 1),
                     ``attention_bias`` on, untied.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import torch
import transformers
from transformers.utils import logging as hf_logging

from impl.config import HF_DTYPE_KEY

# model_type -> (HF config class, HF causal LM class)
HF_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_TINY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=2, vocab_size=250, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, rope_theta=10000.0, tie_word_embeddings=False)

FAMILY_PRESETS: dict[str, dict] = {
    "llama": dict(_TINY, model_type="llama"),
    "llama3-rope": dict(_TINY, model_type="llama", rope_theta=500000.0, head_dim=16, num_attention_heads=4,
                        vocab_size=301, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-bias": dict(_TINY, model_type="llama", attention_bias=True, mlp_bias=True, head_dim=16,
                       intermediate_size=128, rope_theta=1000000.0),
    "mistral": dict(_TINY, model_type="mistral", sliding_window=12, vocab_size=203, tie_word_embeddings=True),
    "qwen3": dict(_TINY, model_type="qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  intermediate_size=80, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3-swa": dict(_TINY, model_type="qwen3", num_hidden_layers=3, head_dim=16, attention_bias=True,
                      use_sliding_window=True, sliding_window=10, max_window_layers=1),
}


def family_config(config: str | dict, dtype: str = "float32") -> transformers.PretrainedConfig:
    """The HF config of a preset name or of a dict of config keywords with ``model_type`` (one of
    ``HF_CLASSES``), with ``dtype`` and the architecture recorded in it."""
    kwargs = dict(FAMILY_PRESETS[config] if isinstance(config, str) else config)
    model_type = kwargs.pop("model_type")
    if model_type not in HF_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not one of {sorted(HF_CLASSES)}")
    config_cls, model_cls = HF_CLASSES[model_type]
    return getattr(transformers, config_cls)(**kwargs, **{HF_DTYPE_KEY: dtype}, architectures=[model_cls])


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One float32 tensor following the value recipe in the module docstring, chosen by the tensor name."""
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):  # input/post-attention/final norms and Qwen3's q_norm / k_norm
        u = torch.rand(shape, generator=gen).mul_(0.4).add_(0.2)
        sign = torch.randint(0, 2, shape, generator=gen).mul_(2).sub_(1)
        return u.mul_(sign).add_(1.0)
    if name.endswith(".bias"):
        return torch.randn(shape, generator=gen).mul_(0.5)
    if len(shape) != 2:
        raise ValueError(f"no value recipe for {name} of shape {list(shape)}")
    return torch.randn(shape, generator=gen).mul_(shape[1] ** -0.5)


def make_family_checkpoint(config: str | dict | transformers.PretrainedConfig, out: str | os.PathLike,
                           seed: int = 0, dtype: str = "float32") -> pathlib.Path:
    """Write a random-weight HF checkpoint (config.json + model.safetensors) of ``config`` (a preset name, a
    keyword dict with ``model_type``, or an HF config) into the missing or empty directory ``out``; written
    in a temporary sibling and renamed into place. Returns ``out`` as a Path."""
    cfg = config if isinstance(config, transformers.PretrainedConfig) else family_config(config, dtype)
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"checkpoint destination exists and is not empty: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint would bury test output
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: listed (and drawn) once
            p.copy_(_draw(name, tuple(p.shape), gen))
    model.to(getattr(torch, dtype))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def family_checkpoint(preset: str, root: str | os.PathLike, seed: int = 0, dtype: str = "float32") -> pathlib.Path:
    """``root/<preset>-s<seed>-<dtype>``, written on first use."""
    path = pathlib.Path(root) / f"{preset}-s{seed}-{dtype}"
    if (path / "config.json").is_file():
        return path
    return make_family_checkpoint(preset, path, seed=seed, dtype=dtype)


def load_hf_family_model(model_dir: str | os.PathLike, dtype: str = "float32") -> torch.nn.Module:
    """HF's own causal LM of a checkpoint directory (the class its config names), in eval mode."""
    hf_logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), **{HF_DTYPE_KEY: getattr(torch, dtype)}).eval()
