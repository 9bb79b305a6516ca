"""``tpcheck compare-results A.json B.json``: a regression is named point by point and exits 1; a fix or an
unchanged run exits 0; results of different models are refused (exit 2) unless told otherwise."""
from __future__ import annotations

import json

import jsonschema
import pytest

from diff_runs import run_diff
from tpcheck.result import documents
from tpcheck.cli.app import main
from tpcheck.cli.compare_results import compare_results


@pytest.fixture(scope="module")
def saved(ckpt, engines, tmp_path_factory):
    d = tmp_path_factory.mktemp("results")
    runs = {"clean": run_diff(ckpt, engines, "tiny", 2, steps=1),
            "clean2": run_diff(ckpt, engines, "tiny", 2, steps=1),
            "broken": run_diff(ckpt, engines, "tiny", 2, steps=1, inject=["skip_o_proj_allreduce"]),
            "other": run_diff(ckpt, engines, "small", 2, steps=1)}
    paths = {}
    for name, r in runs.items():
        r.to_json(d / f"{name}.json")
        paths[name] = str(d / f"{name}.json")
    return runs, paths


def test_a_regression_is_named_and_exits_1(saved, tmp_path, capsys):
    runs, p = saved
    out = tmp_path / "cmp.json"
    assert main(["compare-results", p["clean"], p["broken"], "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "REGRESSED" in text and "newly failing" in text
    t = compare_results(runs["clean"], runs["broken"])
    origin = runs["broken"].first_divergence["point"]
    assert t.iloc[0]["change"] == "newly failing"  # the most alarming rows first
    assert origin in set(t[t["change"] == "newly failing"]["point"])
    doc = json.loads(out.read_text())
    errors = list(jsonschema.Draft202012Validator(documents.load_schema()).iter_errors(doc))
    assert not errors, errors[:3]
    assert doc["kind"] == "comparison" and doc["regressed"] is True and len(doc["rows"]) == len(t)


def test_a_fix_and_a_rerun_exit_0(saved, capsys):
    runs, p = saved
    assert main(["compare-results", p["broken"], p["clean"]]) == 0
    assert "NO REGRESSION" in capsys.readouterr().out
    t = compare_results(runs["broken"], runs["clean"])
    assert (t["change"] == "fixed").any() and not (t["change"] == "newly failing").any()
    same = compare_results(runs["clean"], runs["clean2"])  # the same run twice: nothing moves
    assert set(same["change"]) == {"same"}


def test_worse_within_tolerance_is_reported_not_failed(saved):
    runs, _ = saved
    b = runs["clean2"]
    t = b.table.copy()
    t.loc[t["point"] == "logits", "rel_err"] *= 3  # still far under its threshold
    from tpcheck.result.table import DiffResult
    worse = compare_results(runs["clean"], DiffResult(t, dict(b.meta)))
    assert set(worse[worse["change"] == "worse"]["point"]) == {"logits"}
    assert not (worse["change"] == "newly failing").any()


def test_different_models_are_refused_unless_allowed(saved, capsys):
    _, p = saved
    assert main(["compare-results", p["clean"], p["other"]]) == 2
    assert "not runs of the same model" in capsys.readouterr().err
    code = main(["compare-results", p["clean"], p["other"], "--allow-mismatch"])
    assert code in (0, 1)
    assert "only in B" in capsys.readouterr().out  # small has layers tiny has not
    assert main(["compare-results", p["clean"], p["clean"] + ".missing"]) == 2


def test_the_verdict_and_the_origin_come_first_the_rest_on_request(saved, capsys):
    runs, p = saved
    assert main(["compare-results", p["clean"], p["broken"], "--limit", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    origin = runs["broken"].first_divergence
    assert lines[0].startswith("REGRESSED:")
    assert lines[1].startswith(f"origin in B: {origin['point']} (step {origin['step']}")
    table = lines[lines.index(next(x for x in lines if x.startswith("newly failing, in B's execution order"))) + 1:]
    assert table[1].split()[0] == origin["point"]  # B's execution order: the origin is the first row
    assert len([x for x in table if "newly failing" in x]) == 3
    assert "--changed lists every changed point" in lines[-1]
    assert main(["compare-results", p["clean"], p["broken"], "--changed"]) == 1
    changed = capsys.readouterr().out
    n = len(compare_results(runs["clean"], runs["broken"]).query("change != 'same'"))
    assert changed.count("\n") >= n + 2 and "not listed" not in changed
