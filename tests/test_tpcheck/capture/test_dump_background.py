"""A dump written off the step (``TPCHECK_DUMP_QUEUE_MB``): the same files as one written inside it, in order,
with back-pressure at its bound rather than loss, and a failed write raised at the next step, never skipped."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from impl.placements import Fused, Replicate, Shard
from tpcheck.capture.background import BackgroundWriter
from tpcheck.capture.dump import DumpError, DumpWriter


from tpcheck.engines.dump.replay import read_dump
def _points(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"layers.0.attn.": (Fused((("q", 8, Shard(-1)), ("k", 4, Shard(-1)), ("v", 4, Shard(-1)))),
                               torch.randn(3, 16, generator=g)),
            "layers.0.out": (Replicate(), torch.randn(3, 8, generator=g)),
            "logits": (Replicate(), torch.randn(3, 32, generator=g))}


def _write(writer: DumpWriter, steps: int) -> None:
    for s in range(steps):
        writer.write(s, [[1, 2, 3]] if s == 0 else [[4 + s]], [0] if s == 0 else [2 + s], _points(s))


def test_a_background_dump_is_byte_for_byte_the_synchronous_one(tmp_path):
    sync = DumpWriter(tmp_path / "sync", 0, 1, "float32", "impl")
    bg = DumpWriter(tmp_path / "bg", 0, 1, "float32", "impl", background_bytes=2**20)
    _write(sync, 4)
    _write(bg, 4)
    bg.close()
    files = sorted(p.name for p in (tmp_path / "sync/rank0").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "bg/rank0").iterdir()) and len(files) == 8
    for name in files:
        assert (tmp_path / "sync/rank0" / name).read_bytes() == (tmp_path / "bg/rank0" / name).read_bytes(), name
    assert len(read_dump(tmp_path / "bg").tokens) == 4
    with pytest.raises(DumpError, match="closed"):
        bg.write(4, [[9]], [7], _points(4))


def test_jobs_run_in_order_and_submit_waits_at_the_bound():
    release, ran = threading.Event(), []
    w = BackgroundWriter("test-writer", bound=100, error=DumpError)
    w.submit(lambda: (release.wait(5), ran.append(0)), 80)
    waited = threading.Event()

    def second():
        w.submit(lambda: ran.append(1), 40)  # 80 + 40 > 100: waits for the first job to be written
        waited.set()
    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.2)
    assert not waited.is_set() and ran == []  # back-pressure: blocked, nothing dropped
    release.set()
    t.join(5)
    assert waited.is_set()
    w.submit(lambda: ran.append(2), 500)  # larger than the bound: waits for an empty queue, then runs
    w.close()
    assert ran == [0, 1, 2]


def test_a_failed_write_is_raised_at_the_next_step_and_nothing_after_it_runs():
    ran = []
    w = BackgroundWriter("test-writer", bound=10**6, error=DumpError)
    w.submit(lambda: (_ for _ in ()).throw(OSError("disk full")), 1)
    with pytest.raises(DumpError, match="OSError: disk full"):
        w.flush()
    with pytest.raises(DumpError, match="disk full"):
        w.submit(lambda: ran.append(1), 1)
    with pytest.raises(DumpError, match="disk full"):
        w.close()
    assert ran == []


def test_queue_size_from_the_environment(ckpt, tmp_path, monkeypatch):
    from test_capture import runner_at
    from tpcheck.capture import IMPL_MAP, from_env
    runner = runner_at(ckpt("tiny"))
    monkeypatch.delenv("TPCHECK_DUMP_POINTS", raising=False)
    monkeypatch.delenv("TPCHECK_DUMP_BUDGET_MB", raising=False)
    for value, threaded in ((None, True), ("0", False), ("1.5", True)):
        monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / f"d{value}"))
        if value is None:
            monkeypatch.delenv("TPCHECK_DUMP_QUEUE_MB", raising=False)
        else:
            monkeypatch.setenv("TPCHECK_DUMP_QUEUE_MB", value)
        cap = from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")
        assert (cap.writer.background is not None) == threaded, value
        if threaded:
            assert cap.writer.background.bound == (256 if value is None else 1.5) * 2**20
        cap.remove()
    for bad in ("lots", "-1"):
        monkeypatch.setenv("TPCHECK_DUMP_QUEUE_MB", bad)
        with pytest.raises(ValueError, match="TPCHECK_DUMP_QUEUE_MB"):
            from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")


def test_a_process_that_exits_without_closing_writes_every_queued_step_and_exits(tmp_path):
    """No hang at exit (the thread never outlives the interpreter) and no lost step (the queue is written first),
    in a plain process and in a multiprocessing child (how vLLM runs its workers)."""
    import subprocess
    import sys
    script = f"""
import multiprocessing as mp, sys, time
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
from test_dump_background import _points
from tpcheck.capture.dump import DumpWriter

def run(root):
    w = DumpWriter(root, 0, 1, "float32", "impl", background_bytes=2**20)
    w.background.submit(lambda: time.sleep(0.3), 1)  # a slow disk: the steps below are still queued at exit
    for s in range(3):
        w.write(s, [[1, 2, 3]] if s == 0 else [[4 + s]], [0] if s == 0 else [2 + s], _points(s))

if __name__ == "__main__":
    run(sys.argv[1] + "/plain")
    p = mp.get_context("fork").Process(target=run, args=(sys.argv[1] + "/child",))
    p.start()
    p.join(60)
    sys.exit(p.exitcode)
"""
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for where in ("plain", "child"):
        assert len(read_dump(tmp_path / where).tokens) == 3, where


@pytest.mark.parametrize("env", ["TPCHECK_DUMP_QUEUE_MB", "TPCHECK_DUMP_BUDGET_MB"])
@pytest.mark.parametrize("bad", ["inf", "nan", "-0.5", "1e999"])
def test_a_non_finite_size_names_the_variable(ckpt, tmp_path, monkeypatch, env, bad):
    from test_capture import runner_at
    from tpcheck.capture import IMPL_MAP, from_env
    runner = runner_at(ckpt("tiny"))
    for other in ("TPCHECK_DUMP_POINTS", "TPCHECK_DUMP_QUEUE_MB", "TPCHECK_DUMP_BUDGET_MB"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("TPCHECK_DUMP", str(tmp_path / "d"))
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=f"^{env}='{bad}' must be a finite number of MiB >= 0$"):
        from_env(runner.model, IMPL_MAP, 0, 1, "float32", "impl")
