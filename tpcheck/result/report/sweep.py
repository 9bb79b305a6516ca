"""The summary page of a sweep (``tpcheck report A.json B.json -o DIR/``'s ``index.html``, ``tpcheck sweep``):
the verdict, a matrix of configurations (rows) x one key (columns, e.g. tp), and one row per configuration,
each linking to its own report. No script; only relative or http(s)/file links; every user-provided string
is escaped."""
from __future__ import annotations

import datetime as _dt
import json
import re

from tpcheck.result.report.shell import _fmt_meta, e, page

_SAFE_LINK = re.compile(r"^(?![a-zA-Z][a-zA-Z0-9+.-]*:)|^(https?|file):", re.I)


def _link(href) -> str | None:
    """Relative links and http(s)/file URLs only (no ``javascript:``)."""
    if not href:
        return None
    href = str(href)
    return href if _SAFE_LINK.match(href) else None


_CONFIG_KEYS = ("config", "preset", "model", "dtype", "decode_steps", "inject", "isolate", "block_size")


def _cell_text(v, limit: int = 300) -> str:
    """A cell as one line of text (dicts as JSON), at most ``limit`` characters and a note of the rest."""
    text = json.dumps(v, default=str) if isinstance(v, dict) else _fmt_meta(v)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _verdict_cell(r: dict, href: str | None) -> str:
    """PASS / FAIL / ERROR / skip, linked to the report when there is one; why, as its tooltip."""
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


def _matrix(rows: list[dict], links: list, down: list[str], col_key: str) -> str:
    """The ``down`` keys' values as rows, ``col_key``'s as columns, each cell the verdict of the first
    configuration with those values."""
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
            t.append("<td></td>" if c is None else _verdict_cell(*c))
        t.append("</tr>")
    t.append("</tbody></table>")
    return '<h2>Matrix</h2><div class="card">' + "".join(t) + "</div>"


def _configs(rows: list[dict], links: list, keys: list[str]) -> str:
    """One row per configuration: every key, the verdict under ``passed``, and the link to its report."""
    t = ['<table class="sweep" id="configs"><thead><tr>' + "".join(f"<th>{e(k)}</th>" for k in keys)
         + "<th>report</th></tr></thead><tbody>"]
    for r, href in zip(rows, links):
        href = _link(href)
        t.append("<tr>" + "".join(_verdict_cell(r, None) if k == "passed" else f"<td>{e(_cell_text(r.get(k)))}</td>"
                                  for k in keys)
                 + (f'<td><a href="{e(href)}">{e(href)}</a></td>' if href else "<td>-</td>") + "</tr>")
    t.append("</tbody></table>")
    return '<h2>Configurations</h2><div class="card">' + "".join(t) + "</div>"


SWEEP_KEYS = ("config", "tp", "pp", "dtype", "decode_steps", "examples", "passed", "skipped", "origin", "worst_point",
              "worst_step", "excess", "error", "repro")


def sweep_index_rows(rows: list[dict]) -> list[dict]:
    """``tpcheck sweep``'s rows (its ``--json`` document's ``rows``) as the summary page shows them: the
    configuration, verdict, origin, worst point and the repro command (not the drawn case's whole dict)."""
    return [{k: r[k] for k in SWEEP_KEYS if k in r and (k != "skipped" or r[k])} for r in rows]


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
    parts = [f'<h1><span class="badge {verdict.lower()}" id="verdict">{verdict}</span>{e(title)}</h1>',
             f'<div class="mute">{n_pass} of {len(ran)} configurations pass'
             + (f", {len(rows) - len(ran)} skipped" if len(rows) > len(ran) else "")
             + f' &middot; generated {e(_dt.datetime.now().strftime("%Y-%m-%d %H:%M"))}</div>']
    down = list(row_keys) if row_keys is not None else [k for k in _CONFIG_KEYS if k in keys and k != col_key]
    if col_key and col_key in keys and down:
        parts.append(_matrix(rows, links, down, col_key))
    parts.append(_configs(rows, links, keys))
    return page(title, "\n".join(parts), None)
