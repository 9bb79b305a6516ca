"""tpcheck: a differential correctness harness for tensor-parallel LLM inference.

``tpcheck.diff(...)`` compares an engine with Hugging Face layer by layer (``tpcheck.pipeline.diff.diff``). These
three names are resolved on first use so that loading the pytest plugin does not import torch; tpcheck's own
code imports them from their modules."""

__all__ = ["diff", "DiffResult", "Tolerances"]


def __getattr__(name: str):
    if name == "diff":
        from tpcheck.pipeline.diff import diff
        return diff
    if name == "DiffResult":
        from tpcheck.result.table import DiffResult
        return DiffResult
    if name == "Tolerances":
        from tpcheck.judge.tolerances import Tolerances
        return Tolerances
    raise AttributeError(f"module 'tpcheck' has no attribute {name!r}")
