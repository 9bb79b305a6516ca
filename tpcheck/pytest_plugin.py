"""pytest plugin for tpcheck (registered through the ``pytest11`` entry point ``tpcheck``).

Fixtures (names chosen not to clash with a project's own ``ckpt`` / ``engines`` / ``hf_model``):

* ``tpcheck_checkpoint(preset="tiny", seed=0, dtype="float32") -> Path``: a synthetic checkpoint, written once
  per session (per xdist worker) under the session's temp dir.
* ``tpcheck_engines``: a session ``tpcheck.engines.pool.EnginePool`` (TP worker processes reused across tests), closed
  at the end of the session.
* ``tpcheck_diff(preset="tiny", tp=2, **kwargs) -> DiffResult``: ``tpcheck.diff`` on a synthetic checkpoint
  with the session's engines.
* ``assert_layers_close``: the helper below, as a fixture.

``assert_layers_close(result, tolerances=None)`` (also importable: ``from tpcheck.pytest_plugin import
assert_layers_close``) fails with the origin line and the per-layer table of the step where the divergence
began. With ``--tpcheck-report DIR`` every failing call also writes an HTML report to ``DIR/<test id>.html``
and names it in the failure message."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

_running: list = []  # the test items being run, innermost last (pytester nests sessions)
_COUNT = pytest.StashKey[int]()


def pytest_addoption(parser):
    group = parser.getgroup("tpcheck", "tpcheck differential checks")
    group.addoption("--tpcheck-report", metavar="DIR", default=None,
                    help="write an HTML report into DIR for each failing assert_layers_close")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.remove(item)


# ------------------------------------------------------------------------------------------------ the helper

def _fmt(df) -> str:
    return df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}")


def failure_message(result) -> str:
    """The verdict with the origin line, then the per-layer table (worst point of each layer, and the origin's
    own row, marked) of the step and mode where the divergence began."""
    fd = result.first_divergence
    if fd is None:
        return result.summary()
    lt = result.layer_table(fd["mode"])
    lt = lt[lt["step"] == fd["step"]].drop(columns=["step"])
    lt = lt.assign(layer=lt["layer"].map(lambda v: "-" if v != v else str(int(v))))
    lt = lt.assign(origin=lt["origin"].map(lambda m: f"{m}: {fd['point']}" if m else ""))  # the origin's own row
    t = result.table
    bad_steps = sorted(set(t[(t["mode"] == fd["mode"]) & ~t["passed"]]["step"]) - {fd["step"]})
    step = "prefill" if fd["step"] == 0 else f"decode step {fd['step']}"
    lines = [f"tpcheck {result.summary()}", "",
             f"per layer, {fd['mode']}, {step} (the worst point of each layer):", _fmt(lt)]
    if bad_steps:
        lines.append(f"also failing at step(s) {', '.join(map(str, bad_steps))}")
    return "\n".join(lines)


def _report_dir(item) -> Path | None:
    opt = item.config.getoption("tpcheck_report", None) if item is not None else None
    if not opt:
        return None
    return (Path(item.config.invocation_params.dir) / opt).resolve()


def _write_report(result, item, name: str | None) -> Path | None:
    d = _report_dir(item)
    if d is None:
        return None
    from tpcheck.result.report.html import write_html
    n = item.stash.get(_COUNT, 0) + 1
    item.stash[_COUNT] = n
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or item.nodeid).strip("_.")[:150] or "tpcheck"
    path = d / (f"{stem}.html" if n == 1 else f"{stem}-{n}.html")
    return write_html(result, path, title=f"tpcheck FAIL: {item.nodeid}")


def assert_layers_close(result, tolerances=None, *, name: str | None = None, _item=None):
    """Fail (``AssertionError``) unless every point of ``result`` (a ``DiffResult`` or a saved JSON path) is within
    tolerance; ``tolerances`` (``Tolerances`` or a TOML path) re-judges it first. Returns the result."""
    __tracebackhide__ = True
    from tpcheck.result.table import DiffResult
    if not isinstance(result, DiffResult):
        from tpcheck.result.report import load_result
        result = load_result(result)
    if tolerances is not None:
        from tpcheck.judge.verdict import judge
        from tpcheck.judge.tolerances import Tolerances
        from tpcheck.judge.tolerances import load_tolerances
        result = judge(result, tolerances if isinstance(tolerances, Tolerances) else load_tolerances(tolerances))
    if result.passed:
        return result
    msg = failure_message(result)
    item = _item if _item is not None else (_running[-1] if _running else None)
    path = _write_report(result, item, name) if item is not None else None
    if path is not None:
        msg += f"\nHTML report: {path}"
    raise AssertionError(msg)


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(name="assert_layers_close")
def _assert_layers_close_fixture(request):
    """``assert_layers_close(result, tolerances=None)``; see ``tpcheck.pytest_plugin.assert_layers_close``."""
    def check(result, tolerances=None, *, name: str | None = None):
        __tracebackhide__ = True
        return assert_layers_close(result, tolerances, name=name, _item=request.node)
    return check


@pytest.fixture(scope="session")
def tpcheck_checkpoint(tmp_path_factory):
    """``tpcheck_checkpoint(preset="tiny", seed=0, dtype="float32") -> Path`` of a synthetic checkpoint."""
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    root = tmp_path_factory.mktemp("tpcheck-checkpoints")

    def get(preset: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
        return cached_checkpoint(preset, seed=seed, dtype=dtype, root=root)

    return get


@pytest.fixture(scope="session")
def tpcheck_engines():
    """A session ``EnginePool``: ``tpcheck_engines.get(model_dir, tp, dtype=...)``; closed after the session."""
    from impl import CacheConfig
    from tpcheck.engines.pool import EnginePool
    pool = EnginePool(cache=CacheConfig(max_num_seqs=16))
    yield pool
    pool.close()


@pytest.fixture
def tpcheck_diff(tpcheck_checkpoint, tpcheck_engines):
    """``tpcheck_diff(preset="tiny", tp=2, **kwargs) -> DiffResult``: ``tpcheck.diff`` on a synthetic checkpoint
    (or ``model=``) with the session's engines; progress is logged to ``tpcheck`` at INFO (pytest's caplog)."""

    def run(preset: str = "tiny", tp: int = 2, tolerances=None, **kwargs):
        from tpcheck.options import DiffOptions
        from tpcheck.pipeline import diff
        kwargs.setdefault("model", None)
        if kwargs["model"] is None:
            kwargs["model"] = str(tpcheck_checkpoint(preset))
        return diff.run(DiffOptions.of(tp=tp, **kwargs), tolerances, pool=tpcheck_engines)

    return run
