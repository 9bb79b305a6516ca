"""Rotary position embedding, neox style (rotate halves), as Hugging Face's Llama / Mistral / Qwen2 / Qwen3
compute it.

``inv_freq[j] = 1 / theta^(2j/d)``; for position p the angles are ``p * inv_freq`` (float32), duplicated to
``d``; ``x' = x*cos + rotate_half(x)*sin`` with cos/sin cast to x's dtype, ``rotate_half([a, b]) = [-b, a]``.
Positions are absolute token positions (a decode token sits at its sequence length - 1).

Llama 3 scaling (``rope_type: llama3``) only remaps ``inv_freq`` once at construction (``llama3_inv_freq``);
the rotation itself is unchanged and its attention factor is 1. RoPE acts per head on the head dim, so it is
the same on every TP rank: nothing here is sharded."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The ``rope_type: llama3`` parameters (HF's names in comments)."""

    factor: float                  # factor
    low_freq_factor: float         # low_freq_factor
    high_freq_factor: float        # high_freq_factor
    original_max_position: int     # original_max_position_embeddings


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2j/d)`` in float32, in HF's op order (int64 arange cast to float, then divided)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency remap, the same float32 ops in the same order as HF's
    ``_compute_llama3_parameters`` (so the result is bit-for-bit HF's): with wavelength ``w = 2*pi / f``,
    frequencies with ``w < L/high`` are kept, those with ``w > L/low`` divided by ``factor``, and those in
    between interpolated with ``smooth = (L/w - low) / (high - low)`` (``L`` = original max positions)."""
    factor, low, high, old_len = s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * out / factor + smooth_factor * out
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = default_inv_freq(head_dim, theta)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
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
