"""The HTML report: self-contained, escaped, the chart/heatmaps/table present, bounded in size; saved results
read back (``load_result``) the same as they were written."""
from __future__ import annotations

import ast
import base64
import hashlib
import json
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tpcheck.result.report
from tpcheck.result.report import ResultFormatError, load_result, result_from_dict
from tpcheck.result.report.html import render_html, render_sweep_html, write_html
from tpcheck.result.report.sample import sample_result

EVIL = "<script>alert(1)</script>"


def _data(page: str) -> dict:
    """The page's table data, its rows unpacked as the page's script does (columns of one value travel once)."""
    m = re.search(r'<script type="application/json" id="tpcheck-data">(.*?)</script>', page, re.S)
    d = json.loads(m.group(1))
    at = {c: i for i, c in enumerate(d["packed"])}
    d["rows"] = [[r[at[c]] if c in at else d["const"][c] for c in d["cols"]] for r in d["rows"]]
    return d


def test_user_text_is_escaped_everywhere():
    r = sample_result(3, 1, fail_at="layers.1.attn.q",
                      meta={"model": f"/models/{EVIL}/x", "prompt": f'"><img src=x onerror=alert(1)>{EVIL}',
                            "command": f"tpcheck diff --prompt '{EVIL}'"})
    r.table.loc[3, "note"] = "</script><script>alert(2)</script> & <!--"
    page = render_html(r)
    assert "<script>alert" not in page and "<img" not in page and "<!--" not in page.split("<body>")[1]
    assert page.count("<script") == 2  # the JSON data and the one script of the page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown as text
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    # the data block carries the note intact, with no markup characters in the HTML
    rows = _data(page)["rows"]
    assert any("</script><script>alert(2)</script> & <!--" in x for row in rows for x in row if isinstance(x, str))
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page


def test_self_contained_no_external_references_and_a_strict_csp():
    page = render_html(sample_result(2, 1, fail_at="layers.0.mlp.up"))
    assert not re.search(r"(src|href)\s*=\s*[\"'](?!#|data:)", page), "a reference to another file"
    assert "http://" not in page and "https://" not in page and "url(" not in page and "@import" not in page
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    assert "default-src 'none'" in csp
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp  # only this script may run


def test_failing_report_has_header_chart_heatmaps_table_and_origin(tmp_path):
    r = sample_result(4, 2, isolate=True, fail_at="layers.2.attn.k_rope")
    path = write_html(r, tmp_path / "sub" / "r.html")
    page = path.read_text()
    assert '<span class="badge fail" id="verdict">FAIL</span>' in page
    for text in ("tp</dt><dd>2", "dtype</dt><dd>float32", "decode steps</dt><dd>2", 'id="command">tpcheck diff'):
        assert text in page, text
    assert page.count('<figure class="chart"') == 2 * 3  # per mode and step
    assert len(re.findall(r'<figure class="chart" id="[^"]+">', page)) == 1  # one shown, the origin's
    origin = re.search(r'<g class="origin" data-point="([^"]+)"', page)
    assert origin and origin.group(1) == "layers.2.attn.k_rope"
    assert 'class="origin-label"' in page and "origin: layers.2.attn.k_rope" in page
    assert page.count('data-kind="points-layers"') == 2 and page.count('data-kind="steps-layers"') == 2
    assert page.count('class="origin-cell"') >= 2  # points x layers and steps x layers, propagated
    assert '<table class="rows" id="rows">' in page
    d = _data(page)
    assert len(d["rows"]) == len(r.table) and d["origin"] == {"point": "layers.2.attn.k_rope", "step": 0,
                                                            "mode": "propagated"}
    assert d["cols"][:3] == ["point", "step", "mode"] and "passed" in d["cols"]


def test_passing_report_has_no_origin_and_no_steps_heatmap_without_decode():
    page = render_html(sample_result(3, 0, isolate=False))
    assert '<span class="badge pass" id="verdict">PASS</span>' in page
    assert 'class="origin"' not in page and "origin-cell" not in page
    assert 'data-kind="points-layers"' in page and 'data-kind="steps-layers"' not in page


