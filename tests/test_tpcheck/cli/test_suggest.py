"""A name tpcheck does not know, or a --model that is no checkpoint, is one error line (exit 2) before the parser's
usage and before any banner, with the closest known names ("did you mean")."""
from __future__ import annotations

import pytest

from tpcheck.cli.app import main
from tpcheck.cli.suggest import check_argv, did_you_mean


@pytest.mark.parametrize("argv, says", [
    (["--preset", "smal"], "--preset: unknown preset 'smal'; did you mean 'small'"),
    (["--inject", "skip_allreduce"], "did you mean 'skip_o_proj_allreduce'? (tpcheck faults list lists them)"),
    (["--inject=rope_skipped,rope_skiped"], "--inject: unknown fault 'rope_skiped'"),
    (["--engine", "vlm"], "--engine: unknown engine 'vlm'; did you mean 'vllm'?"),
    (["sweep", "--preset", "tiny,tiny-mqa,tiny-mixtrl"], "--preset: unknown preset 'tiny-mixtrl'"),
    (["faults", "matrix", "--faults", "gate_up_swaped"], "did you mean 'gate_up_swapped'?"),
])
def test_unknown_names_say_what_was_meant(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr()
    assert err.out == ""                                  # no banner, no usage listing
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpcheck: error: ") and says in lines[0], lines


def test_no_suggestion_when_nothing_is_close():
    assert did_you_mean("zzzzzz", ["tiny", "small"]) == ""
    assert check_argv(["diff", "--inject", "nothing_like_any_fault"]).endswith("(tpcheck faults list lists them)")


def test_known_names_and_real_checkpoints_pass(ckpt):
    argv = ["diff", "--model", str(ckpt("tiny")), "--engine", "impl", "--inject", "rope_skipped,gate_up_swapped"]
    assert check_argv(argv) is None
    assert check_argv(["sweep", "--preset", "tiny,small"]) is None


def test_model_that_is_no_checkpoint(tmp_path, capsys):
    for argv in (["--model", str(tmp_path / "no-such-dir")], ["compare", str(tmp_path), "--model", str(tmp_path)]):
        assert main(argv) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.strip().splitlines() == [
        f"tpcheck: error: --model {tmp_path / 'no-such-dir'}: no such directory",
        f"tpcheck: error: --model {tmp_path}: no config.json (not a Hugging Face checkpoint directory)"]


def test_the_console_script_exits_2(tmp_path):
    import os
    import subprocess
    import sys
    tpcheck = os.path.join(os.path.dirname(sys.executable), "tpcheck")  # this environment's console script
    r = subprocess.run([tpcheck, "--preset", "smal"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "did you mean 'small'" in r.stderr


@pytest.mark.parametrize("argv, says", [
    (["diff", "--tpp", "2"], "--tpp: not a flag of tpcheck diff; did you mean '--tp'"),
    (["--dtyp=float32", "--tpp", "2"], "--tpp: not a flag of tpcheck diff; did you mean '--tp'"),  # diff's flags
    (["faults", "matrix", "--jsn", "x.json"], "--jsn: not a flag of tpcheck faults matrix; did you mean '--json'?"),
    (["presets", "extra"], "extra: an argument tpcheck presets does not take (tpcheck presets --help lists"),
])
def test_an_unknown_flag_says_what_was_meant(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr()
    assert err.out == ""  # no usage listing
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpcheck: error: ") and says in lines[0], lines


def test_help_is_plain_text():
    """The descriptions carry reStructuredText's ``code`` for the CLI reference; --help prints them without it."""
    from tpcheck.cli.app import _parser
    top = _parser()
    assert "``" in top.description and "``" not in top.format_help()
    subs = next(a for a in top._actions if a.dest == "cmd").choices
    assert [n for n, p in subs.items() if "``" in (p.description or "")]  # markup there to leave out
    assert [n for n, p in subs.items() if "``" in p.format_help()] == []
