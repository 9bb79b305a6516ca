"""impl: a vLLM-style tensor-parallel inference engine for Hugging Face Llama 2/3, Mistral, Qwen2 / Qwen2.5
and Qwen3 checkpoints (``impl.config.FAMILIES``)."""
from impl.llm import LLM, CacheConfig
from impl.sampling_params import SamplingParams

__all__ = ["LLM", "CacheConfig", "SamplingParams"]
