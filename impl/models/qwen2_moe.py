"""Qwen2-MoE causal LM (HF ``Qwen2MoeForCausalLM``, Qwen1.5-MoE / Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases unless the config's ``qkv_bias`` is false) over the shared decoder, whose sparse layers
(``decoder_sparse_step`` / ``mlp_only_layers``) are ``impl.layers.moe.SparseMoeBlock``s with a shared expert
scaled by ``sigmoid(shared_expert_gate(x))``, top-k weights renormalised when ``norm_topk_prob``; the other
layers are dense MLPs of ``intermediate_size``. ``use_sliding_window`` is refused by ``load_config``."""
from __future__ import annotations

from impl.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    model_type = "qwen2_moe"
