"""Result: typed rows and ``DiffResult`` (``table``), strict JSON documents and their schema (``documents``,
``result.schema.json``), the HTML report (``report``), the columns' legend (``columns``). The names below are
resolved on first use, so that ``tpcheck.result.columns`` (read by ``--help``) imports no pandas or torch."""

__all__ = ["COLUMNS", "FLOAT_COLUMNS", "DiffResult", "ResultFormatError", "Row", "load_result", "result_from_dict"]


def __getattr__(name: str):
    if name in __all__:
        from tpcheck.result import table  # pandas and the measurements: on first use
        return getattr(table, name)
    raise AttributeError(f"module 'tpcheck.result' has no attribute {name!r}")
