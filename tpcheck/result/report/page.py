"""The report of one diff result as one self-contained HTML page: opens offline, loads nothing.

Header (model, config, tp, dtype, decode steps, verdict, the command that reproduces the run), a chart of
error versus depth per mode and step (``tpcheck.result.report.chart``), heatmaps of points x layers and of decode
steps x layers (``tpcheck.result.report.heatmap``), and the full table: rendered client-side by
``static/report.js`` from compact JSON (sortable, filterable, paginated, failing rows highlighted).

Every user-provided string is escaped with ``html.escape``; the data is JSON inside a
``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc.; the script
builds the table with ``textContent`` only."""
from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path

import pandas as pd

from tpcheck.result.documents import write_text_atomic
from tpcheck.result.columns import describe
from tpcheck.result.report.chart import render_chart
from tpcheck.result.report.heatmap import render_heat_legend, render_heat_points, render_heat_steps
from tpcheck.result.report.precision import render_precision
from tpcheck.result.report.shell import _fmt_meta, e, page, static_text
from tpcheck.result.table import COLUMNS, FLOAT_COLUMNS, DiffResult

_COLS = [c for c in COLUMNS if c != "order"]
_FLOAT_COLS = FLOAT_COLUMNS
_MODES = ["propagated", "isolated"]


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
    # a value column that holds one value in every row (a pass that does not measure it: all null) travels once
    same = [i for i in range(3, len(cols)) if rows and all(r[i] == rows[0][i] for r in rows)]
    const = {cols[i]: rows[0][i] for i in same}
    rows = [[x for i, x in enumerate(r) if i not in const_at] for r in rows] if (const_at := set(same)) else rows
    return {"cols": cols, "packed": [c for c in cols if c not in const], "const": const, "floats": _FLOAT_COLS,
            "points": points, "modes": modes, "rows": rows, "origin": o, "legend": {c: describe(c) for c in cols}}



# ---------------------------------------------------------------------------------------------- the page

def _model_name(meta: dict) -> str:
    m = str(meta.get("model", "?"))
    return m.rstrip("/").rsplit("/", 1)[-1] or m


def _header(result: DiffResult, t: pd.DataFrame, verdict: str, model: str, steps: list, num_layers: int) -> str:
    """The verdict and model, the run's settings (every meta key), the command to reproduce, the summary."""
    meta = dict(result.meta)
    n_fail = int((~t["passed"]).sum())
    head = [f'<h1><span class="badge {verdict.lower()}" id="verdict">{verdict}</span>{e(model)}</h1>',
            f'<div class="mute">tpcheck diff report &middot; {len(t)} comparisons, {n_fail} failing &middot; '
            f'generated {e(_dt.datetime.now().strftime("%Y-%m-%d %H:%M"))}</div>']
    dl = [("model", meta.get("model")), ("tp", meta.get("tp")), ("dtype", meta.get("dtype")),
          ("decode steps", meta.get("decode_steps", max(steps) if steps else 0)),
          ("isolate", meta.get("isolate", False)), ("layers", num_layers)]
    known = {"model", "tp", "dtype", "decode_steps", "isolate", "num_layers", "command", "effective_precision"}
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
    return "\n".join(head)


_NAV = ('<div class="mute">sections: <a href="#s-chart">error vs depth</a> &middot; <a href="#s-heat">heatmaps</a>'
        ' &middot; <a href="#s-precision">effective precision</a> &middot; <a href="#s-table">table</a></div>')


def _chart_section(t: pd.DataFrame, dtype, modes: list, steps: list, origin: dict | None, num_layers: int) -> str:
    """One chart per (mode, step), a selector to switch; the origin's (else the first) shown first."""
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
                          f'the engine beside Hugging Face at {e(dtype)}</figcaption>'
                          f'{render_chart(sub, cid, origin, m, s, num_layers)}</figure>')
    return (f'<h2 id="s-chart">Error versus depth</h2><div class="card"><div class="controls"><label for="chart-select">'
            f'mode and step</label><select id="chart-select">{"".join(options)}</select></div>'
            + "".join(charts) + "</div>")


def _heat_section(t: pd.DataFrame, modes: list, steps: list, origin: dict | None, num_layers: int) -> str:
    """Points x layers at the origin's step (else prefill) per mode; steps x layers per mode when decoding."""
    heat_step = origin["step"] if origin else 0
    heats = []
    for m in modes:
        sub = t[(t["mode"] == m) & (t["step"] == heat_step)]
        if not sub.empty and num_layers:
            heats.append(f'<figure><figcaption>{e(m)}: point &times; layer, '
                         f'{"prefill" if heat_step == 0 else f"decode step {heat_step}"}'
                         f'{" (the origin step)" if origin else ""}</figcaption>'
                         f'{render_heat_points(sub, num_layers, origin, m, heat_step)}</figure>')
    if len(steps) > 1:
        for m in modes:
            sub = t[t["mode"] == m]
            heats.append(f'<figure><figcaption>{e(m)}: decode step &times; layer (worst point of each)</figcaption>'
                         f'{render_heat_steps(sub, num_layers, origin, m)}</figure>')
    return f'<h2 id="s-heat">Heatmaps</h2><div class="card">{render_heat_legend()}{"".join(heats)}</div>'


def _table_section(modes: list, steps: list, passed: bool) -> str:
    """The table's controls and an empty table: ``report.js`` fills it from the data block."""
    step_opts = "".join(f'<option value="{s}">{s}</option>' for s in steps)
    mode_opts = "".join(f'<option value="{e(m)}">{e(m)}</option>' for m in modes)
    return (
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
        '<noscript>The table needs JavaScript; the same rows are in the --json / --csv export.</noscript>'
        f'{_legend()}</div>')


def _legend() -> str:
    """The columns explained (``tpcheck.result.columns``): each header's tooltip says the same."""
    items = "".join(f"<dt>{e(c)}</dt><dd>{e(describe(c))}</dd>" for c in _COLS)
    return f'<details class="legend" id="legend"><summary>the columns</summary><dl class="meta">{items}</dl></details>'


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
    body = (_header(result, t, verdict, model, steps, num_layers) + _NAV
            + _chart_section(t, meta.get("dtype", "?"), modes, steps, origin, num_layers)
            + _heat_section(t, modes, steps, origin, num_layers)
            + render_precision(t, str(meta.get("dtype", "?")))
            + _table_section(modes, steps, passed)
            + f'\n<script type="application/json" id="tpcheck-data">{_dumps(_table_data(t, origin))}</script>')
    return page(title, body, static_text("report.js"))


def write_html(result: DiffResult, path: str | Path, title: str | None = None) -> Path:
    """Write ``render_html(result, title)`` to ``path`` (UTF-8), making its directory; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_html(result, title))  # renamed into place: never half a report
    return path
