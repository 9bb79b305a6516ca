"""Synthetic Hugging Face checkpoints of every family impl runs (Qwen2, Llama, Mistral, Qwen3, Gemma 3): random weights
in the real HF layout.

These are the test inputs for the whole project.  ``transformers`` loads them with the family's own class
(``Qwen2ForCausalLM.from_pretrained(dir)``, ``LlamaForCausalLM`` ..., as ``impl.config.FAMILIES`` names it)
with no missing or unexpected keys, and every tensor is distinguishable: biases (where the family and config
have them) are clearly non-zero, every norm weight (Qwen3's per-head q/k norms included) is well away from 1
(and from 0), gate and up are drawn independently, and an untied lm_head is independent of the embedding.
Loading any tensor wrongly (transposed, swapped with a sibling, skipped, left at its default) changes the
model output.

The presets (their configs and descriptions) are defined in ``tpcheck.inputs.models.presets``, the tensors and values a
checkpoint holds in ``tpcheck.inputs.models.weight_recipe``; this module writes checkpoints (atomically, optionally
sharded) and caches them by (preset, seed, dtype, RECIPE_VERSION). Every name of those two modules that other
code uses is importable from here as well.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import save_file

# re-exported: the presets and the value recipe live in their own modules; ``from tpcheck.inputs.models.checkpoints
# import PRESETS`` (and ``ck._tensor_specs`` in the tests) keep working
from tpcheck.inputs.models.presets import (  # noqa: F401
    DTYPE_NAMES, OUTLIERS, PRESETS, QUANTIZED, ROUTER_TIES, SINKS, _check_dtype, _check_preset, config_family,
    config_from_kwargs, describe_preset, preset_available, preset_config, preset_family, preset_names,
)
from tpcheck.inputs.models.sink_recipe import _add_sink, check_sink_config, sink_channels  # noqa: F401
from tpcheck.inputs.models.gemma_recipe import PRESETS as GEMMA_SINKS, _add_gemma_sink, check_gemma_sink_config
from tpcheck.inputs.models.weight_recipe import (  # noqa: F401
    _add_outliers, _draw, _tensor_specs, _tie_router, family_options, moe_options, outlier_channels,
)
from tpcheck.inputs.models.quantize_awq import quantize_any
from tpcheck.inputs.models.kv_recipe import PRESETS as KV_PRESETS, spread_kv
from impl.config import load_config

DTYPES: dict[str, torch.dtype] = {name: _check_dtype(name) for name in DTYPE_NAMES}

# Version of what a checkpoint's bytes are made from: the value recipe (``tpcheck.inputs.models.weight_recipe``: ``_draw``),
# the massive-activation recipe (``_add_outliers``), the attention-sink recipes (``tpcheck.inputs.models.sink_recipe``;
# Gemma 3's, ``tpcheck.inputs.models.gemma_recipe``), the tensor draw order and the PRESETS configs
# (``tpcheck.inputs.models.presets``). It is part of the cache key (``cache_key``), so a cache never hands back a checkpoint
# made by an older recipe. Bump it whenever any of these changes what a (preset, seed, dtype) writes (a new preset
# changes nothing an existing one writes).
# It lives here, where ``cache_key`` reads it, so that setting ``checkpoints.RECIPE_VERSION`` takes effect.
RECIPE_VERSION = 1


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
    """Write a random-weight HF checkpoint of ``preset``'s family (Qwen2, Llama, Mistral, Qwen3) for ``preset`` into directory ``out``.

    ``out`` may be missing or empty; non-empty raises FileExistsError.  Files are written
    into a temporary sibling directory that is renamed into place at the end; if another
    process created ``out`` meanwhile, its checkpoint is kept and ours discarded.
    ``shards > 1`` writes ``model-0000i-of-0000N.safetensors`` plus an index json.
    Returns ``out`` as a Path.
    """
    if preset in QUANTIZED:  # the float preset's checkpoint, quantized (a temp dir beside ``out``)
        base, scheme = QUANTIZED[preset]
        out = pathlib.Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.float-", dir=out.parent) as tmp:
            src = make_checkpoint(base, pathlib.Path(tmp) / "float", seed=seed, dtype=dtype, shards=shards)
            if preset in KV_PRESETS:  # keys and values of a trained model's spread (tpcheck.inputs.models.kv_recipe)
                spread_kv(src)
            try:
                return quantize_any(src, out, scheme)
            except ValueError:
                if (out / "config.json").is_file():  # another process finished first
                    raise FileExistsError(f"checkpoint destination exists and is not empty: {out}") from None
                raise
    return make_config_checkpoint(preset_config(preset, dtype), out, seed=seed, dtype=dtype, shards=shards,
                                  outliers=OUTLIERS.get(preset, 0.0), router_ties=ROUTER_TIES.get(preset, 0.0),
                                  sink=preset in SINKS or preset in GEMMA_SINKS)


def make_config_checkpoint(config, out: str | os.PathLike, seed: int = 0, dtype: str = "float32",
                           shards: int = 1, bias_std: float = 0.5, outliers: float = 0.0,
                           router_ties: float = 0.0, sink: bool = False) -> pathlib.Path:
    """``make_checkpoint`` for any shape of a supported family: ``config`` is an HF config or a dict of its
    keyword arguments with ``model_type`` (``config_from_kwargs``; an explicit ``head_dim`` is honoured, as HF
    does).  Same value recipe, same atomic write;
    ``bias_std`` scales every bias (default 0.5: the presets' recipe); ``outliers > 0`` adds the
    massive-activation recipe at that strength (``_add_outliers``; 1.0 is ``small-outliers``'); ``router_ties
    > 0`` draws every MoE router in near-tied pairs of rows at that spread (``_tie_router``); ``sink`` the
    attention-sink recipe of the config's family (Llama: ``tpcheck.inputs.models.sink_recipe``, ``deep-sink``'s; Gemma 3:
    ``tpcheck.inputs.models.gemma_recipe``, ``gemma3-trained``'s; a ValueError names what a config lacks for it).
    Presets written through here are bit-for-bit those of ``make_checkpoint``."""
    cfg = config_from_kwargs(config, dtype) if isinstance(config, dict) else config
    tdtype = _check_dtype(dtype)
    gemma = family_options(cfg)["gemma"]
    add_sink = _add_gemma_sink if gemma else _add_sink
    if sink:
        (check_gemma_sink_config if gemma else check_sink_config)(cfg)
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
                    t = _add_outliers(name, t, cfg, outliers) if outliers else t
                    t = _tie_router(name, t, router_ties) if router_ties else t
                    tensors[name] = (add_sink(name, t, cfg) if sink else t).to(tdtype)
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
    mc = load_config(model_dir)
    got = {"qkv_bias": mc.qkv_bias, "o_proj_bias": mc.o_proj_bias, "mlp_bias": mc.mlp_bias, "qk_norm": mc.qk_norm,
           "gemma": mc.gemma is not None}
    want = family_options(cfg)
    if got != want:
        raise ValueError(f"{model_dir}: impl reads the optional tensors {got}, the checkpoint writer {want}")
    moe, m = moe_options(cfg), mc.moe
    got_moe = None if m is None else (m.num_experts, m.intermediate_size, m.shared_expert_intermediate_size,
                                      m.sparse_layers)
    want_moe = None if moe is None else (moe["num_experts"], moe["intermediate_size"],
                                         moe["shared_expert_intermediate_size"], moe["sparse_layers"])
    if got_moe != want_moe:
        raise ValueError(f"{model_dir}: impl reads the experts (number, width, shared width, sparse layers) "
                         f"{got_moe}, the checkpoint writer {want_moe}")


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