def test_non_finite_values_survive_as_json():
    r = sample_result(2, 0, isolate=False)
    r.table.loc[5, ["rel_err", "excess", "passed"]] = [math.inf, math.inf, False]
    r.table.loc[6, ["rel_err", "cosine", "passed"]] = [math.nan, math.nan, False]
    page = render_html(r)
    d = _data(page)  # strict JSON: json.loads accepts NaN/Infinity, so check the text too
    assert "Infinity" not in page.split('id="tpcheck-data">')[1].split("</script>")[0]
    i = d["cols"].index("rel_err")
    vals = [row[i] for row in d["rows"]]
    assert "inf" in vals and None in vals


def test_report_size_is_bounded_for_a_24_layer_8_step_run():
    """The qwen2.5-0.5b shape: 24 layers, 8 decode steps, isolate: 7,398 rows."""
    for fail in (None, "layers.5.mlp.up"):
        r = sample_result(24, 8, isolate=True, fail_at=fail)
        assert len(r.table) == 7398
        t0 = time.monotonic()
        page = render_html(r)
        took = time.monotonic() - t0
        size = len(page.encode())
        assert size < 2_000_000, f"{size / 1e6:.2f} MB"
        assert took < 20, took


def test_load_result_round_trips_to_json(tmp_path):
    r = sample_result(3, 2, isolate=True, fail_at="layers.1.mlp.gate")
    r.table.loc[7, ["rel_err", "ref_rel_err", "passed", "note"]] = [math.inf, math.nan, False, "shape [2] != golden [3]"]
    r.to_json(tmp_path / "r.json")  # inf and NaN are written as null
    back = load_result(tmp_path / "r.json")
    cols = ["point", "layer", "step", "mode", "kind", "passed"]
    assert back.table[cols].equals(r.table[cols])
    # the origin is the first failing point in execution order over both passes: row 7 (isolated, step 0)
    assert back.first_divergence["point"] == r.first_divergence["point"] == "layers.0.kv.k"
    assert math.isnan(back.table.loc[7, "rel_err"]) and back.table.loc[7, "note"].startswith("shape")
    assert back.passed is False and back.meta == json.loads((tmp_path / "r.json").read_text())["meta"]
    # inf was written as null; a note fails the row whatever its error: the origin tells the note, no ratio
    assert back.summary(brief=True) == r.summary(brief=True)
    assert "origin: layers.0.kv.k (step 0, isolated): shapes differ\n  why: shape [2] != golden [3]" in r.summary()


@pytest.mark.parametrize("text,what", [
    ("{", "not valid JSON"), ("[]", "expected a JSON object"), ('{"rows": []}', "no 'meta'"),
    ('{"meta": {"dtype": "float32"}, "rows": []}', "non-empty list"),
    ('{"meta": {"dtype": "fp7"}, "rows": [{}]}', "meta.dtype"),
    ('{"meta": {"dtype": "float32"}, "rows": [{"point": "embed", "step": 0, "mode": "propagated"}]}', "'rel_err'"),
    ('{"meta": {"dtype": "float32"}, "rows": [{"point": "embed", "step": 0, "mode": "propagated", "rel_err": "x", '
     '"ref_rel_err": 0}]}', "rel_err must be a number"),
])
def test_malformed_results_name_the_file_and_the_problem(tmp_path, text, what):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ResultFormatError) as ei:
        load_result(p)
    assert str(p) in str(ei.value) and what in str(ei.value)
    with pytest.raises(ResultFormatError, match="cannot read"):
        load_result(tmp_path / "missing.json")
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ResultFormatError, match="not UTF-8|not valid JSON"):
        load_result(p)


