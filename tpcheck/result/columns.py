"""What each column of a diff's table means, in one line each: the one legend ``tpcheck diff --help`` and
``tpcheck compare --help`` print (``help_epilog``), the HTML report shows (a legend under its table, each header's
tooltip) and ``docs/reference/summary.md`` holds (``markdown``, with the summary's hints). Every column of ``tpcheck.result.table.Row`` but
``order`` (execution order, never saved or shown) has an entry, in the table's order; the terminal's per-layer
table adds ``origin`` (``SHOWN``). The JSON schema (``result.schema.json``) keeps the contract of each field;
this is what a person reads beside the numbers. Imports nothing heavy: ``--help`` stays fast."""
from __future__ import annotations

import textwrap

from tpcheck.result.hints import BY_CAUSE, HINTS, WHY

COLUMN_LEGEND: dict[str, str] = {
    "point": "the canonical point: embed, layers.N.<kind>, final_norm, logits",
    "layer": "the decoder layer (- outside the layers)",
    "step": "0: the prefill; n: decode step n",
    "mode": "propagated: the engine's own run; isolated: the local pass, each layer fed the golden's input",
    "kind": "the point's kind (attn.q, mlp.out, logits, ...): the key of per-kind tolerances",
    "rel_err": "the engine's error: ||engine - golden|| / ||golden||, against the float64 golden",
    "ref_rel_err": "the noise floor: the reference error the threshold is built from (its worst row so far)",
    "ref_rel_err_hf": "HF at the run's dtype on one device: its whole-tensor error",
    "ref_rel_err_tp": "HF at the run's dtype rounding as the engine's all-reduces do (- at tp 1)",
    "ref_by": "which reference and step set ref_rel_err: hf@0 (HF at the dtype, step 0), hf-tp@2 (TP rounding, "
              "step 2)",
    "threshold": "the bound of rel_err: k x ref_rel_err + a floor (per-kind tolerances, or rel_max), plus rel_floor",
    "excess": "how far over: the largest of rel_err / threshold, |gain| / gain_threshold, max_abs / abs_max "
              "(> 1 fails)",
    "gain": "a systematic relative error (local pass): median of (engine - golden) / golden; +0.01: 1% too large",
    "gain_se": "the gain's standard error, from the engine's own spread",
    "gain_n": "how many elements the gain is the median of",
    "gain_se_cols": "the gain's standard error from column groups (an error a column shares down its rows)",
    "gain_groups": "the column groups behind gain_se_cols",
    "ref_gain": "the largest |gain| of a reference at this point so far",
    "gain_floor": "the smallest gain threshold: a per-row scale a correct kernel may round otherwise",
    "gain_threshold": "the bound of |gain| (- not judged: the propagated pass, or not measured)",
    "rel_floor": "the ulp floor: what one ulp of the golden's largest element adds to rel_err (in the threshold)",
    "cosine": "the cosine similarity of the engine's tensor and the golden's",
    "max_abs": "the largest |engine - golden|",
    "max_abs_index": "where max_abs is: prompt, token, feature",
    "mean_abs": "the mean |engine - golden|",
    "p99_abs": "the 99th percentile of |engine - golden|",
    "ref_norm": "||golden||",
    "nan": "NaN elements in the engine's tensor",
    "inf": "Inf elements in the engine's tensor",
    "op_mismatch": "--exact-ops: the fraction of elements that differ from HF's op on the same input",
    "rank_spread": "replicated tensors: how far two ranks' copies differ, relative (- no replicas)",
    "rank_spread_by": "the two ranks of rank_spread, e.g. 0 vs 1",
    "replica_rel_err": "the largest rel_err of another rank's copy against the golden (judged as rel_err is)",
    "replica_own_err": "the largest own_err of another rank's copy",
    "route_flips": "MoE: tokens whose chosen experts differ from the golden's",
    "near_ties": "MoE: of route_flips, those on a near tie of the router's scores (legitimate)",
    "rows_excluded": "MoE: rows left out because their token's route legitimately differs",
    "own_err": "the point's op redone in float64 on the engine's own inputs: the error the op itself added",
    "own_gain": "the gain the op itself added (against that recomputation)",
    "inherited": "passed as inherited: over the floor only through its inputs, its own op within it",
    "by_rounding": "the gain within its bound only by the declared rounding's allowance (a truncating engine)",
    "passed": "the row's verdict: within every bound, and no note",
    "note": "a structural finding (shapes, ranks, exact ops): a note always fails the row",
    "stage": "--pp: the pipeline stage whose ranks reported the point",
}
#: columns the terminal's tables add to the table's own
SHOWN: dict[str, str] = {"origin": "<- origin marks the run's first divergence (the summary's origin line)"}
#: the columns of the terminal's per-layer tables (``DiffResult.layer_table``), in their order
LAYER_TABLE = ("step", "layer", "point", "rel_err", "ref_rel_err", "ref_by", "excess", "gain", "max_abs", "passed",
               "note", "origin")


