"""The pytest plugin: fixtures, ``assert_layers_close`` and ``--tpcheck-report DIR``, in a pytester run."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tpcheck.pytest_plugin  # noqa: F401  imported here, so the in-process runs below import nothing new
import tpcheck.result.report.html  # noqa: F401
import tpcheck.result.report.sample  # noqa: F401
import tpcheck.judge.tolerances  # noqa: F401

pytest_plugins = ["pytester"]


def _plugin_args() -> list[str]:
    """``-p tpcheck.pytest_plugin`` unless the installed entry point already loads it (both would clash)."""
    eps = importlib.metadata.entry_points(group="pytest11")
    loaded = any(ep.value == "tpcheck.pytest_plugin" for ep in eps)
    return ["-p", "no:benchmark"] + ([] if loaded else ["-p", "tpcheck.pytest_plugin"])


SYNTHETIC = '''
from tpcheck.pytest_plugin import assert_layers_close as imported_helper
from tpcheck.result.report.sample import sample_result

def test_clean(assert_layers_close):
    assert_layers_close(sample_result(3, 1))

def test_fault(assert_layers_close):
    assert_layers_close(sample_result(3, 1, fail_at="layers.1.attn.v"))

def test_fault_imported_helper():
    imported_helper(sample_result(2, 0, isolate=False, fail_at="layers.0.mlp.act"))

def test_tolerances_loosen(assert_layers_close, tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("[tolerances]\\nk = 1e9\\n")
    assert_layers_close(sample_result(3, 1, fail_at="layers.1.attn.v"), f)
'''


def test_assert_layers_close_message_and_reports(pytester):
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    res = pytester.runpytest(*_plugin_args(), "--tpcheck-report", "reports-out", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=2, failed=2)
    out = res.stdout.str()
    # the failure message: the origin line and the per-layer table with the origin's layer marked
    res.stdout.fnmatch_lines(["*origin: layers.1.attn.v (step 0)*", "*per layer, propagated, prefill*",
                              "*layer*point*rel_err*ref_rel_err*excess*",
                              "*1*layers.1.*False*<- origin: layers.1.attn.v*"])
    assert "origin: layers.0.mlp.act" in out
    reports = sorted(p.name for p in (pytester.path / "reports-out").iterdir())
    assert reports == ["test_synthetic.py_test_fault.html", "test_synthetic.py_test_fault_imported_helper.html"]
    page = (pytester.path / "reports-out" / reports[0]).read_text()
    assert "FAIL" in page and "layers.1.attn.v" in page and 'id="rows"' in page
    assert "HTML report: " in out and "reports-out" in out


def test_no_report_without_the_option(pytester):
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    res = pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", "-k", "fault")
    res.assert_outcomes(failed=2, deselected=2)
    assert "HTML report" not in res.stdout.str() and not (pytester.path / "reports-out").exists()


def test_engine_fixtures(pytester):
    """``tpcheck_checkpoint`` / ``tpcheck_engines`` / ``tpcheck_diff`` on the tiny preset; the pool is closed at
    the end of the session."""
    pytester.makeconftest('''
import pytest
POOLS = []

@pytest.fixture(autouse=True)
def _keep(tpcheck_engines):
    POOLS.append(tpcheck_engines)

def pytest_sessionfinish(session):
    import pathlib
    pathlib.Path("closed.txt").write_text(str(all(not p._engines for p in POOLS) and len(POOLS) > 0))
''')
    pytester.makepyfile(test_engine='''
def test_checkpoint(tpcheck_checkpoint):
    assert (tpcheck_checkpoint("tiny") / "config.json").is_file()

def test_clean(tpcheck_diff, assert_layers_close):
    assert_layers_close(tpcheck_diff("tiny", tp=1, seq_len=8))

def test_fault(tpcheck_diff, assert_layers_close):
    assert_layers_close(tpcheck_diff("tiny", tp=1, seq_len=8, inject=["rope_skipped"]))
''')
    # in a subprocess: an in-process run would drop the torch.distributed modules it imported from sys.modules,
    # and their re-import later in this pytest process fails (torch ops register once per process)
    res = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", "--tpcheck-report", "out")
    res.assert_outcomes(passed=2, failed=1)
    res.stdout.fnmatch_lines(["*origin: layers.0.attn.q_rope*"])
    assert (pytester.path / "out" / "test_engine.py_test_fault.html").is_file()
    assert (pytester.path / "closed.txt").read_text() == "True"


def _fixtures_by_source(output: str) -> dict[str, set[str]]:
    """``pytest --fixtures -v`` output -> {"fixtures defined from X" section: names of its fixtures}."""
    out: dict[str, set[str]] = {}
    section = None
    for line in output.splitlines():
        if m := re.fullmatch(r"-+ fixtures defined from (\S+) -+", line.strip()):
            section = out.setdefault(m.group(1), set())
        elif section is not None and (m := re.match(r"(\w+)(?: \[\w+ scope\])? -- \S+:\d+$", line)):
            section.add(m.group(1))
    return out


def test_fixture_names_do_not_clash_with_the_repo_conftest(pytester):
    """The fixtures pytest registers from the plugin and from this repository's ``conftest.py`` (both load in
    every session here) share no name: a clash would silently override one of them."""
    pytester.makeconftest((Path(__file__).resolve().parents[2] / "conftest.py").read_text())
    res = pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", "--fixtures", "-v")
    found = _fixtures_by_source(res.stdout.str())
    plugin, repo = found.get("tpcheck.pytest_plugin", set()), found.get("conftest", set())
    assert {"ckpt", "engines", "hf_model"} <= repo, found
    assert not plugin & repo, f"the plugin and conftest.py both define {sorted(plugin & repo)}"
    assert plugin == {"tpcheck_checkpoint", "tpcheck_engines", "tpcheck_diff", "assert_layers_close"}, found
