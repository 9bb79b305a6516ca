"""Judge: the noise floor's bookkeeping (``noise_floor``), tolerances (``tolerances``), the verdict
(``verdict``: ``judge``), coverage (``coverage``).

``judge`` is resolved on first use: the command line's parser reads ``coverage.DEFAULT_REQUIRE`` without importing
the verdict (torch, pandas)."""

__all__ = ["judge"]


def __getattr__(name: str):
    if name == "judge":
        from tpcheck.judge.verdict import judge  # on first use: see the module docstring
        return judge
    raise AttributeError(f"module 'tpcheck.judge' has no attribute {name!r}")
