"""Synthetic Hugging Face checkpoints of every family impl runs (Qwen2, Llama, Mistral, Qwen3): random weights
in the real HF layout.

These are the test inputs for the whole project.  ``transformers`` loads them with the family's own class
(``Qwen2ForCausalLM.from_pretrained(dir)``, ``LlamaForCausalLM`` ..., as ``impl.config.FAMILIES`` names it)
with no missing or unexpected keys, and every tensor is distinguishable: biases (where the family and config
have them) are clearly non-zero, every norm weight (Qwen3's per-head q/k norms included) is well away from 1
(and from 0), gate and up are drawn independently, and an untied lm_head is independent of the embedding.
Loading any tensor wrongly (transposed, swapped with a sibling, skipped, left at its default) changes the
model output.

Qwen2 presets (no ``model_type`` key: a preset dict is a ``Qwen2Config``'s keywords; head_dim = hidden /
heads = 8 or 16 for the tiny ones):

* ``tiny``        8 heads / 2 KV heads: KV heads are replicated at tp 4.  vocab 250 is
                  not divisible by 4 (and not a multiple of 64): vocab padding.  Tied.
* ``tiny-untied`` like tiny, 3 layers, odd vocab 301 (padding at tp 2 and 4), untied
                  lm_head, rope_theta 1e6.
* ``tiny-mha``    4 heads / 4 KV heads (plain MHA, no replication), vocab 256 divides
                  evenly, untied.
* ``tiny-mqa``    4 heads / 1 KV head: KV replicated at tp 2 and 4; odd vocab 203; tied.
* ``small``       a slightly larger GQA model (4 layers, replication at tp 4), untied.
* ``small-outliers`` trained-model statistics (6 layers, 12/2 heads, hidden 192): two residual
                  channels grow to the hundreds with depth (``_add_outliers``), the rest stay O(1);
                  where a one-device noise floor fails correct TP engines in bfloat16/float16.
* ``qwen2.5-0.5b`` the real Qwen2.5-0.5B shape (14 heads / 2 KV heads, so tp 1 or 2;
                  tied; ~2 GB in float32) with random weights, for scale tests.

Other families (``model_type`` in the dict picks the family's config class; every one splits at tp 1, 2
and 4, with KV heads replicated at tp 4):

* ``tiny-llama``      Llama 3: ``rope_type: llama3`` (factor 8, low/high freq factor 1/4) with
                      original_max_position_embeddings 32, so the remap changes 3 of the 4 frequency pairs
                      by up to 8x and shows from the first positions; no biases; odd vocab 253; untied.
* ``small-llama``     Llama 3.2-like: 4 layers, llama3 RoPE (factor 32, original 64 positions), tied.
* ``tiny-llama-bias`` Llama 2 style (default RoPE) with ``attention_bias`` (q/k/v and o_proj biases) and
                      ``mlp_bias`` (gate/up/down biases); head_dim 16 != hidden / heads = 8; tied.
* ``tiny-mistral``    ``sliding_window`` 12: every layer attends to its 12 most recent tokens, so any prompt
                      or generation longer than 12 tokens depends on the window; odd vocab 203; untied.
* ``tiny-qwen3``      per-head q/k RMSNorm before RoPE; 4 heads / 1 KV head (replicated at tp 2 and 4),
                      head_dim 32 != hidden / heads = 16; tied.
* ``small-qwen3``     4 layers, 8 heads / 2 KV heads, head_dim 32 != 128 / 8, q/k norms; untied.

Value recipe (float32 ``torch.Generator`` seeded with ``seed``, then cast to ``dtype``;
tensors are drawn in one fixed order, so output is bit-for-bit deterministic for
(preset, seed, dtype) and independent of ``shards``): linear weights N(0, 1/fan_in),
embeddings N(0, 1), biases N(0, 0.5**2), norm weights ``1 + s*u`` with u ~ U(0.2, 0.6)
and a random sign s.  Activations stay O(1)-O(10) through many layers, finite in fp16.
``_tensor_specs`` lists the tensors each family has, in draw order; for a Qwen2 config they are the
ones (and the order) of RECIPE_VERSION 1, so Qwen2 checkpoints are unchanged byte for byte.
"""

from __future__ import annotations

