"""tpcheck: a differential correctness harness for tensor-parallel LLM inference.

``tpcheck.diff(...)`` compares an engine with Hugging Face layer by layer (see ``tpcheck.diff``). Imports are
lazy so that loading the pytest plugin does not import torch until a test uses it."""

__all__ = ["diff", "DiffResult", "Tolerances"]


def __getattr__(name: str):
    if name == "diff":
        from tpcheck.layer_diff import diff
        return diff
    if name in ("DiffResult", "Tolerances"):
        from tpcheck import result
        return getattr(result, name)
    raise AttributeError(f"module 'tpcheck' has no attribute {name!r}")
