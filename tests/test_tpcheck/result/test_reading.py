"""Reading a failure: the verdict and the origin come first, the per-layer table always holds the origin's row
(marked), and every run says what it ran (engine, golden, dump, selection, tolerances)."""
from __future__ import annotations

from types import SimpleNamespace

from tpcheck.cli.app import _show
from tpcheck.options import DiffOptions
from tpcheck.result.report.sample import sample_result


def _failing():
    # the fault's error grows along the layer, so the origin (attn.q) is not its layer's worst point
    return sample_result(num_layers=3, decode_steps=1, isolate=False, fail_at="layers.1.attn.q")


def test_the_layer_table_holds_the_origin_even_when_it_is_not_its_layers_worst():
    r = _failing()
    assert r.first_divergence["point"] == "layers.1.attn.q"
    t = r.table[(r.table["mode"] == "propagated") & (r.table["step"] == 0) & (r.table["layer"] == 1)]
    assert t.loc[t["excess"].idxmax(), "point"] != "layers.1.attn.q"  # the premise: the worst is another point
    lt = r.layer_table()
    marked = lt[lt["origin"] == "<- origin"]
    assert list(marked["point"]) == ["layers.1.attn.q"] and list(marked["step"]) == [0]
    # still one worst row per (step, layer), the embedding and the head apart
    assert {"embed", "logits"} <= set(lt[lt["step"] == 0]["point"])


def test_a_passing_table_has_no_origin_column():
    lt = sample_result(num_layers=2, decode_steps=0, isolate=False).layer_table()
    assert "origin" not in lt and len(lt) == 4  # embed, layer 0, layer 1, head


def test_a_failing_run_prints_the_verdict_and_the_origin_before_any_table(capsys):
    r = _failing()
    args = SimpleNamespace(isolate=False, all_rows=False, json=None, csv=None, parquet=None, html=None)
    assert _show(r, args) == 1
    out = capsys.readouterr().out.splitlines()
    first_table = next(i for i, line in enumerate(out) if "worst point per layer" in line)
    origin = next(i for i, line in enumerate(out) if line.startswith("origin: layers.1.attn.q (step 0)"))
    assert out[0].startswith("FAIL:") and origin < first_table
    assert any("layers.1.attn.q" in line and line.rstrip().endswith("<- origin") for line in out[first_table:])
    assert out[-5].startswith("FAIL:") and out[-4].startswith("origin:")  # and the verdict again, last, with its
    assert out[-3].startswith("  why: ") and out[-2].startswith("  next: check ")  # evidence and what to check
    assert out[-1].startswith("engine arithmetic: like 2^-")  # then the engine's effective precision
    assert "(float32 is 2^-24" in out[-1]


def test_describe_says_engine_golden_dump_selection_and_tolerances():
    live = DiffOptions(model="/ck", tp=2, dtype="bfloat16").describe()
    assert "impl tp=2 bfloat16" in live and "/ck" in live and "computed live in memory" in live
    assert "dump:       none" in live and "every point" in live and "built-in" in live
    d = DiffOptions(engine="hf-tp", golden="/g", dump="/d", dump_points="embed", points="logits", layers=(0, 2),
                    tolerances="/t.toml").describe()
    assert "hf-tp" in d and "replayed from /g" in d and "/d (points embed)" in d
    assert "points logits; layers 0,2" in d and "/t.toml" in d and "synthetic preset small" in d
    assert "streamed" in DiffOptions(streamed=True).describe()
    assert "saved to /sg" in DiffOptions(save_golden="/sg").describe()
    assert "from x.toml" in DiffOptions().describe("tolerances from x.toml")