import errno
import re
import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Version of what a checkpoint's bytes are made from: the value recipe (module docstring, ``_draw``), the
# massive-activation recipe (``_add_outliers``), the tensor draw order and the PRESETS configs. It is part of
# the cache key (``cache_key``), so a cache never hands back a checkpoint made by an older recipe.
# Bump it whenever any of these changes what a (preset, seed, dtype) writes.
RECIPE_VERSION = 1

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_TINY = dict(max_position_embeddings=1024, rms_norm_eps=1e-6, use_sliding_window=False,
             bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=96, num_hidden_layers=2, vocab_size=250,
                 tie_word_embeddings=True, rope_theta=10000.0),
    "tiny-untied": dict(_TINY, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                        intermediate_size=96, num_hidden_layers=3, vocab_size=301,
                        tie_word_embeddings=False, rope_theta=1000000.0),
    "tiny-mha": dict(_TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=128, num_hidden_layers=2, vocab_size=256,
                     tie_word_embeddings=False, rope_theta=10000.0),
    "tiny-mqa": dict(_TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=80, num_hidden_layers=2, vocab_size=203,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "small": dict(_TINY, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=352, num_hidden_layers=4, vocab_size=1000,
                  tie_word_embeddings=False, rope_theta=1000000.0,
                  max_position_embeddings=2048),
    "qwen2.5-0.5b": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, num_hidden_layers=24, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, bos_token_id=151643,
                         eos_token_id=151645, use_sliding_window=False),
    "small-outliers": dict(_TINY, hidden_size=192, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=512, num_hidden_layers=6, vocab_size=1000,
                           tie_word_embeddings=False, rope_theta=1000000.0,
                           max_position_embeddings=2048),
}

# the other families: the same value recipe, the family's own config class (``model_type``)
_FAMILY = dict(max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
_TINY_SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=2)
_SMALL_SHAPE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=352,
                    num_hidden_layers=4, vocab_size=1000, max_position_embeddings=2048)


def _llama3(factor: float, original: int) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


PRESETS.update({
    "tiny-llama": dict(_FAMILY, **_TINY_SHAPE, model_type="llama", vocab_size=253, tie_word_embeddings=False,
                       rope_theta=500000.0, rope_scaling=_llama3(8.0, 32)),
    "small-llama": dict(_FAMILY, **_SMALL_SHAPE, model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling=_llama3(32.0, 64)),
    "tiny-llama-bias": dict(_FAMILY, **_TINY_SHAPE, model_type="llama", vocab_size=250, head_dim=16,
                            attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=10000.0),
    "tiny-mistral": dict(_FAMILY, **_TINY_SHAPE, model_type="mistral", vocab_size=203, sliding_window=12,
                         tie_word_embeddings=False, rope_theta=1000000.0),
    "tiny-qwen3": dict(_FAMILY, **dict(_TINY_SHAPE, num_attention_heads=4, num_key_value_heads=1, intermediate_size=80),
                       model_type="qwen3", vocab_size=250, head_dim=32, tie_word_embeddings=True,
                       rope_theta=1000000.0),
    "small-qwen3": dict(_FAMILY, **dict(_SMALL_SHAPE, intermediate_size=256), model_type="qwen3", head_dim=32,
                        tie_word_embeddings=False, rope_theta=1000000.0),
})

# presets drawn with the massive-activation recipe (``outliers=`` of ``make_config_checkpoint``)
OUTLIERS: dict[str, float] = {"small-outliers": 1.0}


def preset_names() -> list[str]:
    """Names of the available presets, in definition order."""
    return list(PRESETS)


def config_family(config: dict) -> str:
    """The ``model_type`` of a preset's or drawn config's keyword dict (``"qwen2"`` when it has none)."""
    return config.get("model_type", "qwen2")


def preset_family(name: str) -> str:
    """The ``model_type`` of preset ``name`` (``qwen2``, ``llama``, ``mistral``, ``qwen3``)."""
    return config_family(_check_preset(name))


def preset_available(name: str) -> bool:
    """Whether the installed transformers can read preset ``name``'s family (Qwen3 needs transformers >= 4.51)."""
    from impl.config import FAMILIES
    return FAMILIES[preset_family(name)].available


def describe_preset(name: str) -> str:
    """One line of ``tpcheck presets``: family, sizes, and what sets the preset apart."""
    c = _check_preset(name)
    hd = c.get("head_dim")
    extra = [f"head_dim {hd}"] if hd else []
    scaling = c.get("rope_scaling")
    if scaling:
        extra.append(f"{scaling['rope_type']} rope (original {scaling['original_max_position_embeddings']} positions)")
    if c.get("sliding_window") is not None and config_family(c) == "mistral":
        extra.append(f"sliding window {c['sliding_window']}")
    biases = [b for b in ("attention_bias", "mlp_bias") if c.get(b)]
    if biases:
        extra.append("+".join(biases))
    return (f"{name:15s} {config_family(c):7s} hidden {c['hidden_size']:4d}  heads {c['num_attention_heads']:2d}/"
            f"{c['num_key_value_heads']} kv  layers {c['num_hidden_layers']:2d}  vocab {c['vocab_size']:6d}  "
            f"{'tied' if c.get('tie_word_embeddings') else 'untied'}" + "".join(f"; {e}" for e in extra))


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _check_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(name: str, dtype: str = "float32") -> PretrainedConfig:
    """The HF config of preset ``name`` (its family's config class: ``Qwen2Config``, ``LlamaConfig``, ...) with
    ``dtype`` recorded in it.

    Raises ValueError for an unknown preset (listing the valid names) or dtype.
    Note: transformers 5.x stores ``rope_theta`` (and ``rope_scaling``) inside ``config.rope_parameters``.
    """
    return config_from_kwargs(_check_preset(name), dtype)


