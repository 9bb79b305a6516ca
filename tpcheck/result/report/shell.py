"""The document every report page shares: escaping, the number formats, the stylesheet and the script (package
data, ``tpcheck/result/report/static/``) and the page shell with its Content-Security-Policy.

The stylesheet and the script are plain files so that they can be read, linted and edited as CSS and
JavaScript; they are read once with ``importlib.resources`` (so an installed wheel or a zip import finds them
too) and inlined: a report stays one file that loads nothing. The CSP allows inline styles and exactly the
one inline script, by its SHA-256, computed from the text that is inlined."""
from __future__ import annotations

import base64
import hashlib
import math
from functools import lru_cache
from html import escape
from importlib import resources

_STATIC = "static"  # under this package
_CLOSERS = {"report.css": "</style", "report.js": "</script"}


def e(x) -> str:
    """``x`` as text safe in HTML content and in a quoted attribute value."""
    return escape(str(x), quote=True)


@lru_cache(maxsize=None)
def static_text(name: str) -> str:
    """A file of ``tpcheck/result/report/static/``, as inlined: a newline, then the file's text.

    Refuses text that would end its ``<style>`` / ``<script>`` element early."""
    text = resources.files(__package__).joinpath(_STATIC).joinpath(name).read_text(encoding="utf-8")
    closer = _CLOSERS.get(name)
    if closer and closer in text.lower():
        raise ValueError(f"tpcheck/result/report/{_STATIC}/{name} contains {closer!r}: it cannot be inlined")
    return "\n" + text


def page(title: str, body: str, script: str | None) -> str:
    """The whole document: ``body`` inside ``<main>``, the stylesheet inline, and ``script`` (trusted text,
    inlined as is) allowed by its hash; without a script none may run."""
    csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
    if script is not None:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        csp += f"; script-src 'sha256-{digest}'"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<link rel=\"icon\" href=\"data:,\">\n"
            f"<title>{e(title)}</title>\n<style>{static_text('report.css')}</style></head>\n<body>\n<main>\n{body}\n</main>\n"
            + (f"<script>{script}</script>\n" if script is not None else "") + "</body></html>\n")


# ---------------------------------------------------------------------------------------------- numbers, text

def _f(x) -> float:
    """``x`` as a float; NaN when it is not a number."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return math.nan
    return x


def _g(x, digits: int = 3) -> str:
    x = _f(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def _fmt_meta(v) -> str:
    """A meta value (or a sweep cell) as one line of text: lists joined (at most 40 items), dicts as
    ``key: value; ...``, nothing as ``-``."""
    if isinstance(v, (list, tuple)):
        if len(v) > 40:
            return ", ".join(map(str, v[:40])) + f", ... ({len(v)} in all)"
        return ", ".join(map(str, v)) if v else "-"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {x}" for k, x in v.items()) if v else "-"
    if v is None or v == "":
        return "-"
    return str(v)
