"""The error-versus-depth chart of a report: one inline SVG per (mode, step).

The hook points in execution order run along x; y is the relative L2 error against the float64 golden run,
log scale, for the engine, Hugging Face at the same dtype (the noise floor) and the threshold. Failing
points are dotted; the origin of the divergence (or, at a step without it, the first failure) is marked and
labelled. Every user-provided string is escaped."""
from __future__ import annotations

import math

import pandas as pd

from tpcheck.result.report.shell import _f, _g, e

# the drawing: width, height, margins left / right / top / bottom, and the plot inside them
W, H, ML, MR, MT, MB = 1100, 340, 62, 16, 30, 46
PW, PH = W - ML - MR, H - MT - MB

ENGINE, REFERENCE, THRESHOLD, FAIL = "#1f5fbf", "#6b7280", "#d97706", "#c62828"

_LEGEND = (f'<g transform="translate({ML + 6},{MT - 12})">'
           f'<line x1="0" x2="22" y1="0" y2="0" stroke="{ENGINE}" stroke-width="2"/><text x="26" y="4">engine</text>'
           f'<line x1="80" x2="102" y1="0" y2="0" stroke="{REFERENCE}" stroke-width="2" stroke-dasharray="6 3"/>'
           '<text x="106" y="4">HF same dtype (noise floor)</text>'
           f'<line x1="276" x2="298" y1="0" y2="0" stroke="{THRESHOLD}" stroke-width="1.5" stroke-dasharray="2 3"/>'
           f'<text x="302" y="4">threshold</text><circle cx="380" cy="0" r="3" fill="{FAIL}"/>'
           '<text x="387" y="4">failing point</text></g>')


class _Axes:
    """x: the i-th of ``n`` points, centred in its slot; y: log10 of a value, clamped to whole decades
    ``lo .. hi`` that hold every finite positive value (at least two); non-finite values above the plot (NaN,
    +inf) or on its floor (-inf), zero and negatives on the floor."""

    def __init__(self, n: int, values: list[float]):
        self.n = n
        vals = [v for v in values if math.isfinite(v) and v > 0]
        lo = math.floor(math.log10(min(vals))) if vals else -8
        hi = math.ceil(math.log10(max(vals))) if vals else 0
        lo, hi = max(lo, -20), min(max(hi, lo + 1), 20)
        if hi - lo < 2:
            lo -= 1
        self.lo, self.hi = lo, hi

    def x(self, i) -> float:
        return ML + (PW * (i + 0.5) / max(self.n, 1))

    def y(self, v) -> float:
        if not math.isfinite(v):
            return MT - 8 if (v > 0 or math.isnan(v)) else MT + PH
        if v <= 0:
            return MT + PH
        return MT + PH * (1 - (min(max(math.log10(v), self.lo), self.hi) - self.lo) / (self.hi - self.lo))


def _decades(ax: _Axes) -> list[str]:
    out = []
    for d in range(ax.lo, ax.hi + 1):
        y = ax.y(10.0 ** d)
        out.append(f'<line x1="{ML}" x2="{ML + PW}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef0f3"/>'
                   f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    return out


def _layer_ticks(ax: _Axes, points: list, layers: list, num_layers: int) -> list[str]:
    """A rule where each decoder layer starts, labelled ``L<n>`` (every layer up to 32 of them, else spaced)."""
    out = []
    every = max(1, math.ceil(num_layers / 32))
    seen = set()
    for i, (_p, layer) in enumerate(zip(points, layers)):
        if layer is None or isinstance(layer, float) and math.isnan(layer):
            continue
        layer = int(layer)
        if layer in seen:
            continue
        seen.add(layer)
        x = ax.x(i) - PW / max(ax.n, 1) / 2
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{MT + PH}" stroke="#e5e7eb"/>')
        if layer % every == 0:
            out.append(f'<text x="{x + 3:.1f}" y="{MT + PH + 14}">L{layer}</text>')
    return out


def _axis_titles(points: list) -> list[str]:
    out = []
    if "embed" in points:
        out.append(f'<text x="{ML}" y="{MT + PH + 28}" class="mute">&larr; embed</text>')
    if "logits" in points or "final_norm" in points:
        out.append(f'<text x="{ML + PW}" y="{MT + PH + 28}" text-anchor="end" class="mute">final_norm, logits &rarr;</text>')
    out.append(f'<text x="{ML + PW / 2}" y="{H - 2}" text-anchor="middle" class="mute">depth: hook points in '
               f'execution order (L = decoder layer)</text>')
    out.append(f'<text x="14" y="{MT + PH / 2}" transform="rotate(-90 14 {MT + PH / 2})" text-anchor="middle" '
               f'class="mute">relative L2 error vs fp64 (log)</text>')
    return out


def _polyline(ax: _Axes, vs: list[float], color: str, dash: str = "", width: float = 1.6) -> str:
    pts = " ".join(f"{ax.x(i):.1f},{ax.y(v):.1f}" for i, v in enumerate(vs))
    return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}"'
            + (f' stroke-dasharray="{dash}"' if dash else "") + f' points="{pts}"/>')


