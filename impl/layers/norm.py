"""RMSNorm in Hugging Face's op order: normalise in float32, cast back to the input dtype, then scale.
(Scaling before the cast back gives different bfloat16 results.)"""
from __future__ import annotations

import torch
from torch import nn

from impl.placements import Replicate


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.output_placement = Replicate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
