"""Progress bars: drawn with an ETA on a terminal at INFO, never in a pipe or with --quiet; log lines go
above a bar instead of tearing it."""
from __future__ import annotations

import io
import logging

import pytest

from tpcheck import progress


class _TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def stderr(monkeypatch):
    logger = logging.getLogger("tpcheck")
    saved = logger.level

    def use(stream, level=logging.INFO):
        monkeypatch.setattr("sys.stderr", stream)
        logger.setLevel(level)  # setLevel, not the attribute: it clears the logger's level cache
        return stream
    yield use
    logger.setLevel(saved)


def _run_bar():
    with progress.bar(3, "fault matrix", "run") as b:
        for _ in range(3):
            b.update(1)


def test_a_terminal_gets_a_bar_with_an_eta(stderr):
    err = stderr(_TTY())
    assert progress.shown()
    _run_bar()
    out = err.getvalue()
    assert "fault matrix: 0/3 runs |" in out and "00:00<" in out  # drawn at once, elapsed<remaining (ETA)


@pytest.mark.parametrize("stream, level", [(io.StringIO(), logging.INFO), (_TTY(), logging.WARNING)])
def test_no_bar_in_a_pipe_or_when_quiet(stderr, stream, level):
    err = stderr(stream, level)
    assert not progress.shown()
    _run_bar()
    assert err.getvalue() == ""


def test_log_lines_print_above_a_bar(stderr):
    err = stderr(_TTY())
    handler = progress.LogHandler(err)
    logger = logging.getLogger("tpcheck.test_progress")
    logger.addHandler(handler)
    try:
        with progress.bar(2, "sweep", "configuration") as b:
            logger.warning("a line from the run")
            b.update(2)
    finally:
        logger.removeHandler(handler)
    assert "a line from the run\n" in err.getvalue()


def test_a_diff_on_a_terminal_shows_its_steps(stderr, ckpt, engines):
    import tpcheck
    err = stderr(_TTY())
    r = tpcheck.diff(model=ckpt("tiny"), tp=1, prompts=[[1, 2, 3]], decode_steps=2, isolate=True, pool=engines)
    assert r.passed
    assert "diff: 0/6 steps |" in err.getvalue()  # (prefill + 2 decode steps) x (propagated, isolated)
