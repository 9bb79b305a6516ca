"""The report's effective-precision table (``tpcheck.measure.precision``): per point kind and pass, the significand
bits of an arithmetic that errs like the engine, beside the dtype's own.

Computed from the result's table (validated columns), never from a saved file's meta: a report of a hostile file
shows only numbers the reader checked. Point kinds come from that file too, so every cell is escaped."""
from __future__ import annotations

import pandas as pd

from tpcheck.measure.precision import MODES, NOTABLE_BITS, SIGNIFICAND_BITS, effective_precision
from tpcheck.result.report.shell import _g, e


def render_precision(table: pd.DataFrame, dtype: str) -> str:
    """The section: one row per point kind, per pass its bits, its median ``rel_err / ref_rel_err_hf`` and its
    rows; a kind at least ``NOTABLE_BITS`` below the dtype's is marked. Empty for a dtype tpcheck does not know."""
    if dtype not in SIGNIFICAND_BITS:
        return ""
    p, prec = SIGNIFICAND_BITS[dtype], effective_precision(table, dtype)
    head = (f'<h2 id="s-precision">Effective precision</h2><div class="card"><p class="mute">Significand bits of an '
            f'arithmetic that errs like the engine: {p} (the bits of {e(dtype)}) &minus; log<sub>2</sub> of the '
            f'median, over the kind&#39;s rows, of the engine&#39;s rel_err over Hugging Face&#39;s at {e(dtype)} on '
            f'one device. Marked: {NOTABLE_BITS} bit or more below {p}.</p>')
    if not prec:
        return head + f'<p>Not measured: no point where HF at {e(dtype)} has a finite, non-zero error.</p></div>'
    modes = [m for m in MODES if m in prec]
    kinds = list(dict.fromkeys(k for m in modes for k in prec[m]))
    th = "".join(f"<th>{e(m)}: bits</th><th>rel_err / HF</th><th>rows</th>" for m in modes)
    body = []
    for k in kinds:
        cells = []
        for m in modes:
            v = prec[m].get(k)
            if v is None:
                cells.append('<td class="num">-</td>' * 3)
                continue
            low = ' low' if v["bits"] <= p - NOTABLE_BITS else ''
            cells.append(f'<td class="num{low}">{v["bits"]:.1f}</td><td class="num">{e(_g(v["ratio"]))}</td>'
                         f'<td class="num">{int(v["rows"])}</td>')
        body.append(f"<tr><td>{e(k)}</td>{''.join(cells)}</tr>")
    return (head + f'<table class="precision" id="precision"><thead><tr><th>point kind</th>{th}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')
