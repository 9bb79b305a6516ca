"""What ``tpcheck --version`` and the parser's construction need without importing torch: modules loaded on first
use, and the version from the package metadata."""
from __future__ import annotations

import importlib


class Lazy:
    """A module imported on its first attribute (``Lazy("tpcheck.options").DiffOptions``)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


def version() -> str:
    """``tpcheck X.Y.Z`` from the installed metadata (importing nothing of tpcheck's)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return f"tpcheck {dist_version('tpcheck')}"
    except PackageNotFoundError:
        return "tpcheck unknown (not installed)"
