"""tpcheck gate: 0 pass / 1 over tolerance / 2 unreadable, on saved results; tolerance files and pyproject."""
from __future__ import annotations

import argparse
import random

import pytest

import tpcheck
from tpcheck.cli import gate
from tpcheck.result.table import load_result
from tpcheck.result.report.sample import sample_result
from tpcheck.judge.verdict import judge
from tpcheck.judge.tolerances import Tolerances, ToleranceError, load_tolerances, parse_tolerances



def cli(*argv) -> int:
    """``tpcheck gate|report ...`` through the sub-commands gate.py registers."""
    ap = argparse.ArgumentParser(prog="tpcheck")
    gate.register(ap.add_subparsers(dest="cmd"))
    return gate.run(ap.parse_args([str(a) for a in argv]))


@pytest.fixture
def saved(tmp_path):
    passing, failing = tmp_path / "pass.json", tmp_path / "fail.json"
    sample_result(4, 2, isolate=True).to_json(passing)
    sample_result(4, 2, isolate=True, fail_at="layers.2.attn.q_rope").to_json(failing)
    return passing, failing


def test_gate_exit_codes(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: the defaults
    passing, failing = saved
    code, msg = gate.regate(passing)
    assert code == 0 and msg.startswith(f"PASS {passing}") and "default tolerances" in msg
    code, msg = gate.regate(failing)
    assert code == 1
    mode = load_result(failing).first_divergence["mode"]  # failing in both passes: the row of the larger excess
    assert f"layers.2.attn.q_rope (layer 2, step 0, {mode})" in msg and "over tolerance by " in msg
    assert "rel_err" in msg and "> threshold" in msg and "k 2 x HF" in msg
    bad = tmp_path / "bad.json"
    for text in ("not json", '{"meta": {}, "rows": []}', '{"passed": true}', "[1, 2]", ""):
        bad.write_text(text)
        code, msg = gate.regate(bad)
        assert code == 2 and str(bad) in msg, (text, msg)
    assert gate.regate(tmp_path / "missing.json")[0] == 2

    assert cli("gate", passing) == 0
    assert cli("gate", failing) == 1
    assert "first failing point layers.2.attn.q_rope" in capsys.readouterr().out
    assert cli("gate", bad) == 2
    assert str(bad) in capsys.readouterr().err
    assert cli("gate", passing, failing) == 1 and cli("gate", passing, bad, failing) == 2


def test_gate_on_real_diff_results(ckpt, engines, tmp_path):
    """Real ``tpcheck diff --json`` output: a clean run passes the gate, a faulty one fails it at its origin."""
    rng = random.Random(6)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (9, 13)]
    for inject, want in (([], 0), (["rope_skipped"], 1)):
        r = tpcheck.diff(model=ckpt("tiny"), tp=1, prompts=prompts, decode_steps=1, inject=inject, pool=engines)
        path = tmp_path / f"r{len(inject)}.json"
        r.to_json(path)
        code, msg = gate.regate(path)
        assert code == want, msg
        if want:
            assert r.first_divergence["point"] in msg


def test_tolerances_from_a_file_judge(saved, tmp_path):
    passing, failing = saved
    loose = tmp_path / "loose.toml"
    loose.write_text("[tolerances]\nk = {float32 = 1e9}\nfloor = 1.0\n")
    assert gate.regate(failing, loose)[0] == 0
    # per-kind absolute bound on rel_err only for the kinds that fail: still failing elsewhere
    per_kind = tmp_path / "kind.toml"
    per_kind.write_text('[tolerances.kinds."attn.q_rope"]\nrel_max = 10.0\n')
    code, msg = gate.regate(failing, per_kind)
    assert code == 1 and "layers.2.attn.k_rope" in msg  # the next point is the first failure now
    # an absolute bound on max |diff| makes a passing result fail, and the message says so
    tight = tmp_path / "abs.toml"
    tight.write_text('[tolerances.kinds."mlp.out"]\nabs_max = {float32 = 1e-12, bfloat16 = 1.0}\n')
    code, msg = gate.regate(passing, tight)
    assert code == 1 and "layers.0.mlp.out" in msg and "abs_max 1e-12" in msg
    assert cli("gate", passing, "--tolerances", tight) == 1


def test_tolerances_from_pyproject(saved, tmp_path, monkeypatch):
    passing, failing = saved
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.tpcheck.tolerances]\nk = 1e9\n\n'
        '[tool.tpcheck.tolerances.kinds.logits]\nfloor = {float32 = 2.0}\n')
    tol = load_tolerances()
    assert tol.k_for("attn.q", "float32") == 1e9 and tol.floor_for("logits", "float32") == 2.0
    assert tol.floor_for("logits", "bfloat16") == 1e-3 and "pyproject.toml" in tol.source
    assert cli("gate", failing) == 0  # the loose k from pyproject
    # an explicit file wins over pyproject
    strict = tmp_path / "strict.toml"
    strict.write_text("[tolerances]\nk = 2.0\n")
    assert cli("gate", failing, "--tolerances", strict) == 1
    # a --tolerances file may itself be a pyproject
    assert load_tolerances(tmp_path / "pyproject.toml").k_for("mlp.up", "bfloat16") == 1e9


