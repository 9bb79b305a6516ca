"""Quantized checkpoints in the compressed-tensors INT8 and FP8 W8A8 formats, as vLLM reads them.

FP8 (``w8a8-fp8``, ``w8a8-fp8-tensor``; ``format: float-quantized``, compressed-tensors' ``FP8_DYNAMIC`` preset
scheme with the ``tensor`` strategy for the second): as INT8 below with float8_e4m3fn weights,
``scale = float32(absmax / 448)`` and ``q = e4m3(clamp(W / scale, -448, 448))`` (``quantize_weight``), ``type:
float`` in ``weights`` and ``input_activations``; vLLM 0.32 selects ``CompressedTensorsW8A8Fp8`` for it.

``quantize_checkpoint(src, dst, scheme)`` reads a float Hugging Face checkpoint (``config.json`` and
``model.safetensors``, or shards named by ``model.safetensors.index.json``) one tensor at a time and writes ``dst``:

* ``model.safetensors``: every source tensor; each decoder-layer linear weight
  (``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``)
  becomes an int8 ``...weight`` plus a float32 ``...weight_scale``. Embeddings, norms, biases and ``lm_head``
  stay as they are (same dtype, same bytes).
* ``config.json``: the source config plus ``quantization_config`` (``quantization_config(scheme)``).
* the other top-level files (``generation_config.json``, tokenizer files) copied as they are; other weight files
  (``*.bin``, ``*.pt``, ...) and subdirectories are left out: they would hold the float weights again.

The math (symmetric, no zero point), for each output channel (``w8a8-int8``) or the whole tensor
(``w8a8-int8-tensor``) of a weight ``W``::

    scale = float32(absmax(W) / 127)                 # absmax / 127 in float64, stored as float32
    q     = int8(clamp(round(W / scale), -128, 127))  # in float64, with the float32 scale; round: half to even

``q`` is computed with the stored float32 scale, so ``q * scale`` (what an engine dequantizes from the file) is
within ``scale / 2`` of ``W``. An all-zero row (or tensor) gets ``scale = 1.0`` and ``q = 0``: a zero scale would
put 0 / 0 into the division above and into any kernel that rescales by a weight scale (vLLM requantizes the
per-tensor scales of fused q/k/v and gate/up to their maximum by dividing by it); any positive scale dequantizes
``q = 0`` to exact zeros, and 1.0 is exact in every float format. (llm-compressor divides by 127.5, the half
range of [-128, 127]; the format only fixes ``q`` and ``scale``, so either reads the same way.)

Activations are not stored: both schemes quantize a linear layer's input dynamically per token at run time
(``input_activations``: int8, symmetric, strategy ``token``, dynamic).

``quantization_config`` is ``compressed_tensors.quantization.QuantizationConfig`` (compressed-tensors 0.17.0)
as ``model_dump(mode="json")`` writes it (validating and dumping it again gives the same dict). What vLLM 0.32 reads
of it (``vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py``):

* ``quant_method`` ``"compressed-tensors"``: selects ``CompressedTensorsConfig`` (``vllm.config.model``);
* ``format`` ``"int-quantized"``: an activation-quantization format, so ``input_activations`` is honoured;
* ``config_groups.*.targets`` (``["Linear"]``: every linear layer), ``.weights`` and ``.input_activations``
  (each through ``QuantizationArgs.model_validate``), ``.output_activations``, ``.format`` (null: the global one);
  weights int8 symmetric static with strategy channel / tensor plus inputs int8 dynamic per token select
  ``CompressedTensorsW8A8Int8`` (``_is_dynamic_token_w8a8``), which expects the int8 ``weight`` and a float32
  ``weight_scale`` of shape ``[out, 1]`` (channel) or ``[1]`` per fused part (tensor);
* ``ignore`` (``["lm_head"]``: left in float), ``kv_cache_scheme`` (null: no KV-cache quantization; the
  ``KV_CACHE`` schemes write an FP8 one, ``QuantizationArgs`` of strategy ``tensor`` / ``attn_head``, with calibrated
  ``self_attn.k_scale`` / ``v_scale`` tensors; ``KV_ONLY`` ones leave the linears float: ``config_groups {}``);
  ``transform_config``, ``sparsity_config``, ``total_num_heads`` / ``total_num_kv_heads`` when present (absent).

``quantization_status``, ``global_compression_ratio`` and the ``observer`` fields are not read by vLLM; they are
written as compressed-tensors writes them (``compressed``: the weights on disk are already int8).

vLLM 0.32 on CPU runs these layers with ``CPUInt8ScaledMMLinearKernel`` (oneDNN; per-tensor scales of fused layers
converted to per channel). On an x86 CPU without VNNI (AVX2 only) oneDNN's u8 x s8 products saturate in int16 where
weights use the full +-127 range: a linear's output is then off by a few percent, far above bf16 noise, most with
``w8a8-int8`` (every row reaches 127). That is the kernel's error, not the file's (7-bit weights run clean there).

The output is written into a temporary directory beside ``dst`` and renamed into place, so a crash leaves no half
checkpoint; ``model.safetensors`` is streamed (one source tensor in memory at a time) in safetensors' own layout
(tensors grouped by item size, largest first, then by name: every tensor aligned), so the same source and scheme
give byte-identical files.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from impl.quant_fp8 import to_fp8
from tpcheck.inputs.models.quant_schemes import SCHEMES

#: schemes whose activations have a static ``input_scale`` (calibrated: ``tpcheck.inputs.models.calibrate``)
STATIC = ("w8a8-fp8-static",)
#: schemes with an FP8 KV cache -> the strategy of its scales (calibrated: ``tpcheck.inputs.models.calibrate.kv_scales``)
KV_CACHE = {"w8a8-fp8-kv": "tensor", "fp8-kv": "tensor", "fp8-kv-head": "attn_head"}
#: schemes that quantize the KV cache only (the linears stay float)
KV_ONLY = ("fp8-kv", "fp8-kv-head")
_STRATEGY = {"w8a8-int8": "channel", "w8a8-int8-tensor": "tensor", "w8a8-fp8": "channel", "w8a8-fp8-tensor": "tensor",
             "w8a8-fp8-static": "tensor", "w8a8-fp8-kv": "channel"}
#: scheme -> (compressed-tensors ``type``, ``format``, the largest quantized value, safetensors dtype)
_TYPE = {k: ("int", "int-quantized", 127.0, "I8") for k in ("w8a8-int8", "w8a8-int8-tensor")}
_TYPE.update({k: ("float", "float-quantized", 448.0, "F8_E4M3") for k in ("w8a8-fp8", "w8a8-fp8-tensor", "w8a8-fp8-static",
                                                                        *KV_CACHE)})  # (KV_ONLY: the cache's type)

#: the decoder-layer linear weights that are quantized (lm_head is not: it is in ``ignore``)
LINEAR_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
#: a projection weight that vLLM would take for a quantized Linear although it is not one of the names above
_OTHER_PROJ = re.compile(r"model\.layers\.\d+\..*_proj\.weight")
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # what a float weight may be stored as
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_MOE_KEYS = ("num_experts", "num_local_experts")


def _qargs(strategy: str, dynamic: bool, num_type: str = "int", observer: str = "memoryless_minmax") -> dict:
    """One ``QuantizationArgs`` (8-bit ``num_type``, symmetric) as compressed-tensors dumps it."""
    return {"num_bits": 8, "type": num_type, "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            # the validator's default observer: memoryless min-max for static weights, none for dynamic inputs
            "observer": None if dynamic else observer, "observer_kwargs": {}}


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for ``scheme`` (the module docstring: what vLLM reads)."""
    _check_scheme(scheme)
    num_type, fmt = _TYPE[scheme][:2]
    kv = _qargs(KV_CACHE[scheme], False, "float", "static_minmax") if scheme in KV_CACHE else None
    if scheme in KV_ONLY:  # no linear is quantized: no config group, compressed-tensors' "dense" format
        return {"config_groups": {}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv, "format": "dense",
                "quantization_status": "compressed", "global_compression_ratio": None, "ignore": []}
    group = {"targets": ["Linear"], "weights": _qargs(_STRATEGY[scheme], False, num_type),
             "input_activations": _qargs("tensor", False, num_type, "static_minmax") if scheme in STATIC else
             _qargs("token", True, num_type), "output_activations": None, "format": None}
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "format": fmt, "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": ["lm_head"]}


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; supported: {', '.join(SCHEMES)}")


