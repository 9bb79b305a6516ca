"""A Hugging Face checkpoint from a GGUF file of a Gemma 3 text model (``tpcheck make-checkpoint --from-gguf``).

Why: public, small, *real* Gemma 3 weights are easiest to get as llama.cpp GGUF files (``tpcheck.inputs.
public_checkpoint``), while tpcheck, impl and vLLM read Hugging Face checkpoints. The weights are dequantized with
``gguf.quants.dequantize`` to float32, the values transformers' own GGUF loader
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``) puts in the model, so the converted checkpoint gives
its logits bit for bit. It is written once, in float32 (the dequantized values are float32; bfloat16 would round
them and lose that identity), with ``tpcheck_source.json`` saying which file and which quantization they came from.

The file is read with ``gguf.GGUFReader`` (memory-mapped, no pickle). What llama.cpp's converter changed is undone:

* every Gemma norm weight is stored as ``1 + w`` (``Gemma3RMSNorm`` scales by ``1 + w``; llama.cpp's by ``w``):
  HF's weight is ``gguf - 1``, in float32, as transformers' ``Gemma2TensorProcessor`` (used for gemma3) does;
* q / k are *not* permuted for Gemma (only llama.cpp's ``LlamaModel`` permutes them; transformers un-permutes for
  ``llama`` only), and a 2-D tensor's GGUF dims are its numpy shape reversed: ``tensor.data`` and its dequantization
  are already HF's ``[out, in]``.

Nothing is guessed: another architecture, a missing metadata key, a metadata key of the architecture this converter
does not know (it could change the model), a tensor type ``gguf.quants`` cannot dequantize, a GGUF tensor with no HF
counterpart or an HF parameter with no GGUF tensor is a ``GGUFError`` naming it (exit 2 in the CLI)."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from impl.errors import ConfigError
from tpcheck.progress import bar

try:
    import gguf
except ModuleNotFoundError as e:  # an optional dependency: only this converter needs it
    raise ModuleNotFoundError("make-checkpoint --from-gguf needs the gguf package: pip install 'tpcheck[gguf]'") from e

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr

ARCH = "gemma3"
SOURCE_FILE = "tpcheck_source.json"
#: written to SOURCE_FILE; a change of what a conversion writes bumps it (``public_checkpoint`` converts again)
CONVERTER_VERSION = 1
#: blk.N.<gguf> -> model.layers.N.<hf> (gguf.get_tensor_name_map(MODEL_ARCH.GEMMA3, n) read backwards)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: gemma3.<key> -> the HF config key it sets; every one is required (llama.cpp's converter always writes them)
REQUIRED_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta", "attention.sliding_window": "sliding_window",
    "context_length": "max_position_embeddings",
}
#: gemma3.<key>s read when present (``gemma3_config``); any other gemma3.* key is refused
OPTIONAL_KEYS = ("attention.value_length", "rope.dimension_count", "vocab_size", "rope.freq_base_swa",
                 "rope.scaling.type", "rope.scaling.factor", "attn_logit_softcapping", "final_logit_softcapping")
# what a Gemma 3 GGUF does not carry, as llama.cpp's loader (llama-model.cpp, LLM_ARCH_GEMMA3) hard-codes it and
# transformers' Gemma3TextConfig defaults it: every 6th layer global, the local layers' RoPE base 1e4 (a file with
# an attention.sliding_window_pattern key is refused: llama.cpp's gemma3 loader does not read one)
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0


class GGUFError(ConfigError):
    """A GGUF file the converter refuses, named with what is wrong: a ConfigError (so a ValueError), exit 2."""


@dataclass(frozen=True)
class Conversion:
    """What ``convert_gguf`` wrote: the directory, the source's sha256, each GGUF tensor's type, the seconds taken."""

    out: Path
    sha256: str
    tensor_types: dict[str, str]
    seconds: float


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """The file's reader, refusing anything but a readable GGUF of a Gemma 3 text model (naming what it is)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError) as e:  # bad magic, truncated header or table
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _value(reader, "general.architecture", path)
    if arch != ARCH:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported: only {ARCH!r} (Gemma 3 text) is "
                        "converted")
    return reader


def _value(reader: gguf.GGUFReader, key: str, path: Path) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"{path}: GGUF metadata key {key!r} is missing (no default is assumed)")
    return field.contents()


