"""Qwen2 / Qwen2.5 causal LM built from the tensor-parallel layers.

Module names mirror Hugging Face's (``model.layers.{i}.self_attn...``) except where projections are fused:
``qkv_proj`` = q_proj | k_proj | v_proj and ``gate_up_proj`` = gate_proj | up_proj (see
``packed_modules_mapping``, which the loader uses to route checkpoint tensors to their shard)."""
from __future__ import annotations

import torch
from torch import nn

from impl.config import ModelConfig
from impl.layers.activation import SiluAndMul
from impl.layers.attention import Attention
from impl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from impl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from impl.layers.norm import RMSNorm
from impl.layers.rotary import RotaryEmbedding


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=True, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, d
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(d, cfg.rope_theta)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        context = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(context)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [n, n], bias=False, dtype=dtype)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Qwen2Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = Qwen2MLP(cfg, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # same op order and dtype as HF: residual adds in the activation dtype
        h = x + self.self_attn(positions, self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2Model(cfg, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[T, V]`` logits on rank 0 (padding stripped), None on the other ranks."""
        return self.lm_head(hidden)
