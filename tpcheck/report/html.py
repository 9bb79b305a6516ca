"""A diff result as one self-contained HTML file: opens offline, loads nothing.

Header (model, config, tp, dtype, decode steps, verdict, the command that reproduces the run), a chart of
error versus depth per mode and step (inline SVG, log scale: the engine, Hugging Face at the same dtype
(the noise floor) and the threshold, the origin of the divergence marked), heatmaps of points x layers and
of decode steps x layers (inline SVG), and the full table (rendered client-side from compact JSON:
sortable, filterable, paginated, failing rows highlighted).

Every user-provided string is escaped with ``html.escape``; the data is JSON inside a
``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc.; the script
builds the table with ``textContent`` only. A Content-Security-Policy meta tag forbids every fetch
(``default-src 'none'``) and allows only the one inline script, by hash."""
from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import re
from html import escape
from pathlib import Path

import pandas as pd

from tpcheck.points import LAYER_POINTS
from tpcheck.result import DiffResult

_COLS = ["point", "layer", "step", "mode", "kind", "rel_err", "ref_rel_err", "ref_rel_err_hf", "ref_rel_err_tp", "ref_by",
         "threshold", "excess", "cosine",
         "max_abs", "max_abs_index", "mean_abs", "p99_abs", "ref_norm", "nan", "inf", "op_mismatch", "passed", "note"]
_FLOAT_COLS = ["rel_err", "ref_rel_err", "ref_rel_err_hf", "ref_rel_err_tp", "threshold", "excess", "cosine", "max_abs", "mean_abs", "p99_abs", "ref_norm",
               "op_mismatch"]
_MODES = ["propagated", "isolated"]


def e(x) -> str:
    return escape(str(x), quote=True)


# ---------------------------------------------------------------------------------------------- styles, script

_CSS = """
:root{--fail:#c62828;--failbg:#fde8e8;--pass:#2e7d32;--passbg:#e8f5e9;--eng:#1f5fbf;--ref:#6b7280;--thr:#d97706;
--grid:#e5e7eb;--ink:#111827;--mute:#6b7280}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:var(--ink);margin:0;
background:#f9fafb}
main{max-width:1200px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:22px;margin:4px 0 8px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid var(--grid);padding-bottom:4px}
.badge{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:700;letter-spacing:.5px;margin-right:8px}
.badge.pass{background:var(--pass)} .badge.fail{background:var(--fail)}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.meta dt{color:var(--mute)} dl.meta dd{margin:0;word-break:break-all;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px}
pre{background:#fff;border:1px solid var(--grid);border-radius:4px;padding:8px 10px;overflow:auto;max-height:14em;
font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;margin:4px 0}
pre.summary.fail{border-left:4px solid var(--fail)} pre.summary.pass{border-left:4px solid var(--pass)}
.card{background:#fff;border:1px solid var(--grid);border-radius:6px;padding:10px 12px;margin:8px 0}
.controls{display:flex;flex-wrap:wrap;gap:10px;align-items:center;margin:6px 0}
.controls label{color:var(--mute)} select,input,button{font:inherit;font-size:13px}
svg{display:block;max-width:100%;height:auto} svg text{font:11px system-ui,sans-serif;fill:#374151}
svg .origin-label{font-weight:700;fill:var(--fail)}
figure{margin:0} figcaption{color:var(--mute);font-size:12.5px;margin:2px 0 6px}
table.rows{border-collapse:collapse;width:100%;font:12px ui-monospace,Menlo,Consolas,monospace;background:#fff}
table.rows th{position:sticky;top:0;background:#f3f4f6;cursor:pointer;user-select:none;text-align:left;white-space:nowrap}
table.rows th,table.rows td{border:1px solid var(--grid);padding:2px 5px;white-space:nowrap}
table.rows td.num{text-align:right} table.rows tr.fail{background:var(--failbg)} table.rows tr.fail td.v{color:var(--fail);font-weight:700}
table.rows tr.origin{outline:2px solid var(--fail)} th.asc::after{content:" \\25B2"} th.desc::after{content:" \\25BC"}
.tablewrap{max-height:70vh;overflow:auto;border:1px solid var(--grid)}
.legend span{display:inline-block;margin-right:14px} .sw{display:inline-block;width:22px;height:3px;vertical-align:middle;margin-right:5px}
.mute{color:var(--mute)} a{color:#1d4ed8}
table.sweep{border-collapse:collapse;background:#fff} table.sweep th,table.sweep td{border:1px solid var(--grid);padding:4px 8px;text-align:left}
td.pass{background:var(--passbg);color:var(--pass);font-weight:700} td.fail{background:var(--failbg);color:var(--fail);font-weight:700}
td.skip{color:var(--mute)}
"""

_JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("tpcheck-data").textContent);
  var C = D.cols, ix = {};
  C.forEach(function (c, i) { ix[c] = i; });
  var RE = /^layers\.(\d+)\.(.+)$/;
  var VC = C.slice(3);  // value columns, in r.slice(3) order
  var FLOATS = VC.map(function (c) { return D.floats.indexOf(c) >= 0; });
  var rows = D.rows.map(function (r, n) {
    var p = D.points[r[0]], m = RE.exec(p);
    var v = r.slice(3).map(function (x, i) {  // non-finite numbers travel as "inf" / "-inf"
      return FLOATS[i] && typeof x === "string" ? (x === "inf" ? Infinity : (x === "-inf" ? -Infinity : NaN)) : x;
    });
    return {n: n, point: p, layer: m ? +m[1] : null, kind: m ? m[2] : p, step: r[1], mode: D.modes[r[2]], v: v};
  });
  var COLS = ["point", "layer", "step", "mode", "kind"].concat(VC);
  function val(row, c) {
    if (c in row && c !== "v") return row[c];
    var x = row.v[VC.indexOf(c)];
    return x;
  }
  function fmt(c, x) {
    if (x === null || x === undefined) return c === "layer" ? "-" : (c === "note" ? "" : "nan");
    if (c === "passed") return x ? "yes" : "NO";
    if (Array.isArray(x)) return "[" + x.join(", ") + "]";
    if (typeof x === "number") {
      if (!isFinite(x)) return x > 0 ? "inf" : "-inf";
      if (Number.isInteger(x) && ["step", "layer", "nan", "inf"].indexOf(c) >= 0) return String(x);
      var a = Math.abs(x);
      return x === 0 ? "0" : (a < 1e-3 || a >= 1e5 ? x.toExponential(3) : x.toPrecision(4));
    }
    return String(x);
  }
  function cmp(a, b) {
    var an = a === null || a === undefined || (typeof a === "number" && isNaN(a));
    var bn = b === null || b === undefined || (typeof b === "number" && isNaN(b));
    if (an || bn) return an === bn ? 0 : (an ? 1 : -1);
    if (Array.isArray(a)) { a = a.join(","); b = b.join(","); }
    return a < b ? -1 : (a > b ? 1 : 0);
  }

  // chart selector
  var sel = document.getElementById("chart-select");
  if (sel) sel.addEventListener("change", function () {
    document.querySelectorAll("figure.chart").forEach(function (f) { f.hidden = f.id !== sel.value; });
  });

  // table
  var thead = document.querySelector("#rows thead tr"), tbody = document.querySelector("#rows tbody");
  var fText = document.getElementById("f-text"), fMode = document.getElementById("f-mode"),
      fStep = document.getElementById("f-step"), fFail = document.getElementById("f-fail"),
      fSize = document.getElementById("f-size"), info = document.getElementById("f-info"),
      prev = document.getElementById("f-prev"), next = document.getElementById("f-next");
  var sortCol = null, sortDir = 1, page = 0, view = rows;
  var origin = D.origin;
  COLS.forEach(function (c) {
    var th = document.createElement("th");
    th.textContent = c;
    th.dataset.col = c;
    th.addEventListener("click", function () {
      if (sortCol === c) sortDir = -sortDir; else { sortCol = c; sortDir = c === "excess" || c === "rel_err" ? -1 : 1; }
      thead.querySelectorAll("th").forEach(function (h) { h.className = h.dataset.col === sortCol ? (sortDir > 0 ? "asc" : "desc") : ""; });
      update(true);
    });
    thead.appendChild(th);
  });
  function update(resetPage) {
    var q = fText.value.trim().toLowerCase(), m = fMode.value, s = fStep.value, onlyFail = fFail.checked;
    view = rows.filter(function (r) {
      if (m && r.mode !== m) return false;
      if (s !== "" && r.step !== +s) return false;
      if (onlyFail && val(r, "passed")) return false;
      if (q && r.point.toLowerCase().indexOf(q) < 0 && String(val(r, "note") || "").toLowerCase().indexOf(q) < 0) return false;
      return true;
    });
    if (sortCol) {
      view = view.slice().sort(function (a, b) { return sortDir * cmp(val(a, sortCol), val(b, sortCol)) || a.n - b.n; });
    }
    if (resetPage) page = 0;
    render();
  }
  function render() {
    var size = fSize.value === "all" ? view.length || 1 : +fSize.value;
    var pages = Math.max(1, Math.ceil(view.length / size));
    page = Math.min(page, pages - 1);
    var lo = page * size, hi = Math.min(view.length, lo + size);
    var frag = document.createDocumentFragment();
    for (var i = lo; i < hi; i++) {
      var r = view[i], tr = document.createElement("tr");
      if (!val(r, "passed")) tr.className = "fail";
      if (origin && r.point === origin.point && r.step === origin.step && r.mode === origin.mode) tr.className += " origin";
      COLS.forEach(function (c) {
        var td = document.createElement("td"), x = val(r, c);
        td.textContent = fmt(c, x);
        if (typeof x === "number" && c !== "layer" && c !== "step") td.className = "num";
        if (c === "rel_err" || c === "excess" || c === "passed") td.className += " v";
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
    var nf = view.filter(function (r) { return !val(r, "passed"); }).length;
    info.textContent = (view.length ? (lo + 1) + "\u2013" + hi : "0") + " of " + view.length + " rows (" + nf +
      " failing; " + rows.length + " in all), page " + (page + 1) + "/" + pages;
    prev.disabled = page === 0; next.disabled = page >= pages - 1;
  }
  [fText, fMode, fStep, fFail, fSize].forEach(function (el) {
    el.addEventListener(el === fText ? "input" : "change", function () { update(true); });
  });
  prev.addEventListener("click", function () { page--; render(); });
  next.addEventListener("click", function () { page++; render(); });
  var copy = document.getElementById("copy-cmd");
  if (copy) copy.addEventListener("click", function () {
    var t = document.getElementById("command").textContent;
    try {
      if (navigator.clipboard) navigator.clipboard.writeText(t).then(function () { copy.textContent = "copied"; },
        function () { copy.textContent = "select and copy"; });
    } catch (err) { copy.textContent = "select and copy"; }
  });
  update(true);
  document.body.setAttribute("data-rendered", "1");
})();
"""


def _page(title: str, body: str, script: str | None) -> str:
    csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
    if script is not None:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        csp += f"; script-src 'sha256-{digest}'"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            "<link rel=\"icon\" href=\"data:,\">\n"
            f"<title>{e(title)}</title>\n<style>{_CSS}</style></head>\n<body>\n<main>\n{body}\n</main>\n"
            + (f"<script>{script}</script>\n" if script is not None else "") + "</body></html>\n")


# ---------------------------------------------------------------------------------------------- numbers, colors

def _f(x) -> float:
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


def _mix(c1: tuple, c2: tuple, t: float) -> str:
    t = min(1.0, max(0.0, t))
    return "#%02x%02x%02x" % tuple(round(a + (b - a) * t) for a, b in zip(c1, c2))


def _color(excess: float, passed: bool) -> str:
    """Heat color: passing cells green (far below the threshold) to yellow (near it), failing cells orange to
    dark red with the log of how far over; NaN is purple."""
    x = _f(excess)
    if math.isnan(x):
        return "#6b21a8"
    if passed:
        t = (math.log10(max(x, 1e-4)) + 4) / 4  # 1e-4 .. 1
        return _mix((0xe6, 0xf5, 0xe9), (0x6f, 0xbf, 0x7f), t)
    t = math.log10(max(x, 1.0)) / 6 if math.isfinite(x) else 1.0  # 1 .. 1e6
    return _mix((0xf4, 0x9a, 0x52), (0x7f, 0x11, 0x11), t)


# ---------------------------------------------------------------------------------------------- chart

def _chart(sub: pd.DataFrame, title_id: str, origin: dict | None, mode: str, step: int, num_layers: int) -> str:
    """Error versus depth for one (mode, step): points in execution order on x, log10 error on y."""
    sub = sub.sort_values("order")
    n = len(sub)
    W, H, ml, mr, mt, mb = 1100, 340, 62, 16, 30, 46
    pw, ph = W - ml - mr, H - mt - mb
    rel, ref, thr = (sub[c].map(_f).tolist() for c in ("rel_err", "ref_rel_err", "threshold"))
    vals = [v for v in rel + ref + thr if math.isfinite(v) and v > 0]
    lo = math.floor(math.log10(min(vals))) if vals else -8
    hi = math.ceil(math.log10(max(vals))) if vals else 0
    lo, hi = max(lo, -20), min(max(hi, lo + 1), 20)
    if hi - lo < 2:
        lo -= 1

    def X(i):
        return ml + (pw * (i + 0.5) / max(n, 1))

    def Y(v):
        if not math.isfinite(v):
            return mt - 8 if (v > 0 or math.isnan(v)) else mt + ph
        if v <= 0:
            return mt + ph
        return mt + ph * (1 - (min(max(math.log10(v), lo), hi) - lo) / (hi - lo))

    out = [f'<svg class="chart-svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           f'aria-labelledby="{title_id}-t" data-mode="{e(mode)}" data-step="{step}">',
           f'<title id="{title_id}-t">relative error versus depth, {e(mode)}, step {step}</title>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fff" stroke="#d1d5db"/>']
    for d in range(lo, hi + 1):  # decades
        y = Y(10.0 ** d)
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef0f3"/>'
                   f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    points = sub["point"].tolist()
    layers = sub["layer"].tolist()
    every = max(1, math.ceil(num_layers / 32))
    seen = set()
    for i, (p, layer) in enumerate(zip(points, layers)):
        if layer is None or isinstance(layer, float) and math.isnan(layer):
            continue
        layer = int(layer)
        if layer in seen:
            continue
        seen.add(layer)
        x = X(i) - pw / max(n, 1) / 2
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{mt}" y2="{mt + ph}" stroke="#e5e7eb"/>')
        if layer % every == 0:
            out.append(f'<text x="{x + 3:.1f}" y="{mt + ph + 14}">L{layer}</text>')
    if "embed" in points:
        out.append(f'<text x="{ml}" y="{mt + ph + 28}" class="mute">&larr; embed</text>')
    if "logits" in points or "final_norm" in points:
        out.append(f'<text x="{ml + pw}" y="{mt + ph + 28}" text-anchor="end" class="mute">final_norm, logits &rarr;</text>')
    out.append(f'<text x="{ml + pw / 2}" y="{H - 2}" text-anchor="middle" class="mute">depth: hook points in '
               f'execution order (L = decoder layer)</text>')
    out.append(f'<text x="14" y="{mt + ph / 2}" transform="rotate(-90 14 {mt + ph / 2})" text-anchor="middle" '
               f'class="mute">relative L2 error vs fp64 (log)</text>')

    def line(vs, color, dash="", width=1.6):
        pts = " ".join(f"{X(i):.1f},{Y(v):.1f}" for i, v in enumerate(vs))
        return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}"'
                + (f' stroke-dasharray="{dash}"' if dash else "") + f' points="{pts}"/>')

    out.append(line(thr, "#d97706", "2 3", 1.2))
    out.append(line(ref, "#6b7280", "6 3", 1.6))
    out.append(line(rel, "#1f5fbf", "", 1.8))
    passed = sub["passed"].tolist()
    fails = [i for i, ok in enumerate(passed) if not ok]
    if fails:  # one path of round dots (a zero-length segment with a round cap): small even with 400 failures
        dots = "".join(f"M{X(i):.1f},{Y(rel[i]):.1f}h0" for i in fails)
        out.append(f'<path class="fail-dots" d="{dots}" stroke="#c62828" stroke-width="5.5" stroke-linecap="round" '
                   f'fill="none"><title>{len(fails)} failing point(s) at this step</title></path>')
    mark, label = None, None
    if origin and origin["mode"] == mode and origin["step"] == step and origin["point"] in points:
        mark, label = points.index(origin["point"]), "origin: "
    elif fails:
        mark, label = fails[0], "first failure here: "
    if mark is not None:
        x, y = X(mark), Y(rel[mark])
        strong = label == "origin: "
        color = "#c62828" if strong else "#b45309"
        dash = "" if strong else ' stroke-dasharray="4 3"'
        style = "" if strong else ' style="fill:#b45309"'
        text = f"{label}{points[mark]} ({_g(sub['excess'].iloc[mark])}x threshold)"
        anchor = "start" if x < ml + pw * 0.6 else "end"
        tx = x + 10 if anchor == "start" else x - 10
        ty = mt + ph - 12 if y < mt + ph / 2 else mt + 18  # the label where the curve is not
        tw = 6.6 * len(text) + 8
        bx = tx - 4 if anchor == "start" else tx - tw + 4
        out.append(f'<g class="{"origin" if strong else "first-failure"}" data-point="{e(points[mark])}">'
                   f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{mt}" y2="{mt + ph}" stroke="{color}" stroke-width="2"'
                   f'{dash}/>'
                   f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="none" stroke="{color}" stroke-width="2.5"/>'
                   f'<rect x="{bx:.1f}" y="{ty - 13}" width="{tw:.1f}" height="18" rx="3" fill="#fff" '
                   f'stroke="{color}" opacity="0.95"/>'
                   f'<text class="origin-label" x="{tx:.1f}" y="{ty}" text-anchor="{anchor}"'
                   f'{style}>{e(text)}</text></g>')
    # legend
    lx = ml + 6
    out.append(f'<g transform="translate({lx},{mt - 12})">'
               '<line x1="0" x2="22" y1="0" y2="0" stroke="#1f5fbf" stroke-width="2"/><text x="26" y="4">engine</text>'
               '<line x1="80" x2="102" y1="0" y2="0" stroke="#6b7280" stroke-width="2" stroke-dasharray="6 3"/>'
               '<text x="106" y="4">HF same dtype (noise floor)</text>'
               '<line x1="276" x2="298" y1="0" y2="0" stroke="#d97706" stroke-width="1.5" stroke-dasharray="2 3"/>'
               '<text x="302" y="4">threshold</text><circle cx="380" cy="0" r="3" fill="#c62828"/>'
               '<text x="387" y="4">failing point</text></g>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------- heatmaps

def _cell(x, y, w, h, fill, tip, extra="") -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}><title>{e(tip)}</title></rect>'


def _tip(r) -> str:
    d = r._asdict() if hasattr(r, "_asdict") else r.to_dict()
    return (f"{d['point']} step {d['step']} {d['mode']}: rel_err {_g(d['rel_err'])}, HF {_g(d['ref_rel_err'])}, "
            f"threshold {_g(d['threshold'])} -> {_g(d['excess'])}x{'' if d['passed'] else ' FAIL'}")


def _heat_points(sub: pd.DataFrame, num_layers: int, origin: dict | None, mode: str, step: int) -> str:
    """Point kinds (rows) x decoder layers (columns) for one (mode, step); embed/final_norm/logits below."""
    kinds = [k for k in LAYER_POINTS if (sub["kind"] == k).any()]
    cw = max(10.0, min(34.0, 960 / max(num_layers, 1)))
    ch, left, top = 15, 104, 18
    W = left + cw * num_layers + 10
    H = top + ch * (len(kinds) + 2) + 30
    by = {(r.point): r for r in sub.itertuples(index=False)}
    out = [f'<svg class="heatmap" viewBox="0 0 {W:.0f} {H}" width="{W:.0f}" height="{H}" role="img" '
           f'data-kind="points-layers" data-mode="{e(mode)}"><title>excess over threshold, point x layer, '
           f'{e(mode)}, step {step}</title>']
    every = max(1, math.ceil(num_layers / 32))
    for layer in range(0, num_layers, every):
        out.append(f'<text x="{left + cw * (layer + 0.5):.1f}" y="{top - 5}" text-anchor="middle">{layer}</text>')
    for j, k in enumerate(kinds):
        y = top + ch * j
        out.append(f'<text x="{left - 5}" y="{y + 11}" text-anchor="end">{e(k)}</text>')
        for layer in range(num_layers):
            r = by.get(f"layers.{layer}.{k}")
            if r is None:
                continue
            is_origin = bool(origin and origin["point"] == r.point and origin["step"] == step and origin["mode"] == mode)
            out.append(_cell(left + cw * layer, y, cw - 1, ch - 1, _color(r.excess, r.passed),
                             ("ORIGIN " if is_origin else "") + _tip(r),
                             ' stroke="#000" stroke-width="2.5" class="origin-cell"' if is_origin else ""))
    y = top + ch * len(kinds) + 8
    x = left
    for p in ("embed", "final_norm", "logits"):
        r = by.get(p)
        if r is None:
            continue
        is_origin = bool(origin and origin["point"] == p and origin["step"] == step and origin["mode"] == mode)
        out.append(f'<text x="{x + 2}" y="{y + ch + 11}">{e(p)}</text>')
        out.append(_cell(x, y, 60, ch - 1, _color(r.excess, r.passed), ("ORIGIN " if is_origin else "") + _tip(r),
                         ' stroke="#000" stroke-width="2.5" class="origin-cell"' if is_origin else ""))
        x += 90
    out.append("</svg>")
    return "".join(out)


def _heat_steps(sub: pd.DataFrame, num_layers: int, origin: dict | None, mode: str) -> str:
    """Decode steps (rows) x layers (columns, plus the embedding and the head): the worst point of each."""
    steps = sorted(sub["step"].unique().tolist())
    cols = ["emb", *range(num_layers), "head"]
    cw = max(10.0, min(34.0, 960 / max(len(cols), 1)))
    ch, left, top = 15, 70, 18
    W = left + cw * len(cols) + 10
    H = top + ch * len(steps) + 10
    col = [("emb" if p == "embed" else "head") if pd.isna(v) else int(v) for p, v in zip(sub["point"], sub["layer"])]
    t = sub.assign(col=pd.Series(col, index=sub.index, dtype=object))
    t = t.assign(ex=t["excess"].map(_f).fillna(math.inf), bad=~t["passed"])
    out = [f'<svg class="heatmap" viewBox="0 0 {W:.0f} {H}" width="{W:.0f}" height="{H}" role="img" '
           f'data-kind="steps-layers" data-mode="{e(mode)}"><title>worst excess per decode step and layer, '
           f'{e(mode)}</title>']
    every = max(1, math.ceil(num_layers / 32))
    for c, name in enumerate(cols):
        if isinstance(name, int) and name % every:
            continue
        out.append(f'<text x="{left + cw * (c + 0.5):.1f}" y="{top - 5}" text-anchor="middle">{e(name)}</text>')
    groups = {key: g for key, g in t.groupby(["step", "col"], sort=False)}
    for j, s in enumerate(steps):
        y = top + ch * j
        out.append(f'<text x="{left - 5}" y="{y + 11}" text-anchor="end">{"prefill" if s == 0 else f"decode {s}"}</text>')
        for c, name in enumerate(cols):
            g = groups.get((s, name))
            if g is None or g.empty:
                continue
            w = g.sort_values(["bad", "ex"], ascending=False).iloc[0]
            is_origin = bool(origin and origin["mode"] == mode and origin["step"] == s and (g["point"] == origin["point"]).any())
            out.append(_cell(left + cw * c, y, cw - 1, ch - 1, _color(w.excess, bool(g["passed"].all())),
                             ("ORIGIN in this cell; " if is_origin else "") + f"worst: {_tip(w)}",
                             ' stroke="#000" stroke-width="2.5" class="origin-cell"' if is_origin else ""))
    out.append("</svg>")
    return "".join(out)


def _heat_legend() -> str:
    stops = [(1e-4, True), (1e-2, True), (0.5, True), (1.0, True), (10.0, False), (1e3, False), (1e6, False)]
    parts = []
    for x, ok in stops:
        parts.append(f'<span><i class="sw" style="height:12px;background:{_color(x, ok)}"></i>'
                     f'{"&le;" if ok else "&gt;"}{_g(x, 2) if ok else _g(x, 2)}x{" (fail)" if not ok else ""}</span>')
    parts.append(f'<span><i class="sw" style="height:12px;background:{_color(math.nan, False)}"></i>nan</span>')
    parts.append('<span><i class="sw" style="height:12px;border:2.5px solid #000"></i>origin</span>')
    return f'<div class="legend mute">excess = rel_err / threshold: {"".join(parts)}</div>'


# ---------------------------------------------------------------------------------------------- data for the table

def _num(x):
    if x is None:
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"  # NaN and Infinity are not JSON; the script converts these
    return float(f"{x:.4g}")


def _dumps(obj) -> str:
    """Compact JSON safe inside ``<script>``: no ``<``, ``>`` or ``&`` characters survive."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _table_data(t: pd.DataFrame, origin: dict | None) -> dict:
    rank = {m: i for i, m in enumerate(_MODES)}
    t = t.assign(_m=t["mode"].map(lambda m: rank.get(m, len(rank)))).sort_values(["_m", "step", "order"], kind="stable")
    points = list(dict.fromkeys(t["point"].tolist()))
    pidx = {p: i for i, p in enumerate(points)}
    modes = _MODES + sorted(set(t["mode"]) - set(_MODES))
    midx = {m: i for i, m in enumerate(modes)}
    rows = []
    cols = ["point", "step", "mode"] + [c for c in _COLS if c not in ("point", "step", "mode", "layer", "kind")]
    for r in t.itertuples(index=False):
        d = r._asdict()
        row = [pidx[d["point"]], int(d["step"]), midx[d["mode"]]]
        for c in cols[3:]:
            v = d.get(c)
            if c in _FLOAT_COLS:
                row.append(_num(v))
            elif c == "max_abs_index":
                row.append([int(i) for i in v] if isinstance(v, (list, tuple)) else None)
            elif c in ("nan", "inf"):
                row.append(int(v) if v is not None and not pd.isna(v) else None)
            elif c == "passed":
                row.append(1 if bool(v) else 0)
            else:
                row.append("" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
        rows.append(row)
    o = None if origin is None else {"point": origin["point"], "step": int(origin["step"]), "mode": origin["mode"]}
    return {"cols": cols, "floats": _FLOAT_COLS, "points": points, "modes": modes, "rows": rows, "origin": o}


# ---------------------------------------------------------------------------------------------- the page

def _fmt_meta(v) -> str:
    if isinstance(v, (list, tuple)):
        if len(v) > 40:
            return ", ".join(map(str, v[:40])) + f", ... ({len(v)} in all)"
        return ", ".join(map(str, v)) if v else "-"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {x}" for k, x in v.items()) if v else "-"
    if v is None or v == "":
        return "-"
    return str(v)


def _model_name(meta: dict) -> str:
    m = str(meta.get("model", "?"))
    return m.rstrip("/").rsplit("/", 1)[-1] or m


def render_html(result: DiffResult, title: str | None = None) -> str:
    """The report of one diff as a self-contained HTML page."""
    meta, t = dict(result.meta), result.table
    if "order" not in t.columns:
        t = t.assign(order=range(len(t)))
    origin = result.first_divergence
    passed = result.passed
    verdict = "PASS" if passed else "FAIL"
    num_layers = int(meta.get("num_layers") or (int(t["layer"].max()) + 1 if t["layer"].notna().any() else 0))
    steps = sorted(int(s) for s in t["step"].unique())
    modes = [m for m in _MODES if (t["mode"] == m).any()] + sorted(set(t["mode"]) - set(_MODES))
    model = _model_name(meta)
    title = title or f"tpcheck {verdict}: {model} tp={meta.get('tp', '?')} {meta.get('dtype', '?')}"
    n_fail = int((~t["passed"]).sum())

    head = [f'<h1><span class="badge {verdict.lower()}" id="verdict">{verdict}</span>{e(model)}</h1>',
            f'<div class="mute">tpcheck diff report &middot; {len(t)} comparisons, {n_fail} failing &middot; '
            f'generated {e(_dt.datetime.now().strftime("%Y-%m-%d %H:%M"))}</div>']
    dl = [("model", meta.get("model")), ("tp", meta.get("tp")), ("dtype", meta.get("dtype")),
          ("decode steps", meta.get("decode_steps", max(steps) if steps else 0)),
          ("isolate", meta.get("isolate", False)), ("layers", num_layers)]
    known = {"model", "tp", "dtype", "decode_steps", "isolate", "num_layers", "command"}
    dl += [(k.replace("_", " "), v) for k, v in meta.items() if k not in known]
    head.append('<dl class="meta">' + "".join(f"<dt>{e(k)}</dt><dd>{e(_fmt_meta(v))}</dd>" for k, v in dl) + "</dl>")
    cmd = meta.get("command")
    head.append('<div><b>reproduce</b> <button id="copy-cmd" type="button">copy</button></div>'
                f'<pre id="command">{e(cmd) if cmd else "(the run did not record its command)"}</pre>')
    try:
        summary = result.summary()
    except Exception as err:  # a partial meta (e.g. a hand-made result) must not stop the report
        summary = f"{verdict} ({type(err).__name__} while summarising: {err})"
    head.append(f'<pre class="summary {verdict.lower()}" id="summary">{e(summary)}</pre>')

    nav = ('<div class="mute">sections: <a href="#s-chart">error vs depth</a> &middot; <a href="#s-heat">heatmaps</a>'
           ' &middot; <a href="#s-table">table</a></div>')

    # charts: one per (mode, step); the origin's shown first
    default = (origin["mode"], origin["step"]) if origin else (modes[0] if modes else "propagated", 0)
    charts, options = [], []
    for m in modes:
        for s in steps:
            sub = t[(t["mode"] == m) & (t["step"] == s)]
            if sub.empty:
                continue
            cid = f"chart-{m}-{s}"
            nf = int((~sub["passed"]).sum())
            label = f"{m}, {'prefill' if s == 0 else f'decode step {s}'}" + (f" ({nf} failing)" if nf else "")
            if origin and (m, s) == (origin["mode"], origin["step"]):
                label += " \u2190 origin"
            options.append(f'<option value="{e(cid)}"{" selected" if (m, s) == default else ""}>{e(label)}</option>')
            charts.append(f'<figure class="chart" id="{e(cid)}"{"" if (m, s) == default else " hidden"}>'
                          f'<figcaption>{e(label)}: relative L2 error of each point against the float64 golden run, '
                          f'the engine beside Hugging Face at {e(meta.get("dtype", "?"))}</figcaption>'
                          f'{_chart(sub, cid, origin, m, s, num_layers)}</figure>')
    chart_sec = (f'<h2 id="s-chart">Error versus depth</h2><div class="card"><div class="controls"><label for="chart-select">'
                 f'mode and step</label><select id="chart-select">{"".join(options)}</select></div>'
                 + "".join(charts) + "</div>")

    heat_step = origin["step"] if origin else 0
    heats = []
    for m in modes:
        sub = t[(t["mode"] == m) & (t["step"] == heat_step)]
        if not sub.empty and num_layers:
            heats.append(f'<figure><figcaption>{e(m)}: point &times; layer, '
                         f'{"prefill" if heat_step == 0 else f"decode step {heat_step}"}'
                         f'{" (the origin step)" if origin else ""}</figcaption>'
                         f'{_heat_points(sub, num_layers, origin, m, heat_step)}</figure>')
    if len(steps) > 1:
        for m in modes:
            sub = t[t["mode"] == m]
            heats.append(f'<figure><figcaption>{e(m)}: decode step &times; layer (worst point of each)</figcaption>'
                         f'{_heat_steps(sub, num_layers, origin, m)}</figure>')
    heat_sec = f'<h2 id="s-heat">Heatmaps</h2><div class="card">{_heat_legend()}{"".join(heats)}</div>'

    step_opts = "".join(f'<option value="{s}">{s}</option>' for s in steps)
    mode_opts = "".join(f'<option value="{e(m)}">{e(m)}</option>' for m in modes)
    table_sec = (
        '<h2 id="s-table">All comparisons</h2><div class="card"><div class="controls">'
        '<label for="f-text">filter</label><input id="f-text" type="search" placeholder="point or note, e.g. layers.3.attn" size="28">'
        f'<label for="f-mode">mode</label><select id="f-mode"><option value="">all</option>{mode_opts}</select>'
        f'<label for="f-step">step</label><select id="f-step"><option value="">all</option>{step_opts}</select>'
        f'<label><input id="f-fail" type="checkbox"{"" if passed else " checked"}> failing only</label>'
        '<label for="f-size">rows per page</label><select id="f-size"><option>100</option><option selected>250</option>'
        '<option>1000</option><option value="all">all</option></select>'
        '<button id="f-prev" type="button">&larr; prev</button><button id="f-next" type="button">next &rarr;</button>'
        '<span id="f-info" class="mute"></span></div>'
        '<div class="tablewrap"><table class="rows" id="rows"><thead><tr></tr></thead><tbody></tbody></table></div>'
        '<noscript>The table needs JavaScript; the same rows are in the --json / --csv export.</noscript></div>')

    data = _dumps(_table_data(t, origin))
    body = ("\n".join(head) + nav + chart_sec + heat_sec + table_sec
            + f'\n<script type="application/json" id="tpcheck-data">{data}</script>')
    return _page(title, body, _JS)


def write_html(result: DiffResult, path: str | Path, title: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(result, title), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- sweep

_SAFE_LINK = re.compile(r"^(?![a-zA-Z][a-zA-Z0-9+.-]*:)|^(https?|file):", re.I)


def _link(href) -> str | None:
    """Relative links and http(s)/file URLs only (no ``javascript:``)."""
    if not href:
        return None
    href = str(href)
    return href if _SAFE_LINK.match(href) else None


_CONFIG_KEYS = ("config", "preset", "model", "dtype", "decode_steps", "inject", "isolate", "block_size")


def _cell_text(v, limit: int = 300) -> str:
    text = json.dumps(v, default=str) if isinstance(v, dict) else _fmt_meta(v)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def render_sweep_html(rows: list[dict], links: list[str | None] | None = None, title: str = "tpcheck sweep",
                      col_key: str | None = "tp", row_keys: list[str] | None = None) -> str:
    """A summary page of a sweep: one row per configuration (any keys, e.g. ``tpcheck sweep``'s rows;
    ``passed`` is the verdict, ``skipped`` / ``error`` are shown as such), each linking to its own report
    (``links[i]``, relative to this page, or None). A matrix too: ``row_keys`` down (default: the
    configuration keys present of ``config, preset, model, dtype, decode_steps, inject, isolate,
    block_size``) and ``col_key`` across."""
    links = list(links or [None] * len(rows))
    if len(links) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(links)} links")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    ran = [r for r in rows if not r.get("skipped")]
    n_pass = sum(1 for r in ran if r.get("passed") is True)
    verdict = "PASS" if ran and n_pass == len(ran) else "FAIL"

    def verdict_cell(r, href):
        ok = r.get("passed")
        if r.get("skipped"):
            cls, label = "skip", "skip"
        elif ok is True:
            cls, label = "pass", "PASS"
        else:
            cls, label = "fail", "ERROR" if r.get("error") else "FAIL"
        tip = r.get("skipped") or r.get("error") or r.get("origin") or ""
        inner = f'<a href="{e(href)}">{e(label)}</a>' if href else e(label)
        return f'<td class="{cls}"{f" title={chr(34)}{e(tip)}{chr(34)}" if tip else ""}>{inner}</td>'

    parts = [f'<h1><span class="badge {verdict.lower()}" id="verdict">{verdict}</span>{e(title)}</h1>',
             f'<div class="mute">{n_pass} of {len(ran)} configurations pass'
             + (f", {len(rows) - len(ran)} skipped" if len(rows) > len(ran) else "")
             + f' &middot; generated {e(_dt.datetime.now().strftime("%Y-%m-%d %H:%M"))}</div>']
    down = list(row_keys) if row_keys is not None else [k for k in _CONFIG_KEYS if k in keys and k != col_key]
    if col_key and col_key in keys and down:
        across = list(dict.fromkeys(_cell_text(r.get(col_key)) for r in rows))
        lines = list(dict.fromkeys(tuple(_cell_text(r.get(k)) for k in down) for r in rows))
        cells = {}
        for r, href in zip(rows, links):
            cells.setdefault((tuple(_cell_text(r.get(k)) for k in down), _cell_text(r.get(col_key))), (r, _link(href)))
        t = ['<table class="sweep matrix" id="matrix"><thead><tr>' + "".join(f"<th>{e(k)}</th>" for k in down)
             + "".join(f"<th>{e(col_key)}={e(a)}</th>" for a in across) + "</tr></thead><tbody>"]
        for line in lines:
            t.append("<tr>" + "".join(f"<td>{e(v)}</td>" for v in line))
            for a in across:
                c = cells.get((line, a))
                t.append("<td></td>" if c is None else verdict_cell(*c))
            t.append("</tr>")
        t.append("</tbody></table>")
        parts.append('<h2>Matrix</h2><div class="card">' + "".join(t) + "</div>")
    t = ['<table class="sweep" id="configs"><thead><tr>' + "".join(f"<th>{e(k)}</th>" for k in keys)
         + "<th>report</th></tr></thead><tbody>"]
    for r, href in zip(rows, links):
        href = _link(href)
        t.append("<tr>" + "".join(verdict_cell(r, None) if k == "passed" else f"<td>{e(_cell_text(r.get(k)))}</td>"
                                  for k in keys)
                 + (f'<td><a href="{e(href)}">{e(href)}</a></td>' if href else "<td>-</td>") + "</tr>")
    t.append("</tbody></table>")
    parts.append('<h2>Configurations</h2><div class="card">' + "".join(t) + "</div>")
    return _page(title, "\n".join(parts), None)