def _family(cfg):
    """impl's ``Family`` of an HF config (its ``model_type``), or a ValueError naming the supported ones."""
    from impl.config import FAMILIES
    family = FAMILIES.get(getattr(cfg, "model_type", None))
    if family is None:
        raise ValueError(f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(FAMILIES)}")
    return family


def family_options(cfg) -> dict[str, bool]:
    """Which optional tensors an HF config's model has, spelt as ``impl.config.Family`` says the family spells
    them (the same reading as ``impl.config.load_config``, which ``make_config_checkpoint`` checks against):
    ``qkv_bias``, ``o_proj_bias``, ``mlp_bias`` (gate/up/down biases) and ``qk_norm`` (per-head q/k norms)."""
    family = _family(cfg)
    if family.qkv_bias == "attention_bias":  # Llama, Qwen3: one flag biases q/k/v and o_proj
        qkv = o = bool(getattr(cfg, "attention_bias", False))
    else:
        qkv, o = bool(family.qkv_bias), False
    return {"qkv_bias": qkv, "o_proj_bias": o, "mlp_bias": family.mlp_bias and bool(getattr(cfg, "mlp_bias", False)),
            "qk_norm": family.qk_norm}


def _tensor_specs(cfg) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the HF config ``cfg``'s model, in the fixed generation order:
    per layer q/k/v (each with its bias where the model has one), o_proj (+ bias), Qwen3's q_norm / k_norm,
    gate / up / down (+ biases), the two norms. Where a family lacks an optional tensor nothing is drawn for
    it, so a Qwen2 config draws exactly the tensors, in the order, of RECIPE_VERSION 1."""
    opt = family_options(cfg)
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
            specs += [(a + "q_norm.weight", (d,), "norm"), (a + "k_norm.weight", (d,), "norm")]
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            specs += linear(m + name, shape, opt["mlp_bias"])
        specs += [(f"model.layers.{i}.input_layernorm.weight", (h,), "norm"),
                  (f"model.layers.{i}.post_attention_layernorm.weight", (h,), "norm")]
    specs.append(("model.norm.weight", (h,), "norm"))
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
    return u.mul_(sign).add_(1.0)


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


def _split(sizes: list[int], shards: int) -> list[int]:
    """Shard index of each tensor: contiguous groups of roughly equal byte size."""
    total, acc, out = sum(sizes), 0, []
    for i, n in enumerate(sizes):
        # Never leave fewer tensors than remaining shards, never skip a shard.
        s = min(acc * shards // total, shards - 1)
        s = max(s, shards - (len(sizes) - i))
        if out:
            s = min(max(s, out[-1]), out[-1] + 1)
        out.append(s)
        acc += n
    return out


def make_checkpoint(preset: str, out: str | os.PathLike, seed: int = 0,
                    dtype: str = "float32", shards: int = 1) -> pathlib.Path:
    """Write a random-weight HF Qwen2 checkpoint for ``preset`` into directory ``out``.

    ``out`` may be missing or empty; non-empty raises FileExistsError.  Files are written
    into a temporary sibling directory that is renamed into place at the end; if another
    process created ``out`` meanwhile, its checkpoint is kept and ours discarded.
    ``shards > 1`` writes ``model-0000i-of-0000N.safetensors`` plus an index json.
    Returns ``out`` as a Path.
    """
    return make_config_checkpoint(preset_config(preset, dtype), out, seed=seed, dtype=dtype, shards=shards,
                                  outliers=OUTLIERS.get(preset, 0.0))


def config_from_kwargs(kwargs: dict, dtype: str = "float32") -> PretrainedConfig:
    """An HF config from a preset's dict or one drawn by ``tpcheck.inputs.strategies``: ``model_type`` (default
    ``qwen2``) picks the family's config class (``impl.config.FAMILIES``), the other keys are its keyword
    arguments; ``dtype`` and the family's architecture are recorded in it."""
    from impl.config import FAMILIES, HF_DTYPE_KEY
    _check_dtype(dtype)
    kwargs = dict(kwargs)
    model_type = kwargs.pop("model_type", "qwen2")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not one of {sorted(FAMILIES)}")
    return family.hf_config_class()(**kwargs, **{HF_DTYPE_KEY: dtype}, architectures=[family.hf_model_class])


