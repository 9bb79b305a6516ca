"""A step's statistics computed ahead in worker threads (``tpcheck.measure.ahead``): each result is the call's,
taken once, errors raised where it is taken; and a diff's table with several workers is the same bit for bit as the
diff computed in place (one worker: nothing ahead), so a point measured ahead with other tensors than its own, or
the noise floor's reuse of the first reference's statistics lost, would show."""
from __future__ import annotations

import threading

import pytest

import tpcheck.measure.ahead as ahead
from procs import run_forked
from tpcheck.measure.ahead import Ahead
from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run

PROMPT = [(11 * i + 5) % 250 for i in range(40)]


def test_each_key_gives_its_own_result_once(monkeypatch):
    monkeypatch.setattr(ahead, "WORKERS", 3)
    a = Ahead()
    for k in range(20):
        a.submit(k, lambda x, y: (x * y, threading.current_thread().name), k, 3, elements=ahead.MIN_ELEMENTS)
    assert 5 in a and "5" not in a
    results = [a.take(k) for k in reversed(range(20))]
    assert [r[0] for r in results] == [3 * k for k in reversed(range(20))]
    assert all(r[1].startswith("tpcheck-measure") for r in results)  # in the pool's threads
    assert 5 not in a
    with pytest.raises(KeyError):
        a.take(5)


def _take_in_child() -> None:
    a = Ahead()
    a.submit("k", lambda: 42, elements=ahead.MIN_ELEMENTS)
    assert a.take("k") == 42


def test_a_forked_process_measures_with_a_pool_of_its_own(monkeypatch):
    """A process forked after its parent measured ahead has the parent's pool object but none of its threads: it
    makes its own (the inherited one never ran a job: the child waited forever)."""
    monkeypatch.setattr(ahead, "WORKERS", 2)
    a = Ahead()
    a.submit("k", lambda: 1, elements=ahead.MIN_ELEMENTS)
    assert a.take("k") == 1
    assert run_forked(_take_in_child, hung="the forked process hung waiting for its parent's measuring threads") == 0


def test_one_worker_or_a_small_point_computes_nothing_ahead(monkeypatch):
    monkeypatch.setattr(ahead, "WORKERS", 1)
    a = Ahead()
    a.submit("k", lambda: 1 / 0, elements=ahead.MIN_ELEMENTS)  # never run: the caller computes in place
    assert "k" not in a
    monkeypatch.setattr(ahead, "WORKERS", 2)
    a.submit("small", lambda: 1 / 0, elements=ahead.MIN_ELEMENTS - 1)
    assert "small" not in a


def test_an_error_is_raised_where_the_result_is_taken(monkeypatch):
    monkeypatch.setattr(ahead, "WORKERS", 2)
    a = Ahead()
    a.submit("bad", lambda: 1 / 0, elements=ahead.MIN_ELEMENTS)
    a.submit("good", lambda: 7, elements=ahead.MIN_ELEMENTS)
    assert a.take("good") == 7
    with pytest.raises(ZeroDivisionError):
        a.take("bad")


def _tables_equal(x, y) -> bool:
    return x.shape == y.shape and list(x.columns) == list(y.columns) and all(x[c].equals(y[c]) for c in x.columns)


@pytest.mark.parametrize("preset,tp,inject", [("deep-sink", 2, ()), ("tiny-qwen2-moe", 2, ()),
                                              ("deep-sink", 2, ("skip_o_proj_allreduce",))])
def test_a_diff_is_the_same_with_statistics_computed_ahead(monkeypatch, engines, ckpt, preset, tp, inject):
    def diff():
        return run(DiffOptions(model=str(ckpt(preset)), tp=tp, dtype="bfloat16", prompts=[PROMPT, PROMPT[:7]],
                               decode_steps=1, local_rows=16, inject=inject, inject_layer=3 if inject else None),
                   pool=engines)
    monkeypatch.setattr(ahead, "WORKERS", 1)
    in_place = diff()
    monkeypatch.setattr(ahead, "WORKERS", 3)
    monkeypatch.setattr(ahead, "MIN_ELEMENTS", 0)  # every point ahead (these models' points are all small)
    threaded = diff()
    assert in_place.passed == threaded.passed == (not inject)
    assert _tables_equal(in_place.table, threaded.table)
    assert {"isolated", "propagated"} <= set(threaded.table["mode"])