def test_every_diff_says_what_it_ran_and_where_it_wrote(tmp_path, capsys):
    from tpcheck.cli.app import main
    g, d = tmp_path / "golden", tmp_path / "dump"
    base = ["diff", "--preset", "tiny", "--tp", "1", "--seq-len", "6", "--batch", "1"]
    assert main(base + ["--save-golden", str(g), "--dump", str(d)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("engine:     impl tp=1 float32") and "tiny" in out.splitlines()[0]
    assert f"saved to {g}" in out and f"saved the golden to {g}" in out
    assert f"dump:       {d}" in out and f"tpcheck compare {d} --model /" in out and "--model ..." not in out
    assert main(base + ["--golden", str(g)]) == 0
    assert f"golden:     replayed from {g}" in capsys.readouterr().out


def test_the_points_heatmap_is_as_wide_as_its_bottom_row_on_a_small_model():
    import re

    from tpcheck.result.report.heatmap import render_heat_points
    r = sample_result(num_layers=2, decode_steps=0, isolate=False, fail_at="logits")
    origin = r.first_divergence
    assert origin["point"] == "logits"
    svg = render_heat_points(r.table, 2, origin, "propagated", 0)
    width = float(re.search(r'viewBox="0 0 (\d+) ', svg).group(1))
    rects = [(float(x), float(w)) for x, w in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)]
    assert rects and max(x + w for x, w in rects) <= width  # final_norm and logits are inside the picture
    origin_cell = re.search(r'<rect x="([\d.]+)"[^>]*class="origin-cell"><title>ORIGIN logits', svg)
    assert origin_cell and float(origin_cell.group(1)) < width


def test_the_legend_labels_each_colour_by_the_colour_rule():
    import re

    from tpcheck.result.report.heatmap import _color, render_heat_legend
    swatches = dict((label, colour) for colour, label in
                    re.findall(r'background:(#[0-9a-f]{6})"></i>([^<]+)</span>', render_heat_legend()))
    assert swatches["&gt;1x (fail)"] == _color(1.01, False)  # failing starts at 1x, not 10x
    assert swatches["1x (pass)"] == _color(1.0, True)
    assert not any(label.startswith("&gt;10x") for label in swatches)


def test_a_sweep_has_an_html_report_linking_each_failing_configuration(tmp_path, capsys):
    from tpcheck.cli.app import main
    out, doc = tmp_path / "sweep", tmp_path / "sweep.json"
    assert main(["sweep", "--preset", "tiny", "--tp", "1", "--dtype", "float32", "--decode-steps", "0",
                 "--examples", "1", "--inject", "untied_lm_head", "--html", str(out), "--json", str(doc)]) == 1
    index = (out / "index.html").read_text()
    reports = sorted(p.name for p in out.glob("0*.html"))
    assert reports == ["000-tiny-tp1-float32-decode0.html"] and f'href="{reports[0]}"' in index
    assert "ORIGIN logits" in (out / reports[0]).read_text()  # the failing example's own report, origin marked
    assert "failing_case" not in index and "tpcheck diff --layer-by-layer --preset tiny" in index  # the repro
    capsys.readouterr()
    assert main(["report", str(doc), "-o", str(tmp_path / "again.html")]) == 0  # a sweep's JSON is not refused
    page = (tmp_path / "again.html").read_text()
    assert 'id="verdict">FAIL' in page and ">logits<" in page  # the sweep's verdict and the failing origin
    assert "for a report of each failing one, run the sweep with --html" in capsys.readouterr().out


def test_check_counts_argmax_flips_with_near_ties_apart():
    import torch

    from tpcheck.pipeline.check import argmax_flips
    golden = torch.tensor([[5.00, 4.99, 0.0], [5.0, 3.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    ref = golden + torch.tensor([[0.01, 0.0, 0.0], [0.01, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    got = torch.tensor([[4.98, 4.99, 0.0], [2.9, 3.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    # position 0: a 0.01 gap within twice the floor's error (a near tie); position 1: a 2.0 gap (a flip)
    assert argmax_flips(got, golden, ref) == (1, 1)
    assert argmax_flips(golden, golden, ref) == (0, 0)
