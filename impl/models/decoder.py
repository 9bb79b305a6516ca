"""The decoder skeleton shared by every supported family (Llama, Mistral, Qwen2, Qwen3 and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE, Mixtral), built from the tensor-parallel layers. A family file (``qwen2.py``, ``llama.py``,
``qwen3.py``, ``qwen2_moe.py``, ``qwen3_moe.py``, ``mixtral.py``) only names its classes and overrides what is
its own; the options HF spells in the config (biases, RoPE scaling, sliding windows, experts) are read from
``ModelConfig``. Each layer's ``mlp`` is the dense ``GatedMLP`` or, on the layers ``ModelConfig.is_sparse``
names, a ``SparseMoeBlock`` (``impl.layers.moe``: router, top-k, experts under TP / EP, one all-reduce).

Module names mirror Hugging Face's (``model.layers.{i}.self_attn...``) except where projections are fused:
``qkv_proj`` = q_proj | k_proj | v_proj and ``gate_up_proj`` = gate_proj | up_proj (see
``packed_modules_mapping``, which the loader uses to route checkpoint tensors to their shard).

Per layer on rank r of tp (H query heads, K KV heads, I MLP width):
``qkv_proj`` column-parallel by heads (H/tp query heads; K/tp KV heads, or one replicated KV head when
tp > K), attention local to those heads, ``o_proj`` row-parallel (one all-reduce; its bias, if any, added
once); ``gate_up_proj`` column-parallel (I/tp), ``down_proj`` row-parallel (one all-reduce). Norms, RoPE
and residual adds act on replicated or per-head data and need no communication."""
from __future__ import annotations

import torch
from torch import nn

from impl.config import ModelConfig
from impl.layers.attention import Attention
from impl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from impl.layers.linear import QKVParallelLinear, RowParallelLinear
from impl.layers.mlp import GatedMLP
from impl.layers.moe import SparseMoeBlock
from impl.layers.norm import RMSNorm
from impl.layers.rotary import RotaryEmbedding
from impl.pipeline import PPMissingLayer, Stage, single_stage
from impl.quant_gptq import layer_name


class DecoderAttention(nn.Module):
    """Self-attention of one layer: q/k/v projection, ``norm_qk`` (identity here; Qwen3 overrides it),
    RoPE, paged causal GQA attention (windowed on the layers the config says), output projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias,
                                          dtype=dtype, quant=cfg.quant)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, d
        with layer_name(f"model.layers.{layer_idx}.self_attn.o_proj"):
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype,
                                            quant=cfg.quant)
        self.rotary_emb = RotaryEmbedding(d, cfg.layer_rope_theta(layer_idx), cfg.rope_scaling)
        qkv = self.qkv_proj  # an FP8 KV cache's per-head scales follow the rank's KV heads (replicas included)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, cfg.attn_scale, cfg.sliding_window(layer_idx),
                              kv_quant=getattr(cfg.quant, "kv_cache", None), total_kv_heads=cfg.num_kv_heads,
                              first_kv_head=qkv.tp_rank // qkv.kv_replicas * self.num_kv_heads)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, local heads, d]``, k ``[T, local kv heads, d]`` between projection and RoPE."""
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = self.rotary_emb(positions, q, k)
        context = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(context)


class DecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``; ``mlp`` is a ``SparseMoeBlock`` on the sparse layers
    (experts split over ``ep_size`` groups of the tp ranks), the dense ``GatedMLP`` on the others."""

    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_cls: type[DecoderAttention] = DecoderAttention, ep_size: int = 1):
        super().__init__()
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attention_cls(cfg, layer_idx, dtype)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(cfg, dtype, ep_size)
        else:
            with layer_name(f"model.layers.{layer_idx}.mlp"):
                self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, quant=cfg.quant,
                                    act=cfg.hidden_act)

        self.sent: dict[str, torch.Tensor] | None = None  # the last layer of a stage before the last: what it sends

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # same op order and dtype as HF: residual adds in the activation dtype
        h = x + self.self_attn(positions, self.input_layernorm(x))
        m = self.mlp(self.post_attention_layernorm(h))
        if self.sent is not None:  # a stage boundary: the next stage does the final add (vLLM's residual)
            self.sent = {"hidden_states": m, "residual": h}
        return h + m


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm; under pipeline parallelism (``stage``, ``impl.pipeline``) only the
    stage's layers (the others ``PPMissingLayer``, so module names stay global), the embedding on the first stage
    only and the final norm on the last only."""

    embed_cls: type[nn.Module] = VocabParallelEmbedding
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attention_cls: type[DecoderAttention] = DecoderAttention,
                 ep_size: int = 1, stage: Stage | None = None):
        super().__init__()
        self.stage = stage or single_stage(cfg.num_layers)
        st = self.stage
        self.embed_tokens = (self.embed_cls(cfg.vocab_size, cfg.hidden_size, dtype) if st.is_first
                             else PPMissingLayer())
        self.layers = nn.ModuleList([self.layer_cls(cfg, i, dtype, attention_cls, ep_size) if st.holds_layer(i)
                                     else PPMissingLayer() for i in range(cfg.num_layers)])
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype) if st.is_last else PPMissingLayer()
        if not st.is_last:
            self.layers[st.end - 1].sent = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The final-normed hidden states on the last stage; on an earlier stage the ``IntermediateTensors``
        (``hidden_states``, ``residual``) to send on. A stage after the first starts from the ``intermediate`` it
        received (``residual + hidden_states``: the boundary layer's own final add)."""
        st = self.stage
        h = self.embed_tokens(input_ids) if st.is_first else intermediate["residual"] + intermediate["hidden_states"]
        for i in range(st.start, st.end):
            h = self.layers[i](positions, h)
        if st.is_last:
            return self.norm(h)
        out, self.layers[st.end - 1].sent = self.layers[st.end - 1].sent, {}
        return out


class DecoderForCausalLM(nn.Module):
    """A family's causal LM: ``model`` (embedding, layers, final norm) and a vocab-parallel ``lm_head`` (the
    embedding's parameter when tied). A subclass sets ``model_type`` (checked against the config) and, where
    its attention differs, ``attention_cls``. ``ep_size``: the expert-parallel groups of a MoE model's tp
    ranks (``impl.layers.moe``; 1 for a dense model)."""

    model_type: str = ""
    attention_cls: type[DecoderAttention] = DecoderAttention
    model_cls: type[DecoderModel] = DecoderModel
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, ep_size: int = 1,
                 stage: Stage | None = None):
        super().__init__()
        if cfg.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__} builds model_type {self.model_type!r}, the config is "
                             f"{cfg.model_type!r} (build the model through impl.models.model_class)")
        self.cfg, self.ep_size = cfg, ep_size
        self.model = self.model_cls(cfg, dtype, self.attention_cls, ep_size, stage)
        self.stage = self.model.stage
        # the LM head on the last stage only; tied, it shares the embedding's parameter when the stage has it,
        # else (pp > 1) it is its own parameter that the loader fills from model.embed_tokens.weight (as vLLM)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype) if self.stage.is_last else PPMissingLayer()
        if cfg.tie_word_embeddings and self.stage.is_last and self.stage.is_first:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.model(input_ids, positions, intermediate)

    def holds_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this pipeline stage (the loader reads no other):
        the stage's layers; the embedding on the first stage (and, tied, the last, for its LM head); the final
        norm and LM head on the last. A layer no stage owns (an index past the model's layers, or not a number) is
        held by every stage, so that the loader refuses it as a tensor the model has no place for (pp 1 included)."""
        st = self.stage
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            if not (index.isascii() and index.isdigit()) or int(index) >= self.cfg.num_layers:
                return True
            return st.holds_layer(int(index))
        if name.startswith("model.embed_tokens."):
            return st.is_first or (st.is_last and self.cfg.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return st.is_last
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[T, V]`` logits on rank 0 (padding stripped), None on the other ranks."""
        return self.lm_head(hidden)
