"""Result: typed rows and ``DiffResult`` (``table``), strict JSON documents and their schema (``documents``,
``result.schema.json``), the HTML report (``report``)."""
from tpcheck.result.table import (COLUMNS, FLOAT_COLUMNS, DiffResult, ResultFormatError, Row, load_result,
                                  result_from_dict)

__all__ = ["COLUMNS", "FLOAT_COLUMNS", "DiffResult", "ResultFormatError", "Row", "load_result", "result_from_dict"]