def weight_scale(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The float32 scale of a 2-D float weight: ``[out, 1]`` (``w8a8-int8``, ``w8a8-fp8``) or ``[1]`` (the
    ``-tensor`` schemes): ``absmax / 127`` (int8) or ``absmax / 448`` (e4m3)."""
    _check_scheme(scheme)
    a = w.detach().to(torch.float64).abs()
    absmax = a.amax(dim=1, keepdim=True) if _STRATEGY[scheme] == "channel" else a.amax().reshape(1)
    scale = (absmax / _TYPE[scheme][2]).to(torch.float32)
    # all zero: any positive scale dequantizes q = 0 exactly; 1.0 keeps every division by the scale finite
    scale = torch.where(absmax == 0, torch.ones_like(scale), scale)
    if bool((scale < torch.finfo(torch.float32).tiny).any()):  # a subnormal scale loses the round trip's bound
        raise ValueError(f"absmax {absmax[absmax > 0].min().item():.3g} is too small for a normal float32 scale")
    return scale


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, scheme: str = "w8a8-int8") -> torch.Tensor:
    """int8: ``clamp(round(w / scale), -128, 127)``, in float64 with the stored float32 ``scale`` (half to even).
    fp8: ``e4m3(clamp(w / scale, -448, 448))``, the division in float64, the cast by ``impl.quant_fp8.to_fp8``
    (nearest, ties to even, through float32: the rule the engine quantizes activations by)."""
    if _TYPE[scheme][0] == "float":
        return to_fp8(w.detach().to(torch.float64) / scale.to(torch.float64))
    q = torch.round(w.detach().to(torch.float64) / scale.to(torch.float64))
    return q.clamp_(-128, 127).to(torch.int8)


class _Source:
    """The tensors of a checkpoint directory, opened lazily: name -> (dtype string, shape) without reading data;
    ``get(name)`` reads one tensor."""

    def __init__(self, src: Path, stack: contextlib.ExitStack):
        self.root = src
        index = src / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        elif (src / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise ValueError(f"{src}: no model.safetensors nor model.safetensors.index.json")
        self.handles = {f: stack.enter_context(safe_open(src / f, framework="pt")) for f in files}
        self.where: dict[str, str] = {}
        self.meta: dict[str, tuple[str, list[int]]] = {}
        for f, h in self.handles.items():
            for name in h.keys():
                if name in self.where:
                    raise ValueError(f"{src}: tensor {name} is in both {self.where[name]} and {f}")
                if weight_map is not None and weight_map.get(name) != f:
                    raise ValueError(f"{src}: tensor {name} is in {f}, the index says {weight_map.get(name)}")
                sl = h.get_slice(name)
                self.where[name], self.meta[name] = f, (sl.get_dtype(), list(sl.get_shape()))
        missing = sorted(set(weight_map or {}) - set(self.where))
        if missing:
            raise ValueError(f"{src}: the index names {missing[0]} (and {len(missing) - 1} more) in no shard")

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.where[name]].get_tensor(name)


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise ValueError(f"{src}: no config.json")
    cfg = json.loads(path.read_text())
    for key in ("quantization_config", "compression_config"):
        if key in cfg:
            method = cfg[key].get("quant_method", "?") if isinstance(cfg[key], dict) else "?"
            raise ValueError(f"{src}: already quantized (config.json has {key}, quant_method {method!r})")
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe:
        raise ValueError(f"{src}: mixture-of-experts model ({moe[0]}={cfg[moe[0]]}): quantizing experts is not "
                         "supported yet")
    return cfg


#: output tensor name -> (safetensors dtype, shape, role): "copy" as in the source, "weight" the int8 values of a
#: quantized weight, "scale" its weight_scale
Plan = dict[str, tuple[str, list[int], str]]


def _plan(source: _Source, scheme: str) -> Plan:
    """The output tensors, refusing what cannot be quantized: a non-float linear weight, a projection this module
    does not know, a name already taken."""
    out: Plan = {}
    for name, (dtype, shape) in sorted(source.meta.items()):
        if LINEAR_WEIGHT.fullmatch(name):
            if dtype not in _FLOAT_DTYPES or len(shape) != 2:
                raise ValueError(f"tensor {name}: expected a 2-D float weight, found {dtype} {shape}")
            if name + "_scale" in source.meta:
                raise ValueError(f"tensor {name}_scale is already in the source")
            if scheme in KV_ONLY:  # the linears stay float
                out[name] = (dtype, shape, "weight")
            else:
                scale_shape = [shape[0], 1] if _STRATEGY[scheme] == "channel" else [1]
                out[name], out[name + "_scale"] = (_TYPE[scheme][3], shape, "weight"), ("F32", scale_shape, "scale")
            if scheme in STATIC:
                out[name.removesuffix("weight") + "input_scale"] = ("F32", [1], "given")
            if scheme in KV_CACHE and name.endswith(".self_attn.k_proj.weight"):  # one k / v scale per layer
                attn = name.removesuffix("k_proj.weight")
                kv_shape = [1] if KV_CACHE[scheme] == "tensor" else [shape[0] // _head_dim(source), 1, 1]
                for which in "kv":
                    out[f"{attn}{which}_scale"] = ("F32", kv_shape, "given")
        elif _OTHER_PROJ.fullmatch(name):  # vLLM's "Linear" target would expect it int8 as well
            raise ValueError(f"tensor {name}: a projection weight this quantizer does not know (a fused or other "
                             "layout); supported: q/k/v/o_proj and gate/up/down_proj")
        elif dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {name}: dtype {dtype} is not supported")
        elif name not in out:
            out[name] = (dtype, shape, "copy")
    if not any(role == "weight" for _, _, role in out.values()):
        raise ValueError("no decoder-layer linear weight (model.layers.N.self_attn.q_proj.weight ...) in the source")
    return out


def _head_dim(source: _Source) -> int:
    """The source's head_dim (config.json's, else hidden_size / num_attention_heads): a per-head KV scale's rows are
    k_proj's rows over it."""
    cfg = json.loads((source.root / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_safetensors(path: Path, source: _Source, plan: Plan, scheme: str,
                       given: dict[str, torch.Tensor]) -> None:
    """Stream the planned tensors into ``path``: the header first (every shape is known), then each tensor's
    bytes, reading one source tensor at a time (a weight twice: for its scale, then for its int8 values)."""
    order = sorted(plan, key=lambda n: (-_ITEMSIZE[plan[n][0]], n))  # safetensors' order: aligned, deterministic
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        dtype, shape, _ = plan[name]
        size = _ITEMSIZE[dtype] * int(torch.Size(shape).numel())
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # padded as safetensors pads it: the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in order:
            t = given[name] if plan[name][2] == "given" else _output_tensor(source, name, plan, scheme)
            f.write(_tensor_bytes(t))
        written = f.tell()
    if written != 8 + len(head) + offset:
        raise AssertionError(f"{path}: wrote {written} bytes, the header describes {8 + len(head) + offset}")


def _output_tensor(source: _Source, name: str, plan: Plan, scheme: str) -> torch.Tensor:
    """One output tensor, checked against its planned shape."""
    role = plan[name][2]
    if role == "scale":
        base = name.removesuffix("_scale")
        t = _checked_scale(source.get(base), base, scheme)
    elif role == "weight" and scheme in KV_ONLY:
        t = source.get(name)
    elif role == "weight":
        w = source.get(name)
        t = quantize_weight(w, _checked_scale(w, name, scheme), scheme)
    else:
        t = source.get(name)
    if list(t.shape) != plan[name][1]:
        raise AssertionError(f"tensor {name}: shape {list(t.shape)}, planned {plan[name][1]}")
    return t


def _checked_scale(w: torch.Tensor, name: str, scheme: str) -> torch.Tensor:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"tensor {name}: has inf or nan values, which have no int8 scale")
    try:
        return weight_scale(w, scheme)
    except ValueError as e:
        raise ValueError(f"tensor {name}: {e}") from None


def _copy_other_files(src: Path, tmp: Path) -> None:
    """Top-level files other than the config and weights (tokenizer, generation config), as they are."""
    for p in sorted(src.iterdir()):
        if p.name.startswith(".") or p.name == "config.json" or not p.is_file():
            continue
        if p.name.endswith(_WEIGHT_FILES) or p.name.endswith(".index.json"):
            continue  # float weights (or their index) next to the quantized ones would be read instead of them
        shutil.copyfile(p, tmp / p.name)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str) -> Path:
    """Write the ``scheme`` quantization of the float checkpoint ``src`` into the new (or empty) directory ``dst``
    (the module docstring: the format and the math). Returns ``dst`` as a Path.

    Refused with a ValueError naming the fault: an unknown scheme, a source with a ``quantization_config``, a
    mixture-of-experts model, a linear weight that is not float, ``dst`` existing and not an empty directory.
    (``tpcheck.inputs.models.quantize_awq.quantize_any`` also writes 4-bit GPTQ and AWQ.)"""
    _check_scheme(scheme)

    def fill(source: "_Source", tmp: Path) -> dict:
        given = {}
        if scheme in STATIC:  # the float model's activations on calibration prompts
            from tpcheck.inputs.models.calibrate import input_scales  # lazy: it imports transformers
            given = input_scales(source.root, [n for n in source.meta if LINEAR_WEIGHT.fullmatch(n)])
        if scheme in KV_CACHE:  # the float model's keys and values on the same prompts
            from tpcheck.inputs.models.calibrate import kv_scales  # lazy: it imports transformers
            given.update(kv_scales(source.root, KV_CACHE[scheme]))
        _write_safetensors(tmp / "model.safetensors", source, _plan(source, scheme), scheme, given)
        return quantization_config(scheme)
    return write_checkpoint(src, dst, fill)


