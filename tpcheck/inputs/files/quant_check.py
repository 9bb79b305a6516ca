"""A quantized checkpoint's tensors checked before any engine starts: a broken or mislabelled file is exit 2 naming
the tensor, the rule and the value found, never a verdict about the engine (the golden reads the same broken
numbers, and impl's loader casts any dtype to its parameter's, so neither side would notice).

The rules are the formats' own (``impl.quant`` / ``quant_fp8`` / ``quant_gptq`` / ``quant_awq`` / ``quant_kv``
document them); each is checked where the format fixes it:

==========================  ==========================================================================================
W8A8 INT8 / FP8             ``weight`` int8 (INT8) / float8_e4m3fn (FP8), 2-D ``[out, in]``;
(compressed-tensors)        ``weight_scale`` a float dtype, ``[out, 1]`` (channel) or ``[1]`` / ``[]`` (tensor),
                            every value finite and > 0; a static ``input_scale``: float, ``[1]`` / ``[]``, finite, > 0
GPTQ (v1, symmetric)        ``qweight`` int32 2-D (``[K/8, N]``); ``qzeros`` int32 2-D (``[G, N/8]``), every nibble 7
                            (``sym`` fixes the zero point at 8, v1 stores it minus one); ``scales`` float 2-D
                            (``[G, N]``), finite, > 0; ``g_idx`` int32 1-D (``[K]``), every value in ``[0, G)``
AWQ (GEMM)                  ``qweight`` int32 2-D (``[K, N/8]``); ``qzeros`` int32 2-D (``[G, N/8]``, any nibble:
                            asymmetric); ``scales`` float 2-D (``[G, N]``), finite, > 0
FP8 KV cache                ``self_attn.k_scale`` / ``v_scale``: float, ``[1]`` / ``[]`` (tensor) or ``[K]`` /
                            ``[K, 1, 1]`` (attn_head, K the KV heads), finite, > 0
==========================  ==========================================================================================

A module is a quantized linear when the checkpoint holds one of its scheme's tensors or it is a decoder layer's
``*_proj`` (impl quantizes every one of those under a quantized config). A missing tensor is the loader's to name
(all of them at once), as are the sizes (``[out, in]`` against the config, the packed sizes against each other:
``impl.loader.load_weights``, against the model, exit 2 naming whichever tensor is off). This pass reads the
safetensors headers and the (small) scale, zero and index tensors only, never a weight's values."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from impl.loader import LoadError, checkpoint_files, open_safetensors
from impl.quant_awq import AwqScheme
from impl.quant_gptq import GptqScheme

#: safetensors' dtype names, as torch spells them (the messages say the torch name)
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}
FLOATS = ("float64", "float32", "float16", "bfloat16")
PROJ = re.compile(r"model\.layers\.\d+\.[A-Za-z_]+\.[A-Za-z_]+_proj")  # a decoder layer's linear
W8A8_TENSORS = ("weight", "weight_scale", "input_scale")
W4_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
GPTQ_ZERO_WORD = 0x77777777  # eight stored zero points of 7: symmetric 4-bit's zero 8, minus one (v1)


class QuantTensorError(LoadError):
    """A quantized checkpoint tensor that breaks its format's rule: names the file, the tensor, the rule, the value."""


class _Tensors:
    """The checkpoint's tensor headers (``{name: (file, dtype, shape)}``) and a reader of the small ones."""

    def __init__(self, model_dir: str | Path):
        self.where: dict[str, str] = {}
        self.head: dict[str, tuple[str, tuple[int, ...]]] = {}
        for fname, names in checkpoint_files(model_dir).items():
            with open_safetensors(fname) as f:
                for name in names:
                    sl = f.get_slice(name)
                    dt = sl.get_dtype()
                    self.where[name] = fname
                    self.head[name] = (DTYPES.get(dt, dt), tuple(sl.get_shape()))

    def error(self, name: str, rule: str, found: str) -> QuantTensorError:
        return QuantTensorError(f"{Path(self.where[name]).name}: {name}: {rule}, found {found}")

    def dtype(self, name: str, allowed: tuple[str, ...], what: str) -> None:
        got = self.head[name][0]
        if got not in allowed:
            raise self.error(name, f"{what} must be {' or '.join(allowed)}", got)

    def shape(self, name: str, allowed: list[tuple[int, ...]], what: str) -> tuple[int, ...]:
        got = self.head[name][1]
        if got not in allowed:
            raise self.error(name, f"{what} must have shape {' or '.join(str(list(s)) for s in allowed)}", list(got))
        return got

    def read(self, name: str) -> torch.Tensor:
        with open_safetensors(self.where[name]) as f:
            return f.get_tensor(name)

    def positive_finite(self, name: str, what: str) -> None:
        """Every value of a scale finite and > 0 (read in float64: no value lost)."""
        self.dtype(name, FLOATS, what)
        t = self.read(name).to(torch.float64)
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            raise self.error(name, f"{what} must be positive and finite", _first(t, bad))


def _first(t: torch.Tensor, bad: torch.Tensor) -> str:
    """The first offending value and its index (``t`` has at least one ``bad`` element)."""
    idx = [int(i) for i in bad.nonzero()[0]]
    return f"{t[tuple(idx)].item()!r}" + (f" at {idx}" if idx else "") + f" ({int(bad.sum())} of {t.numel()})"


