"""The heatmaps of a report (inline SVG): point kinds x decoder layers at one step, and decode steps x layers
(the worst point of each cell). A cell's color says how far its relative error is from the threshold
(``excess`` = rel_err / threshold); its tooltip gives the numbers; the origin's cell is outlined. Every
user-provided string is escaped."""
from __future__ import annotations

import math

import pandas as pd

from tpcheck.capture.points import LAYER_POINTS
from tpcheck.result.report.shell import _f, _g, e

_ORIGIN_CELL = ' stroke="#000" stroke-width="2.5" class="origin-cell"'
_OUTSIDE = ("embed", "final_norm", "logits")  # the points outside the decoder layers: a row of their own
_OUTSIDE_W = 90                                # the width each takes in that row


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


def _cell(x, y, w, h, fill, tip, extra="") -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}><title>{e(tip)}</title></rect>'


def _tip(r) -> str:
    d = r._asdict() if hasattr(r, "_asdict") else r.to_dict()
    return (f"{d['point']} step {d['step']} {d['mode']}: rel_err {_g(d['rel_err'])}, HF {_g(d['ref_rel_err'])}, "
            f"threshold {_g(d['threshold'])} -> {_g(d['excess'])}x{'' if d['passed'] else ' FAIL'}")


def render_heat_points(sub: pd.DataFrame, num_layers: int, origin: dict | None, mode: str, step: int) -> str:
    """Point kinds (rows) x decoder layers (columns) for one (mode, step); embed/final_norm/logits below."""
    kinds = [k for k in LAYER_POINTS if (sub["kind"] == k).any()]
    cw = max(10.0, min(34.0, 960 / max(num_layers, 1)))
    ch, left, top = 15, 104, 18
    heads = [p for p in _OUTSIDE if (sub["point"] == p).any()]
    W = left + max(cw * num_layers, _OUTSIDE_W * len(heads)) + 10  # the bottom row fits, however few the layers
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
                             ("ORIGIN " if is_origin else "") + _tip(r), _ORIGIN_CELL if is_origin else ""))
    y = top + ch * len(kinds) + 8
    x = left
    for p in heads:
        r = by[p]
        is_origin = bool(origin and origin["point"] == p and origin["step"] == step and origin["mode"] == mode)
        out.append(f'<text x="{x + 2}" y="{y + ch + 11}">{e(p)}</text>')
        out.append(_cell(x, y, 60, ch - 1, _color(r.excess, r.passed), ("ORIGIN " if is_origin else "") + _tip(r),
                         _ORIGIN_CELL if is_origin else ""))
        x += _OUTSIDE_W
    out.append("</svg>")
    return "".join(out)


def render_heat_steps(sub: pd.DataFrame, num_layers: int, origin: dict | None, mode: str) -> str:
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
                             _ORIGIN_CELL if is_origin else ""))
    out.append("</svg>")
    return "".join(out)


def render_heat_legend() -> str:
    """The key to the heatmaps' colors, by ``_color``'s own rule: a pass (excess <= 1) green to yellow, a fail
    (excess > 1) from orange at just over 1x to dark red at 1e6x and beyond."""
    stops = [(1e-4, True, "1e-4x"), (1e-2, True, "0.01x"), (0.5, True, "0.5x"), (1.0, True, "1x (pass)"),
             (1.0, False, "&gt;1x (fail)"), (1e2, False, "100x"), (1e4, False, "1e4x"), (1e6, False, "&ge;1e6x")]
    parts = []
    for x, ok, label in stops:
        parts.append(f'<span><i class="sw" style="height:12px;background:{_color(x, ok)}"></i>{label}</span>')
    parts.append(f'<span><i class="sw" style="height:12px;background:{_color(math.nan, False)}"></i>nan</span>')
    parts.append('<span><i class="sw" style="height:12px;border:2.5px solid #000"></i>origin</span>')
    return f'<div class="legend mute">excess = rel_err / threshold: {"".join(parts)}</div>'
