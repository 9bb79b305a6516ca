"""Gemma 3 text causal LM (HF ``Gemma3ForCausalLM``, ``model_type: gemma3_text``): the shared decoder
(``impl.models.decoder``) with what Gemma changes, each as HF computes it.

* Norms are ``GemmaRMSNorm``: ``(x_hat * (1 + w)).to(dtype)``, scaled in float32 (``impl.layers.norm``).
* Four norms per layer ("sandwich"): ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
  ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``. (In the other families
  ``post_attention_layernorm`` is the MLP's input norm; here that is ``pre_feedforward_layernorm``.)
* The embedding is scaled by ``sqrt(hidden_size)``, the factor rounded to the weights' dtype first (HF's
  ``Gemma3TextScaledWordEmbedding``).
* q and k are normalised per head (``GemmaHeadRMSNorm``) before RoPE, as Qwen3's; the scores are scaled by
  ``query_pre_attn_scalar ** -0.5``; sliding layers use the local RoPE base (``ModelConfig.layer_rope_theta``).
* The MLP is GeGLU with the tanh GELU (``hidden_activation: gelu_pytorch_tanh``).

Sharding is the other families': the post-attention and post-feed-forward norms act on the all-reduced
(replicated) outputs of ``o_proj`` and ``down_proj``, so they need no communication; the per-head norms act on each
rank's own heads (a KV head replicated when tp exceeds the KV heads: Gemma 3 270M has one, so every rank at tp > 1
holds the same replica). The embedding scale multiplies the all-reduced (replicated) embedding."""
from __future__ import annotations

import torch
from torch import nn

from impl.config import ModelConfig
from impl.layers.embedding import VocabParallelEmbedding
from impl.layers.norm import GemmaHeadRMSNorm, GemmaRMSNorm
from impl.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer, DecoderModel
from impl.models.qwen3 import Qwen3Attention


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` times ``sqrt(hidden_size)`` rounded to the weight's dtype (HF's order: the float32
    constant cast to the dtype, then one multiply), after the all-reduce: every rank scales the same rows."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__(vocab_size, hidden_size, dtype)
        self.register_buffer("embed_scale", torch.tensor(hidden_size ** 0.5).to(dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (``q = q_norm(q_proj(x))``, ``k = k_norm(k_proj(x))`` per head, then RoPE) with Gemma's
    ``(1 + w)`` head norm; RoPE at the layer's own base and the scores scaled by ``query_pre_attn_scalar ** -0.5``
    come from ``ModelConfig`` (``layer_rope_theta``, ``attn_scale``) in the shared ``DecoderAttention``."""

    head_norm_cls = GemmaHeadRMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    """``h = x + post_attention_layernorm(attn(input_layernorm(x)))``;
    ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (residual adds in the activation
    dtype, as HF)."""

    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_cls: type[DecoderAttention] = Gemma3Attention, ep_size: int = 1):
        super().__init__(cfg, layer_idx, dtype, attention_cls, ep_size)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        m = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.sent is not None:  # a stage boundary: the next stage does the final add
            self.sent = {"hidden_states": m, "residual": h}
        return h + m


class Gemma3Model(DecoderModel):
    embed_cls: type[nn.Module] = ScaledVocabParallelEmbedding
    layer_cls: type[nn.Module] = Gemma3DecoderLayer
    norm_cls: type[nn.Module] = GemmaRMSNorm


class Gemma3ForCausalLM(DecoderForCausalLM):
    model_type = "gemma3_text"
    attention_cls = Gemma3Attention
    model_cls = Gemma3Model