def test_result_from_dict_fills_kind_and_layer():
    r = result_from_dict({"meta": {"dtype": "bfloat16"}, "rows": [
        {"point": "layers.3.attn.q", "step": 0, "mode": "propagated", "rel_err": 1e-3, "ref_rel_err": 1e-3}]})
    row = r.table.iloc[0]
    assert (row.layer, row.kind, row.passed) == (3, "attn.q", True)
    render_html(r)  # a minimal result still renders


def test_sweep_page_links_each_configuration_and_escapes():
    rows = [{"preset": "tiny", "dtype": "float32", "tp": 1, "passed": True},
            {"preset": "tiny", "dtype": "float32", "tp": 2, "passed": False, "origin": "layers.0.attn.q"},
            {"preset": EVIL, "dtype": "bfloat16", "tp": 2, "passed": True}]
    page = render_sweep_html(rows, ["tiny-1.html", "tiny 2.html?x=<b>", "javascript:alert(1)"])
    assert "<script>alert" not in page and "javascript:" not in page and "<b>" not in page
    assert 'href="tiny-1.html"' in page and 'href="tiny 2.html?x=&lt;b&gt;"' in page
    assert 'id="matrix"' in page and "tp=1" in page and "tp=2" in page
    assert page.count('class="fail"') >= 2 and '<span class="badge fail"' in page  # one failing: the sweep fails
    with pytest.raises(ValueError):
        render_sweep_html(rows, ["a.html"])


# ---------------------------------------------------------------------------------------------- the package's layout

REPORT = Path(tpcheck.result.report.__file__).parent


def test_the_stylesheet_and_script_are_package_data_inlined_verbatim():
    """``static/report.css`` and ``report.js`` are what the page's ``<style>`` and ``<script>`` hold, the CSP
    hash is of that script, and the sweep page has the stylesheet and no script."""
    css = (REPORT / "static" / "report.css").read_text(encoding="utf-8")
    js = (REPORT / "static" / "report.js").read_text(encoding="utf-8")
    page = render_html(sample_result(2, 1, fail_at="layers.0.mlp.up"))
    assert re.search(r"<style>(.*?)</style>", page, re.S).group(1) == "\n" + css
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    assert script == "\n" + js
    assert f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'" in page
    sweep = render_sweep_html([{"tp": 1, "passed": True}])
    assert re.search(r"<style>(.*?)</style>", sweep, re.S).group(1) == "\n" + css
    assert "<script" not in sweep and "script-src" not in sweep  # no script may run there


def test_pyproject_ships_the_static_files():
    """An installed wheel has every file the report inlines: pyproject's package-data names them."""
    tomllib = pytest.importorskip("tomllib")
    with open(REPORT.parents[2] / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    shipped = {p for glob in data["tpcheck.result.report"] for p in REPORT.glob(glob)}
    assert {"report.css", "report.js"} <= {p.name for p in shipped}
    assert set((REPORT / "static").iterdir()) <= shipped


def test_a_static_file_that_would_end_its_element_is_refused(tmp_path, monkeypatch):
    from tpcheck.result.report import shell
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "report.js").write_text("var s = '</SCRIPT>';\n")
    monkeypatch.setattr(shell, "resources", SimpleNamespace(files=lambda package: tmp_path))
    shell.static_text.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"report\.js contains '</script'"):
            shell.static_text("report.js")
    finally:
        shell.static_text.cache_clear()


def test_the_report_modules_stay_small():
    """The report is split by concern (page, chart, heatmap, sweep, shell, static CSS/JS): no module over
    400 lines, no function over 80, and no stylesheet or script inside Python strings."""
    for path in REPORT.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) < 400, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"
        assert "addEventListener" not in text and "box-sizing" not in text, path.name


def test_the_public_names_import():
    from tpcheck.result.report import html, render_html as lazy_render, render_sweep_html as lazy_sweep
    from tpcheck.result.report.shell import static_text
    assert lazy_render is render_html and lazy_sweep is render_sweep_html and html.write_html is write_html
    assert static_text("report.js").lstrip().startswith("(function") and ":root" in static_text("report.css")