def check_quantized_checkpoint(model_dir: str | Path, cfg) -> None:
    """Refuse (``QuantTensorError``, exit 2) a tensor of ``model_dir`` that breaks its ``cfg.quant`` scheme's rule
    (module docstring); a float checkpoint (``cfg.quant`` None) is not read."""
    scheme = cfg.quant
    if scheme is None:
        return
    ts = _Tensors(model_dir)
    if isinstance(scheme, (GptqScheme, AwqScheme)):
        for module in _modules(ts, W4_TENSORS):
            _check_w4(ts, module, scheme)
    elif getattr(scheme, "quantizes_weights", True):
        for module in _modules(ts, W8A8_TENSORS):
            _check_w8a8(ts, module, scheme)
    kv = getattr(scheme, "kv_cache", None)
    if kv is not None:
        for i in range(cfg.num_layers):
            for n in ("k_scale", "v_scale"):
                _check_kv_scale(ts, f"model.layers.{i}.self_attn.{n}", kv, cfg.num_kv_heads)


def _modules(ts: _Tensors, suffixes: tuple[str, ...]) -> list[str]:
    """The quantized linears: a module holding one of ``suffixes`` (besides a plain ``weight``) or a layer's
    ``*_proj`` (its weight, whatever its dtype)."""
    out = set()
    for name in ts.head:
        module, _, leaf = name.rpartition(".")
        if (leaf in suffixes and leaf != "weight") or (leaf == "weight" and PROJ.fullmatch(module)):
            out.add(module)
    return sorted(out)


def _check_w8a8(ts: _Tensors, module: str, scheme) -> None:
    kind = "an INT8" if scheme.num_type == "int" else "an FP8"
    want = "int8" if scheme.num_type == "int" else "float8_e4m3fn"
    w, s, i = (f"{module}.{leaf}" for leaf in W8A8_TENSORS)
    if w in ts.head:
        ts.dtype(w, (want,), f"{kind} W8A8 weight (the loader would cast it, the golden would not)")
        _form(ts, w, 2, f"{kind} W8A8 weight must be 2-D [out, in]")
    if s in ts.head:
        if scheme.weight_strategy == "channel":
            if len(ts.head[s][1]) != 2 or ts.head[s][1][1] != 1:
                raise ts.error(s, "a channel weight scale must have shape [out, 1]", list(ts.head[s][1]))
        else:
            ts.shape(s, [(1,), ()], "a tensor weight scale")
        ts.positive_finite(s, "a weight scale")
    if i in ts.head and not scheme.dynamic_input:  # a dynamic scheme's input_scale: the loader's unexpected tensor
        ts.shape(i, [(1,), ()], "a static input scale")
        ts.positive_finite(i, "an input scale")


def _check_w4(ts: _Tensors, module: str, scheme) -> None:
    """The dtypes, forms and values the format fixes. How the sizes relate ([K/8, N] against [G, N] and the
    model's [in, out]) is the loader's check, against the model: whichever tensor is off, it names that one."""
    gptq = isinstance(scheme, GptqScheme)
    fmt, a_fmt = ("GPTQ", "a GPTQ") if gptq else ("AWQ", "an AWQ")
    qw, qz, sc, gi = (f"{module}.{leaf}" for leaf in W4_TENSORS)
    for name in (qw, qz):
        if name in ts.head:
            ts.dtype(name, ("int32",), f"{a_fmt} {name.rpartition('.')[2]} (eight 4-bit values packed per word)")
            _form(ts, name, 2, f"{a_fmt} {name.rpartition('.')[2]} must be 2-D")
    if sc in ts.head:
        _form(ts, sc, 2, f"{fmt} scales must be 2-D [groups, out]")
        ts.positive_finite(sc, f"{a_fmt} scale")
    if not gptq:
        return
    if qz in ts.head:
        zeros = ts.read(qz)
        bad = zeros != GPTQ_ZERO_WORD
        if bool(bad.any()):
            raise ts.error(qz, "symmetric GPTQ (sym: true) fixes every zero point at 8, stored 7: every word "
                           "0x77777777", hex(int(zeros[tuple(int(i) for i in bad.nonzero()[0])]) & 0xFFFFFFFF))
    if gi in ts.head:
        ts.dtype(gi, ("int32",), "a GPTQ g_idx")
        _form(ts, gi, 1, "a GPTQ g_idx must be 1-D [in]")
    if gi in ts.head and sc in ts.head:
        groups = ts.head[sc][1][0]
        idx = ts.read(gi).to(torch.int64)
        bad = (idx < 0) | (idx >= groups)
        if bool(bad.any()):
            raise ts.error(gi, f"every g_idx must be a group in [0, {groups}) (scales has {groups} rows)",
                           _first(idx, bad))


def _form(ts: _Tensors, name: str, dims: int, rule: str) -> None:
    if len(ts.head[name][1]) != dims:
        raise ts.error(name, rule, list(ts.head[name][1]))


def _check_kv_scale(ts: _Tensors, name: str, strategy: str, kv_heads: int) -> None:
    if name not in ts.head:
        return  # missing: the loader names every missing tensor at once
    ts.shape(name, [(1,), ()] if strategy == "tensor" else [(kv_heads,), (kv_heads, 1, 1)],
             f"an FP8 KV-cache scale ({strategy} strategy, {kv_heads} KV heads)")
    ts.positive_finite(name, "an FP8 KV-cache scale")
