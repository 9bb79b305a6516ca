"""The summary a person reads: the origin says where, how far (one ratio), why and what to check next
(``tpcheck.result.origin``, ``tpcheck.result.hints``); lists and shapes are written as words, never as Python
writes them; and every column of the table is explained, in ``--help``, the HTML report and the docs, from one
legend (``tpcheck.result.columns``)."""
from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from diff_runs import run_diff
from tpcheck.capture.points import KINDS
from tpcheck.judge.coverage import Coverage
from tpcheck.measure.wording import in_words, shape_text
from tpcheck.result import COLUMNS
from tpcheck.result.columns import COLUMN_LEGEND, LAYER_TABLE, SHOWN, describe, help_epilog, markdown
from tpcheck.result.hints import BY_CAUSE, HINTS, WHY, hint
from tpcheck.result.origin import cause_of, isolate_line
from tpcheck.result.report.page import render_html
from tpcheck.result.report.sample import sample_result

ROOT = Path(__file__).resolve().parents[3]
# a Python list, tuple or dict as repr writes it: [1, 0, 9], ['a', 'b'], (2, 8), {'k': ...}, torch.Size(...)
REPR = re.compile(r"\[\s*(-?\d+|'[^']*')(\s*,\s*(-?\d+|'[^']*'))*\s*\]|\(\d+,( \d+,?)*\)|\{'|Size\(")
RATIO = re.compile(r"\b[\d.]+(e[+-]\d+)?x\b")  # "5.11e+05x", "3x": a multiple of a threshold


def _no_repr(text: str) -> None:
    found = REPR.search(text)
    assert found is None, f"a Python repr {found.group(0)!r} in:\n{text}"


def _origin(summary: str) -> list[str]:
    """The origin's lines of a summary: ``origin:`` and its indented lines."""
    lines = summary.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("origin: "))
    j = i + 1
    while j < len(lines) and lines[j].startswith("  "):
        j += 1
    return lines[i:j]


# ------------------------------------------------------------------------------------------------ the hints

@pytest.mark.parametrize("kind,cause,words", [
    ("attn.out", "ranks", "the o_proj all-reduce"),
    ("attn.out", "floor", "o_proj's weight shards"),
    ("attn.q", "floor", "the QKV weight shards: the dim split"),
    ("attn.k", "ranks", "KV-head replicas"),
    ("attn.q_rope", "floor", "RoPE: the positions"),
    ("attn.k_rope", "gain", "RoPE: the positions"),
    ("attn.context", "floor", "the mask"),
    ("attn.context", "nan", "the mask: a -inf times 0"),
    ("kv.k", "shape", "what the cache stores: KV heads repeated or not, the slot mapping"),
    ("mlp.gate", "gain", "that GEMM's scales / quantization"),
    ("mlp.out", "ranks", "the down_proj all-reduce"),
    ("embed", "floor", "the vocab-parallel embedding: each rank's id range"),
    ("logits", "floor", "lm_head: tied to the embedding or not"),
    ("input_norm", "exact-ops", "Gemma's 1 + w"),
    ("final_norm", "floor", "eps"),
    ("attn.q", "nan", BY_CAUSE["nan"]),  # no hint of its own: the cause's
    ("attn.q_rope", "ranks", "KV-head replicas"),  # ranks skip a kind's general hint
    ("mlp.act", "ranks", BY_CAUSE["ranks"]),
])
def test_the_hint_names_what_to_check_by_point_and_cause(kind, cause, words):
    assert words in hint(kind, cause)


def test_every_kind_and_cause_has_a_short_hint():
    assert set(HINTS) <= set(KINDS) and set(BY_CAUSE) == set(WHY)
    assert all(set(by) <= {*WHY, "*"} for by in HINTS.values())
    for kind in KINDS:
        for cause in WHY:
            assert 0 < len("  next: check " + hint(kind, cause)) <= 120, (kind, cause)
    with pytest.raises(KeyError, match="unknown cause 'typo'"):
        hint("attn.q", "typo")


