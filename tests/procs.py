"""The processes a test leaves behind: TP ranks are forked by multiprocessing's fork server, so they are
grandchildren of the test process, not children."""
from __future__ import annotations

import os

SHARED = (b"resource_tracker", b"multiprocessing.forkserver")  # one per test process, kept for its lifetime


def descendants() -> set[int]:
    """Live (not zombie) processes descended from this one; the fork server and the resource tracker (children
    of this process) are walked through, the ranks being the server's children, but not reported."""
    procs: dict[int, tuple[int, bool]] = {}  # pid -> (parent pid, shared helper)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            procs[int(pid)] = (int(ppid), any(s in cmd for s in SHARED))
    me = os.getpid()
    out, seen, frontier = set(), set(), {me}
    while frontier:
        frontier = {p for p, (pp, _) in procs.items() if pp in frontier and p not in seen}
        seen |= frontier
        # a rank forked by the server has the server's command line: only this process's own children are helpers
        out |= {p for p in frontier if not (procs[p][1] and procs[p][0] == me)}
    return out


def run_forked(target, *args, hung: str, timeout_s: float = 60.0) -> int:
    """Run ``target(*args)`` in a forked child and return its exit code; a child still running after ``timeout_s``
    is killed and the test fails with ``hung``."""
    import multiprocessing

    import pytest
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(hung)
    return child.exitcode
