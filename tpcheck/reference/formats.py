"""The quantized formats read from their specifications, for the golden and the references, independently of impl's
reading (``impl.quant*``; nothing here imports them): a bug in impl's format code then moves the engine and not the
golden, and the diff sees it. ``tests/test_tpcheck/reference/test_formats.py`` holds the two readers to each other on every
scheme, so a bug in either shows.

* **INT8 activations** (compressed-tensors ``int-quantized``): per token ``s = max|x_t| / 127`` (a zero row: 1),
  ``q = clamp(round_half_even(x / s), -128, 127)``; static: the one ``input_scale``.
* **FP8 e4m3** (``float-quantized``): ``e4m3(v)`` is ``v`` clamped to ``[-448, 448]`` and rounded to the nearest
  e4m3 value, ties to even, through float32 (so that every ``work`` dtype rounds a value by one rule: torch's float64
  -> e4m3 cast rounds a value within 2^-24 of a tie as the tie); per token ``s = max|x_t| / 448``; static one scale.
  A fused layer with per-tensor weight scales holds one: each part ``W_i`` (scale ``s_i``) becomes
  ``e4m3((W_i s_i) / s_max)``, ``s_max = max_i s_i`` (vLLM's ``requantize_with_max_scale``: the format's engine).
* **FP8 KV cache** (``kv_cache_scheme``): a key or value ``x`` (scale broadcast per KV head) is stored as
  ``e4m3(x / s)`` (the division in float32; float64 for the golden) and read back as ``e4m3 value * s`` in the same
  work dtype, cast to ``x``'s.
* **GPTQ v1** (AutoGPTQ): ``qweight`` int32 ``[K/8, N]`` packs input rows ``8r .. 8r+7`` of column ``n`` in word
  ``[r, n]``, row ``8r + i`` in bits ``4i .. 4i+3``; ``qzeros`` int32 ``[G, N/8]`` packs output columns the same way
  along the row, storing ``zero - 1``; ``W[k, n] = scales[g_idx[k], n] * (q[k, n] - (stored + 1))``.
* **AWQ** (AutoAWQ GEMM): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` ``[G, N/8]`` pack eight output columns per
  word in AutoAWQ's order: nibble ``i`` (bits ``4i ..``) holds column ``8c + PACK_ORDER[i]``, ``PACK_ORDER = [0, 2,
  4, 6, 1, 3, 5, 7]``; the zero point is stored as is; ``W[k, n] = scales[k // gs, n] * (q[k, n] - zero[k // gs,
  n])``."""
from __future__ import annotations

import torch

INT8_MAX = 127
E4M3_MAX = 448.0
E4M3 = torch.float8_e4m3fn
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i <- column AWQ_PACK_ORDER[i] of its eight
_NIBBLES = 8


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """``v`` as float8_e4m3fn: clamped to +-448, nearest e4m3, ties to even (through float32: module docstring)."""
    return v.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_activation(x: torch.Tensor, num_type: str, work: torch.dtype,
                        scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_x, s_x)`` of ``x`` ``[T, K]`` in ``work``: ``num_type`` "int" (INT8) or "float" (FP8 e4m3); per token
    (``scale`` None: ``s_x [T, 1]``) or with the static ``scale``."""
    xw = x.to(work)
    top = INT8_MAX if num_type == "int" else E4M3_MAX
    if scale is None:
        s = xw.abs().amax(dim=-1, keepdim=True) / top
        s = torch.where(s == 0, torch.ones_like(s), s)
    else:
        s = scale.to(work)
    v = xw / s
    q = torch.round(v).clamp(-INT8_MAX - 1, INT8_MAX) if num_type == "int" else e4m3(v).to(work)
    return q, s


def requantize_to_max(parts: list[torch.Tensor], scales: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """FP8 fused per-tensor parts (e4m3 ``parts``, one scale each) re-quantized to their largest scale, in float64:
    ``(the new e4m3 parts, s_max [1] float32)``. A part whose scale is the maximum keeps its values."""
    s_max = scales.reshape(-1).max().reshape(1).to(torch.float32)
    out = []
    for w, s in zip(parts, scales.reshape(-1)):
        same = bool(s.to(torch.float32) == s_max[0])
        out.append(w.clone() if same else e4m3(w.to(torch.float64) * s.to(torch.float64) / s_max.double()))
    return out, s_max


def fake_quant_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a key or value becomes through the FP8 cache, in ``x``'s dtype (module docstring)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (e4m3(x.to(work) / scale.to(work)).to(work) * scale.to(work)).to(x.dtype)


def _unpack_along_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> int64 ``[R, 8C]``: nibble ``i`` of word ``[r, c]`` at column ``8c + i``."""
    w = words.to(torch.int64) & 0xFFFFFFFF  # the word's 32 bits, unsigned
    nibbles = [(w >> (4 * i)) & 0xF for i in range(_NIBBLES)]
    return torch.stack(nibbles, dim=-1).reshape(w.shape[0], -1)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor) -> torch.Tensor:
    """A GPTQ v1 layer's weight ``[K, N]`` (input-major) in float64 (exact: a float16 scale times a small integer)."""
    q = _unpack_along_columns(qweight.t().contiguous()).t()  # rows packed: column-unpacking of the transpose
    zero = _unpack_along_columns(qzeros) + 1
    g = g_idx.to(torch.int64)
    return scales.to(torch.float64)[g] * (q - zero[g]).to(torch.float64)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's packing undone: int32 ``[R, C]`` -> int64 ``[R, 8C]`` in column order."""
    v = _unpack_along_columns(words).reshape(words.shape[0], -1, _NIBBLES)  # [R, C, nibble]
    out = torch.empty_like(v)
    out[:, :, list(AWQ_PACK_ORDER)] = v  # nibble i is column PACK_ORDER[i] of the word's eight
    return out.reshape(words.shape[0], -1)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An AWQ layer's weight ``[K, N]`` (input-major) in float64; ``K / G`` rows per group."""
    q, zero = _unpack_awq(qweight), _unpack_awq(qzeros)
    g = torch.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    return scales.to(torch.float64)[g] * (q - zero[g]).to(torch.float64)
