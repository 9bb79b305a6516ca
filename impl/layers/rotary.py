"""Rotary position embedding, neox style (rotate halves), as Hugging Face Qwen2 computes it.

``inv_freq[j] = 1 / theta^(2j/d)``; for position p the angles are ``p * inv_freq`` (float32), duplicated to
``d``; ``x' = x*cos + rotate_half(x)*sin`` with cos/sin cast to x's dtype, ``rotate_half([a, b]) = [-b, a]``.
Positions are absolute token positions (a decode token sits at its sequence length - 1)."""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: ``[T, heads, d]``, k: ``[T, kv_heads, d]``, positions: ``[T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