def test_the_cause_is_the_evidence_furthest_over_its_bound():
    fd = {"rel_err": 1.0, "threshold": 1e-3, "gain": 0.5, "gain_threshold": 0.1, "note": "", "rank_spread": float("nan"),
          "replica_rel_err": float("nan")}
    assert cause_of(fd) == "floor"  # 1000x over against 5x: the error, not the gain
    assert cause_of({**fd, "rel_err": 2e-3, "gain": 0.5, "gain_threshold": 1e-3}) == "gain"  # 2x against 500x
    assert cause_of({**fd, "rel_err": 1e-4, "gain": float("nan"), "gain_threshold": float("nan")}) == "bound"
    assert cause_of({**fd, "rel_err": float("nan")}) == "nan"
    assert cause_of({**fd, "note": "shape 2 x 8 != golden 2 x 4"}) == "shape"
    assert cause_of({**fd, "note": "exact-ops: 3 of 64 elements differ"}) == "exact-ops"
    assert cause_of({**fd, "rank_spread": 0.5, "rank_spread_by": "0 vs 1", "rel_err": 1e-4}) == "ranks"


# ------------------------------------------------------------------------------------------------ the origin

def test_a_fault_runs_origin_says_where_how_far_why_and_what_next(ckpt, engines):
    r = run_diff(ckpt, engines, "tiny", 2, isolate=True, inject=["skip_o_proj_allreduce"])
    fd = r.first_divergence
    where, why, nxt = _origin(r.summary())
    assert where.startswith(f"origin: layers.0.attn.out (step 0, {fd['mode']}): {fd['excess']:.3g}x its threshold")
    assert len(RATIO.findall("\n".join((where, why, nxt)))) == 1  # one ratio: the row's excess
    assert why.startswith("  why: ranks disagree: ranks 0 vs 1 differ by ")
    assert nxt == "  next: check " + hint("attn.out", "ranks")
    assert all(len(line) <= 120 for line in r.summary().splitlines()[:4])
    summary = r.summary()
    _no_repr(summary)
    assert r.summary(brief=True) == "\n".join(summary.splitlines()[:4])  # the head and the origin, printed last too


def test_a_clean_run_says_pass_with_no_origin(ckpt, engines):
    r = run_diff(ckpt, engines, "tiny", 2)
    s = r.summary()
    assert s.startswith("PASS: tp=2 float32, ") and ", every point within the noise floor" in s
    assert "origin:" not in s and "why:" not in s and "next:" not in s and r.summary(brief=True) == s
    _no_repr(s)


def test_a_pass_says_how_much_of_its_closest_point_its_own_op_added(ckpt, engines):
    """Where the closest point's own op was measured (``own_err``), the pass says it against the same threshold:
    near 0, what brings the point near its floor is its inputs'; unmeasured, nothing is said."""
    r = run_diff(ckpt, engines, "tiny", 2)
    i = r.table["excess"].astype(float).idxmax()
    assert "own op" not in r.summary() or r.table.at[i, "own_err"] == r.table.at[i, "own_err"]
    r.table["own_err"] = float("nan")
    assert "own op" not in r.summary()
    r.table.at[i, "own_err"] = 0.25 * r.table.at[i, "threshold"]
    assert r.summary().split("\n")[0].endswith(f"at {r.table.at[i, 'excess']:.2f}x (its own op's error: 0.25x)")
    # where the gain sets the excess (a truncating engine's decode-step context), the own op's gain against the
    # gain's bound: 0.5 of a bound of 0.01, its op adding 0.002 of it
    r.table.at[i, "rel_err"], r.table.at[i, "gain"] = 0.1 * r.table.at[i, "threshold"], -0.005
    r.table.at[i, "gain_threshold"], r.table.at[i, "excess"] = 0.004, 0.5
    assert r.summary().split("\n")[0].endswith("at 0.50x (by its gain)")
    r.table.at[i, "own_gain"] = -0.002
    assert r.summary().split("\n")[0].endswith("at 0.50x (by its gain; its own op's gain: 0.20x)")


# ------------------------------------------------------------------------------------------------ words, not reprs

def test_lists_and_shapes_are_words():
    assert [in_words(x) for x in ([], [1], [1, 3], [1, 3, 7])] == ["", "1", "1 and 3", "1, 3 and 7"]
    assert shape_text((2, 8)) == "2 x 8" and shape_text([64]) == "64" and shape_text(()) == "a scalar"


