"""Llama 2 / 3 (HF ``LlamaForCausalLM``) and Mistral (HF ``MistralForCausalLM``) causal LMs: the shared
decoder (``impl.models.decoder``) with no biases unless the config turns them on.

* Llama: ``attention_bias`` puts biases on q/k/v and o_proj, ``mlp_bias`` on gate/up/down (as in HF);
  ``rope_type: llama3`` remaps the RoPE frequencies (``impl.layers.rotary.llama3_inv_freq``); an explicit
  ``head_dim`` may differ from hidden / heads.
* Mistral: the same decoder with no bias flags (HF's Mistral has none); a ``sliding_window`` below
  ``max_position_embeddings`` limits every layer's attention to that many most recent tokens."""
from __future__ import annotations

from impl.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    model_type = "llama"


class MistralForCausalLM(DecoderForCausalLM):
    model_type = "mistral"
