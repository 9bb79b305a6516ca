"""Qwen3 causal LM (HF ``Qwen3ForCausalLM``): the shared decoder (``impl.models.decoder``) with per-head
RMSNorm of q and k (``q_norm`` / ``k_norm``) after the projection and before RoPE, no q/k/v bias unless
``attention_bias`` (which, as in HF, also biases o_proj), an explicit ``head_dim`` (often != hidden / heads),
and sliding windows on the layers HF's ``layer_types`` marks ``sliding_attention``."""
from __future__ import annotations

import torch

from impl.config import ModelConfig
from impl.layers.norm import HeadRMSNorm
from impl.models.decoder import DecoderAttention, DecoderForCausalLM
from impl.placements import Shard


class Qwen3Attention(DecoderAttention):
    """``q = q_norm(q_proj(x))`` per head, ``k = k_norm(k_proj(x))`` per head, then RoPE.

    Sharding: each norm's weight is ``[head_dim]``, shared by all heads, so every rank holds it whole
    (replicated, loaded in full) and normalises the heads it holds (its H/tp query heads; its K/tp KV heads,
    or its replica of one KV head when tp > K) with no communication: the statistics of a head never
    involve another head."""

    head_norm_cls: type[HeadRMSNorm] = HeadRMSNorm  # Gemma 3's: GemmaHeadRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__(cfg, layer_idx, dtype)
        self.q_norm = self.head_norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, Shard(-1))
        self.k_norm = self.head_norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, Shard(-1, self.qkv_proj.kv_replicas))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(DecoderForCausalLM):
    model_type = "qwen3"
    attention_cls = Qwen3Attention