def test_the_isolate_line_names_layers_in_words():
    growth = [{"layer": 0, "propagated_rel_err": 0.1, "amplification": None, "local_rel_err": 0.1,
               "local_passed": False}] + [
        {"layer": i, "propagated_rel_err": 0.1, "amplification": 1.5, "local_rel_err": 0.1 if i in (1, 3, 7) else 1e-7,
         "local_passed": i not in (1, 3, 7)} for i in range(1, 40)]
    line = isolate_line(growth, "isolated")
    assert line.replace("\n    ", " ").startswith("isolate: layer 0 creates the divergence (local rel_err 0.1); layers 1, 3 and 7 also fail "
                           "locally; growth: layer 1 x1.5, layer 2 x1.5")
    assert all(len(part) <= 120 for part in line.splitlines()) and len(line.splitlines()) > 1  # 39 layers: wrapped
    one = isolate_line(growth[:3], "isolated")
    assert "; layer 1 also fails locally;" in one
    _no_repr(line + one)


def test_a_coverage_problem_lists_points_in_words():
    cov = Coverage(["embed", "layers.0.out", "logits"], {"embed"}, r"logits|layers\.\d+\.out", 5)
    assert cov.problem.endswith("): layers.0.out, logits")
    _no_repr(cov.problem.split("): ", 1)[1])


def test_a_shape_note_is_words_in_the_summary():
    r = sample_result(2, 0, isolate=False, fail_at="layers.1.attn.out")
    from tpcheck.judge.verdict import judge
    r.table.loc[r.table["point"] == "layers.0.attn.q", "note"] = f"shape {shape_text((4, 64))} != golden 4 x 32"
    s = judge(r).summary()
    assert "origin: layers.0.attn.q (step 0): shapes differ\n  why: shape 4 x 64 != golden 4 x 32\n" in s
    _no_repr(s)


# ------------------------------------------------------------------------------------------------ the columns

def test_the_legend_explains_every_column_of_the_table():
    """A column added to ``Row`` without a line in ``COLUMN_LEGEND`` fails here."""
    assert list(COLUMN_LEGEND) == [c for c in COLUMNS if c != "order"]  # order: never saved nor shown
    shown = sample_result(2, 0, isolate=True, fail_at="layers.1.mlp.gate").layer_table("isolated").columns
    assert list(shown) == list(LAYER_TABLE) and set(shown) <= set(COLUMN_LEGEND) | set(SHOWN)
    assert all(0 < len(describe(c)) <= 110 and "\n" not in describe(c) for c in [*COLUMN_LEGEND, *SHOWN])


def test_diff_and_compare_help_explain_the_columns():
    from tpcheck.cli.app import _parser
    subs = next(a for a in _parser()._actions if a.dest == "cmd").choices
    epilog = help_epilog()
    for cmd in ("diff", "compare"):
        text = subs[cmd].format_help()
        assert epilog in text and "``" not in epilog
        for c in [*COLUMN_LEGEND, *SHOWN]:
            assert re.search(rf"^  {re.escape(c)} +\S", text, re.M), (cmd, c)
    assert all(len(line) <= 120 for line in epilog.splitlines())


def test_the_report_explains_each_header(tmp_path):
    page = render_html(sample_result(2, 0, isolate=False, fail_at="layers.1.attn.out"))
    assert '<details class="legend" id="legend">' in page and "th.title = (D.legend || {})[c]" in page
    for c in COLUMN_LEGEND:
        assert f"<dt>{c}</dt><dd>{html.escape(describe(c))}</dd>" in page, c
    assert "layers.N.&lt;kind&gt;" in page and '"legend":{' in page  # escaped in the legend and in the data


def test_the_reference_page_is_the_legend():
    page = (ROOT / "docs" / "reference" / "summary.md").read_text(encoding="utf-8")
    assert page == markdown(), "run `python -m tpcheck.result.columns > docs/reference/summary.md`"
    assert "reference/summary.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    from tpcheck.result.columns import EXAMPLE
    from tpcheck.result.origin import origin_lines
    verdict = (ROOT / "docs" / "verdict.md").read_text(encoding="utf-8")  # its example is the summary's own lines
    assert "\n".join(origin_lines(EXAMPLE, "float32")) in verdict