def gemma3_config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """The ``config.json`` of the model, from the metadata as llama.cpp reads it, in the layout of the Hub's Gemma 3
    configs (``rope_theta`` / ``rope_local_base_freq`` at the top: transformers 4.x and 5 and impl read it)."""
    unknown = sorted(k for k in reader.fields if k.startswith(f"{ARCH}.")
                     and k.removeprefix(f"{ARCH}.") not in (*REQUIRED_KEYS, *OPTIONAL_KEYS))
    if unknown:
        raise GGUFError(f"{path}: GGUF metadata key {unknown[0]!r} is not understood by this converter (it may change "
                        "the model); refusing rather than ignoring it")
    cfg: dict[str, Any] = {hf: _value(reader, f"{ARCH}.{k}", path) for k, hf in REQUIRED_KEYS.items()}
    opt = {k: _optional(reader, f"{ARCH}.{k}") for k in OPTIONAL_KEYS if f"{ARCH}.{k}" in reader.fields}
    head_dim, n_layers = cfg["head_dim"], cfg["num_hidden_layers"]
    for k in ("attention.value_length", "rope.dimension_count"):  # HF has one head_dim, rotated in full
        if opt.get(k, head_dim) != head_dim:
            raise GGUFError(f"{path}: {ARCH}.{k}={opt[k]} differs from attention.key_length={head_dim}: not Gemma 3")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    vocab = int(embd.shape[1])  # GGUF dims are reversed: [hidden, vocab]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing (no tokenizer)")
    n_tokens = len(tokens.data)
    if opt.get("vocab_size", vocab) != vocab or n_tokens != vocab:
        raise GGUFError(f"{path}: token_embd has {vocab} rows but the tokenizer {n_tokens} tokens"
                        f" (vocab_size {opt.get('vocab_size')})")
    scaling = _rope_scaling(opt, path)
    p = SLIDING_WINDOW_PATTERN  # llama.cpp's set_swa_pattern(6): layer i slides unless i % 6 == 5 (HF: (i + 1) % 6)
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "torch_dtype": "float32",
        **cfg, "vocab_size": vocab,
        # llama.cpp: rope.freq_base_swa when written, else its hard-coded 1e4 (transformers' default_theta["local"])
        "rope_local_base_freq": float(opt.get("rope.freq_base_swa", LOCAL_ROPE_BASE)),
        "rope_scaling": scaling,
        "layer_types": ["sliding_attention" if i % p < p - 1 else "full_attention" for i in range(n_layers)],
        # llama.cpp scales the scores by key_length ** -0.5, by (hidden / heads) ** -0.5 for the 27B (62 layers;
        # gemma_pytorch's config): each equals the Hub config's query_pre_attn_scalar (256 for 270M..12B, 168 for
        # 27B). transformers' GGUF loader leaves its class default 256, which agrees wherever head_dim is 256.
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if n_layers == 62 else head_dim,
        # not in GGUF: Gemma 3's (transformers' Gemma3TextConfig defaults, llama.cpp's gemma3 graph)
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "use_bidirectional_attention": False,
        "attn_logit_softcapping": opt.get("attn_logit_softcapping"),
        "final_logit_softcapping": opt.get("final_logit_softcapping"),
        # llama.cpp writes an output.weight only when it is not the embedding (as transformers reads it)
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id", path),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id", path),
        "pad_token_id": _optional(reader, "tokenizer.ggml.padding_token_id"),  # none in the file: none (not HF's 0)
    }