def describe(column: str) -> str:
    """The legend of ``column`` (a table's or a shown one); a column without one is a KeyError."""
    return COLUMN_LEGEND[column] if column in COLUMN_LEGEND else SHOWN[column]


def legend_lines(columns, width: int = 118, indent: int = 2) -> list[str]:
    """``columns``' legend as aligned plain-text lines of at most ``width`` characters (a long one wrapped under
    its text)."""
    name_w = max(len(c) for c in columns) + 2
    out = []
    for c in columns:
        out += textwrap.wrap(describe(c), width, initial_indent=" " * indent + c.ljust(name_w),
                             subsequent_indent=" " * (indent + name_w), break_long_words=False,
                             break_on_hyphens=False)
    return out


def help_epilog() -> str:
    """The columns' legend for ``--help``: the per-layer tables' columns, then the others (``--all-rows``,
    ``--json``, ``--csv``)."""
    rest = [c for c in COLUMN_LEGEND if c not in LAYER_TABLE]
    return "\n".join(["the tables' columns (docs/reference/summary.md):", *legend_lines(LAYER_TABLE), "",
                      "the other columns (--all-rows, --json, --csv):", *legend_lines(rest)])


#: the origin of ``tpcheck diff --preset tiny --tp 2 --inject skip_o_proj_allreduce`` (its first_divergence)
EXAMPLE = {"point": "layers.0.attn.out", "step": 0, "mode": "isolated", "rel_err": 0.546, "ref_rel_err": 3.21e-07,
           "ref_by": "hf@0", "threshold": 1.65e-06, "excess": 5.11e+05, "gain": -0.268, "gain_threshold": 0.388,
           "max_abs": 1.87, "max_abs_index": [1, 0, 9], "rank_spread": 1.2, "rank_spread_by": "0 vs 1",
           "replica_rel_err": 0.843, "note": ""}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """``docs/reference/summary.md``: the summary's causes and hints (``tpcheck.result.hints``) and the columns'
    legend, as tables (``python -m tpcheck.result.columns`` prints it; ``tests/test_docs.py`` keeps the page equal
    to it)."""
    from tpcheck.result.origin import origin_lines  # the example as the summary writes it (imports torch: not --help)
    hints = [f"| `{kind}` | {'any' if c == '*' else f'`{c}`'} | {_cell(h)} |"
             for kind, by in HINTS.items() for c, h in by.items()]
    return "\n".join([
        "# The summary and the table", "",
        "<!-- generated: python -m tpcheck.result.columns > docs/reference/summary.md -->", "",
        "A failing run's summary names its origin in three parts (`origin:`, `why:`, `next:`; lines wrap at 120 characters):", "",
        "```text", *origin_lines(EXAMPLE, "float32"), "```", "",
        "**Where** (the point, the step, the pass, and the prompt and token of the largest difference), **how far** "
        "(one ratio: the row's `excess`), **why** (the kind of evidence, then its numbers) and **what to check "
        "next**, by the point's kind and the evidence.", "",
        "## Why: the kinds of evidence", "",
        "| cause | the `why:` line says |", "|---|---|",
        *[f"| `{c}` | {_cell(w)} |" for c, w in WHY.items()], "",
        "## Next: what to check", "",
        "By the origin's point kind and cause (`any`: whatever the evidence); a kind or cause without its own hint "
        "takes the cause's:", "",
        "| point kind | cause | next: check |", "|---|---|---|", *hints,
        *[f"| (any other) | `{c}` | {_cell(h)} |" for c, h in BY_CAUSE.items()], "",
        "## The table's columns", "",
        "Every column of a diff's table (`tpcheck diff --json` / `--csv` / `--all-rows`, and the HTML report's "
        "table), in its order; the terminal's per-layer tables show " + ", ".join(f"`{c}`" for c in LAYER_TABLE) +
        ". The same text is in `tpcheck diff --help` and in the report (a legend under its table, and each "
        "header's tooltip); the JSON schema (`tpcheck schema`) states each field's contract.", "",
        "| column | what it says |", "|---|---|",
        *[f"| `{c}` | {_cell(describe(c))} |" for c in [*COLUMN_LEGEND, *SHOWN]], ""])


if __name__ == "__main__":
    print(markdown(), end="")
