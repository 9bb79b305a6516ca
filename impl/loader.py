"""Load-time sharding from safetensors: each rank reads only its own slices, never a full state dict.

Checkpoint tensors are opened lazily (``safe_open(...).get_slice``) and handed to the target parameter's
``weight_loader(param, loaded, shard_id)``, which narrows them to the rank's rows or columns; only that
slice is read from disk. Separate HF tensors of a fused parameter (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) are routed by the model's ``packed_modules_mapping``; a module with its own checkpoint names (a
MoE block: ``checkpoint_tensors``) lists them itself, the experts of other expert-parallel groups among them,
which this rank skips without reading; under pipeline parallelism the tensors of other stages are skipped
unread too (the model's ``holds_tensor``). A tensor the model has no place for (a layer past the model's, at
any pp; a name whose layer index is not a number), a parameter no tensor filled, or a
shape mismatch is an error naming the tensor. Pickle files are refused. ``load_weights`` returns how many
elements it read of each tensor."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from impl.layers.linear import ShapeMismatch, check_shape

# Non-parameter buffers some older checkpoints carry; impl recomputes them from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class LoadError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor(s) at fault."""


class LazySlice:
    """A checkpoint tensor not yet read: ``.shape`` and ``.narrow(dim, start, length)`` read just a slice."""

    def __init__(self, sl, dtype: torch.dtype):
        self._sl, self._dtype = sl, dtype
        self.shape = tuple(sl.get_shape())
        self.elements_read = 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        out = self._sl[tuple(index)].to(self._dtype)
        self.elements_read += out.numel()
        return out


def default_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Replicated parameter (norm weights): every rank reads the whole tensor."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded.narrow(0, 0, param.shape[0]))


def checkpoint_files(model_dir: str | Path) -> dict[str, list[str]]:
    """``{safetensors file: [tensor names]}`` from ``model.safetensors.index.json`` or a single file."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        by_file: dict[str, list[str]] = defaultdict(list)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise LoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        for name, fname in weight_map.items():
            by_file[str(d / fname)].append(name)
        for f in by_file:
            if not Path(f).is_file():
                raise LoadError(f"{index} lists {Path(f).name}, which does not exist")
        return dict(by_file)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = f" (found {pickles}: pickle checkpoints are refused; convert to safetensors)" if pickles else ""
        raise LoadError(f"{model_dir}: no *.safetensors weights{hint}")
    out = {}
    for f in files:
        with open_safetensors(str(f)) as h:
            out[str(f)] = list(h.keys())
    return out


def open_safetensors(path: str):
    """``safe_open`` with a damaged file (cut short, a header that is not JSON) named in a LoadError."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise LoadError(f"{path}: not a readable safetensors file ({e})") from None


def expected_tensors(model: nn.Module) -> tuple[dict[str, tuple[str, object]], set[str]]:
    """Every checkpoint tensor name the model needs -> (its parameter name, shard id); and the tensors this rank
    skips (other expert groups' experts: ``checkpoint_tensors`` of a MoE block)."""
    out: dict[str, tuple[str, object]] = {}
    skipped: set[str] = set()
    for mname, module in model.named_modules():
        if hasattr(module, "checkpoint_tensors"):
            wanted, other = module.checkpoint_tensors(mname)
            out.update(wanted)
            skipped |= other
    covered = {pname for pname, _ in out.values()}
    for pname, _ in model.named_parameters():  # a tied lm_head shares the embedding's parameter: listed once
        if pname in covered:
            continue
        packed = [(hf, fused, sid) for hf, (fused, sid) in model.packed_modules_mapping.items()
                  if f".{fused}." in f".{pname}"]
        for hf, fused, sid in packed:
            out[pname.replace(fused, hf)] = (pname, sid)
        if not packed:
            out[pname] = (pname, None)
    if getattr(model.cfg, "tie_word_embeddings", False) and "lm_head.weight" in out \
            and "model.embed_tokens.weight" not in out:  # a last pipeline stage: its tied head reads the embedding
        out["model.embed_tokens.weight"] = out.pop("lm_head.weight")
    return out, skipped


