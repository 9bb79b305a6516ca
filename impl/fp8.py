"""The float8_e4m3fn rounding every FP8 path shares (W8A8 linears: ``impl.quant_fp8``; the KV cache:
``impl.quant_kv``): values clamped to +-448 (e4m3's largest) and cast through float32, nearest, ties to even."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x, -448, 448))`` (nearest, ties to even), cast through float32; returned as float8_e4m3fn."""
    return x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(FP8)