def _rope_scaling(opt: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The global layers' RoPE scaling (4B+ Gemma 3: linear, factor 8), as the Hub configs spell it."""
    kind = opt.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear" or "rope.scaling.factor" not in opt:
        raise GGUFError(f"{path}: rope.scaling.type {kind!r} (factor {opt.get('rope.scaling.factor')}) is not "
                        "supported: linear with a factor only")
    return {"rope_type": "linear", "factor": float(opt["rope.scaling.factor"])}


def hf_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Gemma3ForCausalLM(cfg)`` (a tied ``lm_head`` left out) and its shape."""
    h, d, f = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    layer.update({n: (h,) for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                     "post_feedforward_layernorm")})
    shapes = {f"model.layers.{i}.{n}.weight": s for i in range(cfg["num_hidden_layers"]) for n, s in layer.items()}
    shapes.update({"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter of a GGUF tensor name, None when it has none."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if base in TOP_TENSORS:
        return f"{TOP_TENSORS[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}.weight"
    return None


def plan(reader: gguf.GGUFReader, cfg: dict[str, Any], path: Path) -> list[tuple[Any, str]]:
    """(GGUF tensor, HF name) for every tensor, checked before any is dequantized: each maps to a parameter of the
    right shape, each parameter has one, and each type is one ``gguf.quants`` dequantizes."""
    shapes, out, seen = hf_shapes(cfg), [], set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in shapes:
            raise GGUFError(f"{path}: GGUF tensor {t.name!r} has no Gemma3ForCausalLM parameter")
        if name in seen:
            raise GGUFError(f"{path}: GGUF tensor {t.name!r} appears twice")
        got = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF dims are numpy's reversed
        if got != shapes[name]:
            raise GGUFError(f"{path}: GGUF tensor {t.name!r} has shape {list(got)}, {name} needs {list(shapes[name])}")
        try:
            gguf.quants.dequantize(t.data[:1], t.tensor_type)  # one row: cheap, raises for an unknown type
        except NotImplementedError as e:
            raise GGUFError(f"{path}: GGUF tensor {t.name!r} has type {t.tensor_type.name}, which gguf.quants "
                            "cannot dequantize") from e
        seen.add(name)
        out.append((t, name))
    missing = [n for n in shapes if n not in seen]
    if missing:
        raise GGUFError(f"{path}: no GGUF tensor for the parameter {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


def dequantized(tensor: Any, name: str) -> torch.Tensor:
    """The HF weight of one GGUF tensor: dequantized to float32 in HF's shape, a norm's ``1 +`` undone."""
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    if name.endswith("norm.weight"):  # every Gemma3RMSNorm (llama.cpp's converter wrote 1 + w)
        w = w - 1
    return torch.from_numpy(np.require(w, np.float32, ["C", "W"]))  # a view of the mmap is read-only: copied


def convert_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike) -> Conversion:
    """Write the HF checkpoint of a Gemma 3 GGUF file to ``out`` (a missing or empty directory), atomically:
    config.json, generation_config.json, model.safetensors (float32), the tokenizer, tpcheck_source.json."""
    start, path, out = time.perf_counter(), Path(gguf_path), Path(out)
    reader = open_gguf(path)
    cfg = gemma3_config(reader, path)
    todo = plan(reader, cfg, path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"checkpoint destination exists and is not empty: {out}")
    digest = sha256_file(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tensors = {}
        with bar(len(todo), "dequantizing", unit="tensor") as progress:
            for t, name in todo:
                tensors[name] = dequantized(t, name)
                progress.update(1)
        logger.info("dequantized %d GGUF tensors in %.1f s", len(todo), time.perf_counter() - start)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_tokenizer(path, tmp)
        types = {t.name: t.tensor_type.name for t, _ in todo}
        source = {"gguf_file": path.name, "sha256": digest, "size_bytes": path.stat().st_size,
                  "general.name": _optional(reader, "general.name"), "file_type": _file_type(reader),
                  "dequantized_to": "float32", "converter": __name__, "converter_version": CONVERTER_VERSION,
                  "tensor_type_counts": dict(sorted(Counter(types.values()).items())), "tensor_types": types}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors creates its files 0600
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, out)  # POSIX: onto a missing or empty directory
        except OSError as e:  # filled meanwhile (a concurrent conversion)
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise FileExistsError(f"checkpoint destination exists and is not empty: {out}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Conversion(out, digest, types, time.perf_counter() - start)


def _optional(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _file_type(reader: gguf.GGUFReader) -> str | None:
    """llama.cpp's name of the file's quantization mix (``general.file_type`` 15: ``MOSTLY_Q4_K_M``)."""
    value = _optional(reader, "general.file_type")
    try:
        return None if value is None else gguf.LlamaFileType(value).name
    except ValueError:
        return str(value)


def _write_tokenizer(path: Path, dest: Path) -> None:
    """The GGUF's tokenizer as transformers rebuilds it from the metadata (``gguf_file=``), saved as tokenizer.json:
    the same tokenizer ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` gives, offline."""
    from transformers import AutoTokenizer  # transformers' import is slow: only the conversion's last step needs it
    start = time.perf_counter()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(dest)
    logger.info("tokenizer rebuilt from the GGUF metadata in %.1f s", time.perf_counter() - start)