def test_explicit_file_without_tool_tpcheck_is_an_error(saved, tmp_path, monkeypatch):
    """An explicit --tolerances file with [tool.*] tables but no [tool.tpcheck] is an error naming the file (not
    the defaults); the default ./pyproject.toml without [tool.tpcheck] still means the defaults."""
    monkeypatch.chdir(tmp_path)
    other = '[project]\nname = "x"\n\n[tool.ruff]\nline-length = 120\n'
    f = tmp_path / "other.toml"
    f.write_text(other)
    with pytest.raises(ToleranceError) as ei:
        load_tolerances(f)
    msg = str(ei.value)
    assert str(f) in msg and "[tool.tpcheck] is missing" in msg and "[tool.ruff]" in msg
    assert cli("gate", saved[0], "--tolerances", f) == 2
    (tmp_path / "pyproject.toml").write_text(other)
    assert load_tolerances().source == "default tolerances"
    assert cli("gate", saved[0]) == 0 and cli("gate", saved[1]) == 1  # the defaults judge
    with pytest.raises(ToleranceError, match="tool.tpcheck. is missing"):
        load_tolerances(tmp_path / "pyproject.toml")  # the same file given explicitly


@pytest.mark.parametrize("toml,key", [
    ("[tolerances]\nkk = 2.0\n", "'tolerances.kk'"),
    ('[tolerances.kinds."attn.qq"]\nk = 2.0\n', "'tolerances.kinds.\"attn.qq\"'"),
    ('[tolerances.kinds."attn.q"]\nfloor_ = 2.0\n', "'tolerances.kinds.\"attn.q\".floor_'"),
    ("[tolerances]\nk = {fp32 = 2.0}\n", "'tolerances.k.fp32'"),
    ("[tolerance]\nk = 2.0\n", "'tolerance'"),
    ("[tool.tpcheck]\ntolerance = 1\n", "'tool.tpcheck.tolerance'"),
])
def test_unknown_keys_are_errors_naming_the_key_and_file(tmp_path, toml, key):
    f = tmp_path / "t.toml"
    f.write_text(toml)
    with pytest.raises(ToleranceError) as ei:
        load_tolerances(f)
    assert "unknown key" in str(ei.value) and key in str(ei.value) and str(f) in str(ei.value)


def test_bad_values_and_files(tmp_path, saved):
    f = tmp_path / "t.toml"
    for text, what in (("[tolerances]\nk = -1\n", ">= 0"), ("[tolerances]\nk = 'x'\n", "number"),
                       ("[tolerances]\nk = true\n", "number"), ("[tolerances\n", "not valid TOML"),
                       ("[tolerances]\nkinds = 3\n", "table")):
        f.write_text(text)
        with pytest.raises(ToleranceError, match=what):
            load_tolerances(f)
    with pytest.raises(ToleranceError, match="cannot read"):
        load_tolerances(tmp_path / "none.toml")
    f.write_text("[tolerances]\nkk = 1\n")
    code, msg = gate.regate(saved[0], f)
    assert code == 2 and "unknown key 'tolerances.kk'" in msg
    assert cli("gate", saved[0], "--tolerances", f) == 2


def test_judge_keeps_structural_failures_and_defaults_match_diff():
    r = sample_result(2, 1, isolate=False)
    same = judge(r)
    assert same.passed and (same.table["threshold"] - r.table["threshold"]).abs().max() < 1e-18
    r.table.loc[4, ["passed", "note"]] = [False, "rank 1 differs from rank 0"]  # a rank mismatch: fails however loose
    assert not judge(r, parse_tolerances({"k": 1e9})).passed
    assert isinstance(parse_tolerances({}), tpcheck.Tolerances)


def test_gate_tolerances_work_in_diff_thresholds():
    tol = parse_tolerances({"k": {"bfloat16": 5.0}, "kinds": {"logits": {"rel_max": 0.1, "k": 7}}})
    assert isinstance(tol, Tolerances)
    assert tol.threshold("attn.q", "bfloat16", 1e-3) == pytest.approx(5e-3 + 1e-3)
    assert tol.threshold("attn.q", "float32", 1e-7) == pytest.approx(2e-7 + 1e-6)
    assert tol.threshold("logits", "float32", 1e-7) == 0.1  # rel_max replaces the rule


def test_report_command(saved, tmp_path, capsys):
    passing, failing = saved
    out = tmp_path / "one.html"
    assert cli("report", failing, "-o", out) == 0 and "FAIL" in out.read_text()
    d = tmp_path / "sweep"
    assert cli("report", passing, failing, "-o", d) == 0
    index = (d / "index.html").read_text()
    assert 'href="pass.html"' in index and 'href="fail.html"' in index and (d / "fail.html").is_file()
    assert cli("report", tmp_path / "missing.json", "-o", out) == 2