def load_weights(model: nn.Module, model_dir: str | Path, dtype: torch.dtype) -> dict[str, int]:
    """Load this rank's slices of every tensor the model needs; returns ``{tensor: elements read}`` (the
    tensors skipped as other ranks' experts are not in it)."""
    params = dict(model.named_parameters())
    wanted, skipped = expected_tensors(model)
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    holds = getattr(model, "holds_tensor", None) or (lambda name: True)
    seen: dict[str, int] = {}
    for fname, names in checkpoint_files(model_dir).items():
        for name in names:
            if name.endswith(IGNORED_SUFFIXES) or name in skipped or not holds(name):
                continue  # holds: another pipeline stage's tensor is not read here
            if tied and name == "lm_head.weight":
                continue  # some tied checkpoints also store the (identical) head; the embedding is used
            if name not in wanted:
                hint, index = "", name.split(".")[2] if name.startswith("model.layers.") else None
                if index is not None and not (index.isascii() and index.isdigit()):
                    hint = f" (its layer index {index!r} is not a number)"
                elif index is not None and int(index) >= model.cfg.num_layers:
                    hint = (f" (layer {int(index)} is past the model's {model.cfg.num_layers} layers: config.json's "
                            "num_hidden_layers; no pipeline stage holds it)")
                elif name.endswith(".bias"):  # the usual cause: a bias flag in config.json that disagrees
                    hint = (f" (config.json of model_type {model.cfg.model_type!r} gives this layer no bias: "
                            "check attention_bias / mlp_bias)")
                elif name.endswith((".weight_scale", ".input_scale", ".qweight", ".qzeros", ".scales", ".g_idx")):
                    hint = (" (a quantized checkpoint's tensor: config.json has no quantization_config impl reads; "
                            "impl runs compressed-tensors INT8 and FP8 W8A8)")
                elif name.endswith((".k_scale", ".v_scale")):
                    hint = (" (an FP8 KV cache's scale: config.json's quantization_config declares no "
                            "kv_cache_scheme, so the cache would not be quantized with it)")
                elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                    hint = (" (experts fused in one 3-D tensor, transformers 5's in-memory layout: impl reads one "
                            "tensor per expert, as save_pretrained writes them)")
                raise LoadError(f"unexpected tensor {name!r} in {Path(fname).name}: the "
                                f"{type(model).__name__} model has no parameter for it{hint}")
            pname, sid = wanted[name]
            param = params[pname]
            loader = getattr(param, "weight_loader", default_weight_loader)
            # one mapping per tensor: safetensors slices are views into an mmap of the file, and the pages a
            # slice touches stay resident until the mapping closes (a row-parallel column slice touches them all)
            with open_safetensors(fname) as f:
                lazy = LazySlice(f.get_slice(name), param.dtype)  # the model's dtype; int8 / float32 quant params
                try:
                    loader(param, lazy, sid)
                except ShapeMismatch as e:
                    raise LoadError(f"tensor {name!r} in {Path(fname).name}: {e} (parameter {pname}"
                                    f"{'' if sid is None else f', shard {sid!r}'}, local shape {list(param.shape)})") from None
            seen[name] = lazy.elements_read
    missing = sorted(set(wanted) - set(seen))
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        cfg, hint = model.cfg, ""
        if any(m.endswith(".bias") for m in missing):
            hint = (f" (the {cfg.model_type!r} config asks for biases: q/k/v {cfg.qkv_bias}, o_proj {cfg.o_proj_bias}, "
                    f"mlp {cfg.mlp_bias})")
        raise LoadError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s): {missing[:8]}{more}{hint}")
    for mname, module in model.named_modules():  # vLLM's hook: e.g. FP8 fused per-tensor scales re-quantized
        process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
        if process is not None:
            try:
                process(module)
            except ShapeMismatch as e:
                raise LoadError(f"{model_dir}: {mname}: {e}") from None
    return seen
