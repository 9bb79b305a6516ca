"""Qwen3-MoE causal LM (HF ``Qwen3MoeForCausalLM``): Qwen3's attention (per-head ``q_norm`` / ``k_norm`` before
RoPE, ``impl.models.qwen3``) over the shared decoder, whose sparse layers are ``impl.layers.moe.SparseMoeBlock``s
without a shared expert, top-k weights renormalised when ``norm_topk_prob``. ``use_sliding_window`` is refused
by ``load_config``."""
from __future__ import annotations

from impl.models.decoder import DecoderForCausalLM
from impl.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    model_type = "qwen3_moe"
    attention_cls = Qwen3Attention