def make_config_checkpoint(config, out: str | os.PathLike, seed: int = 0, dtype: str = "float32",
                           shards: int = 1, bias_std: float = 0.5, outliers: float = 0.0) -> pathlib.Path:
    """``make_checkpoint`` for any shape of a supported family: ``config`` is an HF config or a dict of its
    keyword arguments with ``model_type`` (``config_from_kwargs``; an explicit ``head_dim`` is honoured, as HF
    does).  Same value recipe, same atomic write;
    ``bias_std`` scales every bias (default 0.5: the presets' recipe); ``outliers > 0`` adds the
    massive-activation recipe at that strength (``_add_outliers``; 1.0 is ``small-outliers``').  Presets
    written through here are bit-for-bit those of ``make_checkpoint``."""
    cfg = config_from_kwargs(config, dtype) if isinstance(config, dict) else config
    tdtype = _check_dtype(dtype)
    specs = _tensor_specs(cfg)
    if not isinstance(shards, int) or not 1 <= shards <= len(specs):
        raise ValueError(f"shards must be an int in [1, {len(specs)}], got {shards!r}")
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"checkpoint destination exists and is not empty: {out}")
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        cfg.save_pretrained(tmp)
        _check_impl_reads(tmp, cfg)
        itemsize = torch.empty((), dtype=tdtype).element_size()
        sizes = [itemsize * torch.Size(shape).numel() for _, shape, _ in specs]
        owner = _split(sizes, shards)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        weight_map: dict[str, str] = {}
        for s in range(shards):
            fname = ("model.safetensors" if shards == 1
                     else f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
            tensors = {}
            for (name, shape, kind), o in zip(specs, owner):
                if o == s:  # shards are contiguous, so the draw order is always `specs`
                    t = _draw(shape, kind, gen, bias_std)
                    tensors[name] = (_add_outliers(name, t, cfg, outliers) if outliers else t).to(tdtype)
                    weight_map[name] = fname
            save_file(tensors, tmp / fname, metadata={"format": "pt"})
            del tensors
        if shards > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors creates its files 0600
        try:
            os.replace(tmp, out)  # POSIX: succeeds onto a missing or empty directory
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not out.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost a race: keep the winner's
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_impl_reads(model_dir: pathlib.Path, cfg) -> None:
    """The written config as impl reads it (``impl.config.load_config``: an option impl refuses is a ConfigError
    naming it) has the optional tensors ``_tensor_specs`` draws: one reading of the family flags, not two."""
    from impl.config import load_config
    mc = load_config(model_dir)
    got = {"qkv_bias": mc.qkv_bias, "o_proj_bias": mc.o_proj_bias, "mlp_bias": mc.mlp_bias, "qk_norm": mc.qk_norm}
    want = family_options(cfg)
    if got != want:
        raise ValueError(f"{model_dir}: impl reads the optional tensors {got}, the checkpoint writer {want}")


def default_cache_root() -> pathlib.Path:
    """``$TPCHECK_CACHE`` or ``~/.cache/tpcheck/checkpoints``: the one cache of every command (``diff``,
    ``check``, ``sweep``, ...) that does not name its own root."""
    env = os.environ.get("TPCHECK_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "tpcheck" / "checkpoints"


def cache_key(preset: str, seed: int = 0, dtype: str = "float32") -> str:
    """The cache directory name of a preset checkpoint: ``<preset>-s<seed>-<dtype>-r<RECIPE_VERSION>``."""
    return f"{preset}-s{seed}-{dtype}-r{RECIPE_VERSION}"


def cached_checkpoint(preset: str, seed: int = 0, dtype: str = "float32",
                      root: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the checkpoint ``root/<cache_key(preset, seed, dtype)>``, created when missing; ``root``
    defaults to ``default_cache_root()``.

    Safe under concurrent callers (pytest-xdist): creation is an atomic rename, so a
    directory that has a ``config.json`` is complete.
    """
    _check_preset(preset)
    _check_dtype(dtype)
    path = pathlib.Path(root) if root is not None else default_cache_root()
    path = path / cache_key(preset, seed, dtype)
    if (path / "config.json").is_file():
        return path
    try:
        return make_checkpoint(preset, path, seed=seed, dtype=dtype)
    except FileExistsError:
        if (path / "config.json").is_file():  # another process finished first
            return path
        raise


def resolve_checkpoint(preset: str, seed: int = 0, dtype: str = "float32", ckpt_dir: str | os.PathLike | None = None,
                       root: str | os.PathLike | None = None) -> pathlib.Path:
    """``ckpt_dir`` if it already holds a checkpoint, else ``preset`` written there once; without ``ckpt_dir``
    the cached copy (``cached_checkpoint``)."""
    if ckpt_dir is None:
        return cached_checkpoint(preset, seed=seed, dtype=dtype, root=root)
    d = pathlib.Path(ckpt_dir)
    return d if (d / "config.json").is_file() else make_checkpoint(preset, d, seed=seed, dtype=dtype)

