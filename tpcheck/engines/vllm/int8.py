"""What vLLM's CPU INT8 W8A8 GEMM computes on an x86 CPU without AVX512-VNNI (oneDNN's AVX2 int8 path), as an
exact model: ``pair_saturating_gemm``. It is what ``benchmarks/vllm_int8_gemm.py`` and the vLLM tests hold vLLM's
op (``_C.onednn_scaled_mm``) to, bit for bit.

Without VNNI, oneDNN multiplies int8 by ``vpmaddubsw``: unsigned 8-bit times signed 8-bit, two adjacent products
summed into a **saturating int16**, then ``vpmaddwd`` widens to int32. The activations are signed, so oneDNN shifts
them to unsigned (``x + 128``, 1..255) and subtracts the compensation ``128 * sum_k w[k, n]`` from the int32 sum.
For output ``n`` and the pair ``(k, k + 1)``:

    pair = sat16((x[k] + 128) w[k, n] + (x[k+1] + 128) w[k+1, n])          sat16: clamp to [-32768, 32767]
    acc[n] = sum over pairs - 128 sum_k w[k, n]

``|pair| <= 2 * 255 * |w|max``: exact while every weight is within +-64 (32640), not at +-127 (64770), the range
every row of a per-channel INT8 checkpoint reaches. oneDNN documents the non-VNNI int8 path's overflow and asks for
7-bit weights there; vLLM's CPU kernel quantizes to the full 8 bits and does not."""
from __future__ import annotations

import torch

SAT16 = (-32768, 32767)


def exact_int8_gemm(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``xq @ w`` in int64 (exact): ``xq`` int8 ``[M, K]``, ``w`` int8 ``[K, N]``; float64 ``[M, N]``."""
    return (xq.long() @ w.long()).double()


def _pair_sums(xq: torch.Tensor, w: torch.Tensor):
    """Each pair ``(k, k + 1)``'s unclamped ``[M, N]`` sum ``(x[k] + 128) w[k] + (x[k+1] + 128) w[k+1]`` (int64),
    one pair at a time; ``xq`` int8 ``[M, K]``, ``w`` int8 ``[K, N]``, ``K`` even."""
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"pair_saturating_gemm: int8 operands, got {xq.dtype} and {w.dtype}")
    if xq.shape[1] != w.shape[0] or xq.shape[1] % 2:
        raise ValueError(f"pair_saturating_gemm: x {tuple(xq.shape)} @ w {tuple(w.shape)}: K must agree and be even")
    a, wl = xq.long() + 128, w.long()
    for k in range(0, xq.shape[1], 2):
        yield a[:, k, None] * wl[k] + a[:, k + 1, None] * wl[k + 1]


def pair_saturating_gemm(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The int32 accumulator of oneDNN's non-VNNI int8 GEMM (module docstring): ``xq`` int8 ``[M, K]``, ``w`` int8
    ``[K, N]``, ``K`` even; float64 ``[M, N]`` (exact: integers below 2^53)."""
    acc = torch.zeros(xq.shape[0], w.shape[1], dtype=torch.long)
    for s in _pair_sums(xq, w):  # int16 sums, clamped
        acc += s.clamp(*SAT16)
    return (acc - 128 * w.long().sum(0)).double()


def saturated_pairs(xq: torch.Tensor, w: torch.Tensor) -> float:
    """The fraction of ``(token, pair, output)`` int16 sums that saturate."""
    hit = sum(int(((s < SAT16[0]) | (s > SAT16[1])).sum()) for s in _pair_sums(xq, w))
    return hit / (xq.shape[0] * (xq.shape[1] // 2) * w.shape[1])
