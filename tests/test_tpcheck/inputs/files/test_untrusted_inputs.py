"""Untrusted flags, configs, results and tolerance files: exit 2 with one line naming the flag, file or field,
before any engine work; outputs never lost (renamed into place, never onto each other or an input); Ctrl-C
reported once by the driver, no rank traceback, no process left."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpcheck.cli.app import main
from tpcheck.result.report.sample import sample_result

ROOT = Path(__file__).resolve().parents[4]


def _run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("flags,needle", [
    (["--layers", "0,7"], "--layers 7 is beyond this 2-layer model"),
    (["--inject", "skip_o_proj_allreduce", "--inject-layer", "9"], "--inject-layer 9 is beyond this 2-layer model"),
    (["--block-size", "0"], "--block-size must be an integer >= 1"),
    (["--batch", "0"], "--batch must be an integer >= 1"),
    (["--dump", "{tmp}/d", "--dump-budget-mb", "inf"], "--dump-budget-mb must be a finite number"),
    (["--dump", "{tmp}/d", "--dump-budget-mb", "0"], "--dump-budget-mb must be a finite number"),
])
def test_flags_beyond_the_model_are_refused_before_any_engine(capsys, tmp_path, monkeypatch, flags, needle):
    import tpcheck.engines.impl.adapter as impl_engine
    monkeypatch.setattr(impl_engine, "start", lambda *a, **k: pytest.fail("an engine started"))
    code, err = _run(capsys, "diff", "--preset", "tiny", "--tp", "1", *[f.format(tmp=tmp_path) for f in flags])
    assert code == 2 and needle in err, err


def _tpcheck(*argv, limit=None, timeout=120) -> subprocess.CompletedProcess:
    """``python -m tpcheck`` in a child, memory-capped (a regression allocates until MemoryError, safely)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
        if limit is not None:
            limit()
    return subprocess.run([sys.executable, "-m", "tpcheck", *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=cap, timeout=timeout)


def test_a_huge_layer_range_is_refused_while_parsing():
    p = _tpcheck("diff", "--preset", "tiny", "--layers", "0-100000000000")
    assert p.returncode == 2 and "argument --layers" in p.stderr and "beyond any model" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_huge_num_layers_in_a_result_does_not_hang_the_report(tmp_path):
    path = _result(tmp_path, edit=_edit_doc(lambda d: d["meta"].update(num_layers=10**9)))
    p = _tpcheck("report", path, "-o", tmp_path / "r.html", timeout=60)  # a hang fails by TimeoutExpired
    assert p.returncode == 2 and f"{path}: meta.num_layers must be an integer in" in p.stderr


def _result(tmp_path, name="r.json", edit=None) -> Path:
    path = tmp_path / name
    sample_result(2, 1).to_json(path)
    if edit is not None:
        text = edit(path.read_text())
        path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return path


def _edit_doc(fn):
    def edit(text):
        doc = json.loads(text)
        fn(doc)
        return json.dumps(doc)
    return edit


def test_compare_results_refuses_a_nan_factor(tmp_path, capsys):
    a, b = _result(tmp_path, "a.json"), _result(tmp_path, "b.json")
    code, err = _run(capsys, "compare-results", a, b, "--factor", "nan")
    assert code == 2 and "--factor must be a finite number >= 1" in err


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t[:-2] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}", "JSON nested"),
    (lambda t: t[:-2] + ', "x": ' + "7" * 5000 + "}", "an integer of 5000 digits"),
    (_edit_doc(lambda d: d["meta"].update(coverage="all")), "meta.coverage must be an object"),
    (_edit_doc(lambda d: d["rows"][0].update(nan="x")), "rows[0].nan must be an integer"),
])
def test_a_malformed_result_is_named(tmp_path, capsys, edit, needle):
    path = _result(tmp_path, edit=edit)
    start = time.monotonic()
    code, err = _run(capsys, "report", path, "-o", tmp_path / "r.html")
    assert code == 2 and str(path) in err and needle in err, err
    assert time.monotonic() - start < 30 and not (tmp_path / "r.html").exists()


def test_a_tolerance_file_that_is_not_utf8_is_named(tmp_path, capsys):
    tol = tmp_path / "tol.toml"
    tol.write_bytes(b"[tolerances]\nk = \xff\n")
    code, err = _run(capsys, "gate", _result(tmp_path), "--tolerances", tol)
    assert code == 2 and f"{tol}: not UTF-8" in err


@pytest.mark.parametrize("change,needle", [
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"head_dim": 7}, "head_dim"),
])
def test_a_config_refused_by_transformers_or_impl_is_named(ckpt, tmp_path, capsys, change, needle):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt("tiny"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    code, err = _run(capsys, "diff", "--model", d, "--tp", "1")
    assert code == 2 and f"{d}/config.json" in err and needle in err and "internal error" not in err, err


def test_outputs_may_not_overwrite_each_other_or_the_input(tmp_path, capsys):
    r = _result(tmp_path)
    before = r.read_bytes()
    code, err = _run(capsys, "report", r, "-o", r)
    assert code == 2 and f"is the input RESULT {r}" in err and r.read_bytes() == before
    x = tmp_path / "x.out"
    code, err = _run(capsys, "diff", "--preset", "tiny", "--json", x, "--csv", x)
    assert code == 2 and f"--csv {x} and --json {x} name the same file" in err and not x.exists()


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # a disk that fills at 64 KiB


def test_a_full_disk_names_the_path_and_keeps_the_old_file(tmp_path):
    r, out = _result(tmp_path), tmp_path / "out.html"
    out.write_text("the previous report")
    p = _tpcheck("report", r, "-o", out, limit=_limit_file_size)
    assert p.returncode == 3, p.stderr
    assert f"I/O error on {out}: File too large" in p.stderr and "Traceback" not in p.stderr
    assert out.read_text() == "the previous report"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out.html", "r.json"]  # no temporary left


def _group_left(pgid: int) -> list[str]:
    ps = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.strip() and not line.strip().startswith("Z")]


def test_ctrl_c_is_reported_once_by_the_driver(tmp_path):
    # ranks idle in their pipe while the driver runs the golden (most of a step on `small`): on SIGINT each
    # printed its KeyboardInterrupt traceback before the fix
    p = subprocess.Popen([sys.executable, "-m", "tpcheck", "diff", "--preset", "small", "--tp", "2", "--seq-len",
                          "16", "--decode-steps", "500", "--no-isolate"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                         # a terminal's process starts with SIGINT at its default; a test runner's worker may
                         # ignore it, and an ignored SIGINT is inherited through exec
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.set_blocking(p.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + 120
    while b"decode 2/" not in seen and time.monotonic() < deadline and p.poll() is None:
        seen += p.stderr.read() or b""
        time.sleep(0.1)
    assert p.poll() is None and b"decode 2/" in seen, seen.decode()[-2000:]  # interrupted mid-run, not after
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    os.set_blocking(p.stderr.fileno(), True)
    err = (seen + p.stderr.read()).decode()
    assert p.wait(timeout=60) == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and err.count("tpcheck: interrupted") == 1, err
    for _ in range(40):
        if not _group_left(p.pid):
            break
        time.sleep(0.25)
    assert _group_left(p.pid) == []
