"""Qwen2 / Qwen2.5 causal LM (HF ``Qwen2ForCausalLM``): the shared decoder (``impl.models.decoder``) with
q/k/v biases, no o_proj or MLP biases, no q/k norm. ``use_sliding_window`` is refused by ``load_config``."""
from __future__ import annotations

from impl.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    model_type = "qwen2"