def _fail_dots(ax: _Axes, rel: list[float], fails: list[int]) -> list[str]:
    """One path of round dots (a zero-length segment with a round cap): small even with 400 failures."""
    if not fails:
        return []
    dots = "".join(f"M{ax.x(i):.1f},{ax.y(rel[i]):.1f}h0" for i in fails)
    return [f'<path class="fail-dots" d="{dots}" stroke="{FAIL}" stroke-width="5.5" stroke-linecap="round" '
            f'fill="none"><title>{len(fails)} failing point(s) at this step</title></path>']


def _mark(ax: _Axes, at: int, strong: bool, text: str, point: str, rel: float) -> str:
    """A rule, a ring and a boxed label at point ``at``: solid red for the origin, dashed amber for the
    first failure at a step without it. The label goes to the half of the plot the curve is not in."""
    x, y = ax.x(at), ax.y(rel)
    color = FAIL if strong else "#b45309"
    dash = "" if strong else ' stroke-dasharray="4 3"'
    style = "" if strong else ' style="fill:#b45309"'
    anchor = "start" if x < ML + PW * 0.6 else "end"
    tx = x + 10 if anchor == "start" else x - 10
    ty = MT + PH - 12 if y < MT + PH / 2 else MT + 18
    tw = 6.6 * len(text) + 8
    bx = tx - 4 if anchor == "start" else tx - tw + 4
    return (f'<g class="{"origin" if strong else "first-failure"}" data-point="{e(point)}">'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{MT + PH}" stroke="{color}" stroke-width="2"'
            f'{dash}/>'
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="none" stroke="{color}" stroke-width="2.5"/>'
            f'<rect x="{bx:.1f}" y="{ty - 13}" width="{tw:.1f}" height="18" rx="3" fill="#fff" '
            f'stroke="{color}" opacity="0.95"/>'
            f'<text class="origin-label" x="{tx:.1f}" y="{ty}" text-anchor="{anchor}"'
            f'{style}>{e(text)}</text></g>')


def render_chart(sub: pd.DataFrame, title_id: str, origin: dict | None, mode: str, step: int, num_layers: int) -> str:
    """Error versus depth for one (mode, step): points in execution order on x, log10 error on y.

    ``sub``: the table's rows of that mode and step (``order`` gives the execution order); ``title_id``: a
    unique id for the SVG's title; ``origin``: the result's first divergence (a dict with point, step,
    mode) or None."""
    sub = sub.sort_values("order")
    rel, ref, thr = (sub[c].map(_f).tolist() for c in ("rel_err", "ref_rel_err", "threshold"))
    ax = _Axes(len(sub), rel + ref + thr)
    points = sub["point"].tolist()
    out = [f'<svg class="chart-svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
           f'aria-labelledby="{title_id}-t" data-mode="{e(mode)}" data-step="{step}">',
           f'<title id="{title_id}-t">relative error versus depth, {e(mode)}, step {step}</title>',
           f'<rect x="{ML}" y="{MT}" width="{PW}" height="{PH}" fill="#fff" stroke="#d1d5db"/>']
    out += _decades(ax)
    out += _layer_ticks(ax, points, sub["layer"].tolist(), num_layers)
    out += _axis_titles(points)
    out.append(_polyline(ax, thr, THRESHOLD, "2 3", 1.2))
    out.append(_polyline(ax, ref, REFERENCE, "6 3", 1.6))
    out.append(_polyline(ax, rel, ENGINE, "", 1.8))
    fails = [i for i, ok in enumerate(sub["passed"].tolist()) if not ok]
    out += _fail_dots(ax, rel, fails)
    mark, label = None, None
    if origin and origin["mode"] == mode and origin["step"] == step and origin["point"] in points:
        mark, label = points.index(origin["point"]), "origin: "
    elif fails:
        mark, label = fails[0], "first failure here: "
    if mark is not None:
        text = f"{label}{points[mark]} ({_g(sub['excess'].iloc[mark])}x threshold)"
        out.append(_mark(ax, mark, label == "origin: ", text, points[mark], rel[mark]))
    out.append(_LEGEND)
    out.append("</svg>")
    return "".join(out)
