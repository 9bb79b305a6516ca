"""Mixtral causal LM (HF ``MixtralForCausalLM``): Mistral's attention (no biases; a ``sliding_window`` below
``max_position_embeddings`` applies to every layer) over the shared decoder, every layer an
``impl.layers.moe.SparseMoeBlock`` of ``num_local_experts`` experts of width ``intermediate_size``, top-k weights
always renormalised and kept in float32 (HF's ``MixtralTopKRouter``). Checkpoint names are Mixtral's own
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` for gate / up / down); the module is
``mlp``, as transformers 5 names it."""
from __future__ import annotations

from impl.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    model_type = "mixtral"
