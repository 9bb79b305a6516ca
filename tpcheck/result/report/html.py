"""A diff result as one self-contained HTML file: opens offline, loads nothing.

Header (model, config, tp, dtype, decode steps, verdict, the command that reproduces the run), a chart of
error versus depth per mode and step (inline SVG, log scale: the engine, Hugging Face at the same dtype
(the noise floor) and the threshold, the origin of the divergence marked), heatmaps of points x layers and
of decode steps x layers (inline SVG), and the full table (rendered client-side from compact JSON:
sortable, filterable, paginated, failing rows highlighted).

Every user-provided string is escaped with ``html.escape``; the data is JSON inside a
``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc.; the script
builds the table with ``textContent`` only. A Content-Security-Policy meta tag forbids every fetch
(``default-src 'none'``) and allows only the one inline script, by hash.

This module is the entry point; the work is done in:

- ``tpcheck.result.report.page``: the single-result document (``render_html``, ``write_html``, the table's data);
- ``tpcheck.result.report.chart``: the error-versus-depth SVG chart;
- ``tpcheck.result.report.heatmap``: the point x layer and step x layer SVG heatmaps;
- ``tpcheck.result.report.sweep``: the sweep / index page (``render_sweep_html``);
- ``tpcheck.result.report.shell``: the shared document (escaping, CSP, number formats) and the stylesheet and
  script, ``tpcheck/result/report/static/report.css`` and ``report.js`` (package data, inlined)."""
from __future__ import annotations

from tpcheck.result.report.page import render_html, write_html
from tpcheck.result.report.sweep import render_sweep_html

__all__ = ["render_html", "write_html", "render_sweep_html"]
