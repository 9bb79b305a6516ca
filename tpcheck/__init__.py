"""tpcheck: a differential correctness harness for tensor-parallel LLM inference."""
from tpcheck.diff import diff
from tpcheck.result import DiffResult, Tolerances

__all__ = ["diff", "DiffResult", "Tolerances"]