def write_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, fill) -> Path:
    """The checked, atomic write every quantizer shares: ``src`` must be a directory and ``dst`` new or empty;
    ``fill(source, tmp)`` writes ``tmp/model.safetensors`` from the ``_Source`` and returns the
    ``quantization_config``; ``config.json`` and the other top-level files follow, then the temporary directory is
    renamed onto ``dst`` (removed on any failure)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ValueError(f"source checkpoint {src} is not a directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"destination {dst} exists and is not an empty directory")
    cfg = _read_config(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        with contextlib.ExitStack() as stack:
            qcfg = fill(_Source(src, stack), tmp)
        (tmp / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}, indent=2) + "\n")
        _copy_other_files(src, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.replace(tmp, dst)  # POSIX: onto a missing or empty directory, atomically
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise ValueError(f"destination {dst} was filled by someone else meanwhile") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def quantized_names(model_dir: str | os.PathLike) -> list[str]:
    """The quantized weights of a checkpoint written here: each int8 weight that has a ``weight_scale``, each GPTQ /
    AWQ layer's ``qweight``."""
    with safe_open(Path(model_dir) / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    return sorted(k.removesuffix("_scale") for k in keys if k.endswith((".weight_scale"))) + \
        sorted(k for k in keys if k.endswith(".qweight"))
