"""The engine's effective precision (``tpcheck.measure.precision``): per pass and point kind, ``p(dtype) -
log2(median(rel_err / ref_rel_err_hf))``; stored in a diff's meta, told in one sentence after the CLI's verdict
and as a small table in the HTML report."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from tpcheck.measure.precision import effective_precision, precision_sentence
from tpcheck.result import documents
from tpcheck.result.report.html import render_html
from tpcheck.result.report.sample import sample_result

NAN, INF = math.nan, math.inf


def _table(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["mode", "kind", "rel_err", "ref_rel_err_hf"])


def test_bits_per_mode_and_kind_from_the_median_ratio():
    t = _table([("propagated", "mlp.out", 1e-7, 1e-7), ("propagated", "mlp.out", 4e-7, 1e-7),
                ("propagated", "mlp.out", 2e-7, 1e-7),             # ratios 1, 4, 2: median 2 -> 23 bits
                ("propagated", "mlp.out", NAN, 1e-7), ("propagated", "mlp.out", 3e-7, 0.0),  # not counted
                ("propagated", "mlp.out", INF, 1e-7), ("propagated", "mlp.out", 0.0, 1e-7),
                ("propagated", "embed", 0.0, 0.0),                 # exact in both: no row, no kind
                ("propagated", "attn.q", 5e-8, 1e-7),              # half HF's error: 25 bits
                ("isolated", "mlp.out", 1e-7, 1e-7)])
    p = effective_precision(t, "float32")
    assert list(p) == ["propagated", "isolated"] and list(p["propagated"]) == ["mlp.out", "attn.q"]
    assert p["propagated"]["mlp.out"] == {"bits": pytest.approx(23.0), "ratio": pytest.approx(2.0), "rows": 3}
    assert p["propagated"]["attn.q"]["bits"] == pytest.approx(25.0) and p["isolated"]["mlp.out"]["bits"] == 24.0
    assert effective_precision(t, "bfloat16")["propagated"]["mlp.out"]["bits"] == pytest.approx(7.0)
    assert json.loads(json.dumps(p, allow_nan=False)) == p  # plain JSON
    assert effective_precision(_table([("propagated", "embed", 0.0, 0.0)]), "float64") == {}


def _prec(mode: str, **bits: float) -> dict:
    return {mode: {k.replace("_", "."): {"bits": b, "ratio": 2 ** (24 - b), "rows": 2} for k, b in bits.items()}}


def test_the_sentence_names_the_worst_kinds_first_at_most_four():
    p = _prec("propagated", attn_q=23.9, mlp_out=22.1, attn_out=23.4, logits=20.0, kv_k=23.0, final_norm=21.0)
    s = precision_sentence(p, "float32")
    assert s == ("engine arithmetic: like 2^-20.0 at logits, 2^-21.0 at final.norm, 2^-22.1 at mlp.out, 2^-23.0 at "
                 "kv.k and 1 more kinds (float32 is 2^-24; the other kind within 0.5 bit of it or better)")


def test_the_sentence_when_no_kind_is_half_a_bit_below_and_from_the_local_pass():
    assert precision_sentence(_prec("propagated", attn_q=23.8, mlp_out=24.2), "float32") == \
        "engine arithmetic: like float32 (within 0.5 bit of HF's) at every point kind"
    better = precision_sentence(_prec("propagated", attn_q=23.8, mlp_out=25.0), "float32")
    assert better == ("engine arithmetic: like float32 or better at every point kind (1 of 2 more than 0.5 bit "
                      "above HF's)")
    both = {**_prec("propagated", mlp_out=20.0), **_prec("isolated", mlp_out=23.9)}
    assert precision_sentence(both, "float32").startswith("engine arithmetic (local pass): like float32")
    assert precision_sentence({}, "float64").startswith("engine arithmetic: not measured")


def test_meta_holds_it_schema_valid(tmp_path):
    r = sample_result(2, 1, isolate=True)
    r.meta["effective_precision"] = effective_precision(r.table, "float32")
    assert set(r.meta["effective_precision"]) == {"propagated", "isolated"}
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(documents.load_schema())
    doc = json.loads(documents.dumps(r.to_document()))
    validator.validate(doc)
    doc["meta"]["effective_precision"]["propagated"]["mlp.out"]["bits"] = "24"
    assert not validator.is_valid(doc)


def test_the_report_shows_a_table_with_every_kind_escaped():
    r = sample_result(2, 0, isolate=False)
    r.table.loc[3, "kind"] = "<img src=x onerror=alert(1)>"
    html = render_html(r)
    assert '<table class="precision" id="precision">' in html and 'href="#s-precision"' in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<td>mlp.out</td>" in html


def test_the_cli_prints_the_sentence_after_the_verdict(ckpt, capsys):
    from tpcheck.cli.app import main
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--seq-len", "6", "--batch", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    verdict = max(i for i, line in enumerate(out) if line.startswith("PASS: tp=2 float32"))
    assert out[verdict + 1].startswith("engine arithmetic (local pass): like ")  # local: each layer's own arithmetic
