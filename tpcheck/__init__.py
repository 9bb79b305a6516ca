"""tpcheck: a differential correctness harness for tensor-parallel LLM inference."""
