"""RMSNorm in Hugging Face's op order: normalise in float32, cast back to the input dtype, then scale.
(Scaling before the cast back gives different bfloat16 results.)

``RMSNorm`` over the hidden size is replicated (every rank holds the whole ``[hidden]`` activations).
``HeadRMSNorm`` (Qwen3's ``q_norm`` / ``k_norm``) normalises each head's ``head_dim`` vector on its own with a
``[head_dim]`` weight shared by all heads; a head never spans ranks, so each rank applies it to the heads it
holds with no communication, and the weight is replicated, not sharded.

``GemmaRMSNorm`` / ``GemmaHeadRMSNorm`` (Gemma 3) store ``w`` and scale by ``1 + w``, and in HF's Gemma op order:
the scaling is done in float32 and only the result is cast to the input dtype (``(x_hat * (1 + w)).to(dtype)``),
where Llama's casts first (``w * x_hat.to(dtype)``): in bfloat16 the two orders round differently."""
from __future__ import annotations

import torch
from torch import nn

from impl.placements import Placement, Replicate


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


class HeadRMSNorm(RMSNorm):
    """RMSNorm of ``[T, local heads, head_dim]`` over the last dim, one ``[head_dim]`` weight for every head.

    Sharding: the statistics are per (token, head), so rank r's output for its heads ``[r*H/tp, (r+1)*H/tp)``
    equals those heads of the unsharded output; the output keeps the placement of the projection it
    normalises (``output_placement``: ``Shard(-1)`` for q, ``Shard(-1, kv replicas)`` for k)."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype, output_placement: Placement):
        super().__init__(head_dim, eps, dtype)
        self.output_placement = output_placement


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x_hat * (1 + w.float())).to(x.dtype)`` with ``x_hat`` normalised in float32; a checkpoint's
    weight ``w`` is the offset from 1 (zeros = identity scale). Replicated, as ``RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class GemmaHeadRMSNorm(GemmaRMSNorm):
    """Gemma 3's per-head ``q_norm`` / ``k_norm``: ``GemmaRMSNorm`` over each head's ``head_dim``, placed like the
    heads it normalises (see ``HeadRMSNorm``)."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype, output_placement: Placement):
        super().__init__(head_dim, eps, dtype)
        self.output_placement = output_placement
