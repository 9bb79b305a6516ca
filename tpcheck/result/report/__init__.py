"""Reports of a diff: a self-contained HTML file (``tpcheck.result.report.html``). Saved results are read back by
``tpcheck.result.load_result`` (re-exported here)."""
from __future__ import annotations

from tpcheck.result.table import ResultFormatError, load_result, result_from_dict  # noqa: F401 - the public names


def __getattr__(name):  # lazy: the HTML module is only imported when a report is written
    if name in ("render_html", "write_html", "render_sweep_html"):
        from tpcheck.result.report import html  # only when a report is written (above)
        return getattr(html, name)
    raise AttributeError(name)


__all__ = ["ResultFormatError", "load_result", "result_from_dict", "render_html", "write_html", "render_sweep_html"]
