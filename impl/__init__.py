"""impl: a vLLM-style tensor-parallel inference engine for the Hugging Face Qwen2 / Qwen2.5 family."""
from impl.llm import LLM
from impl.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
