"""Writes off the forward's critical path: one thread per dump writer, jobs run in order, bounded memory.

A serving engine's worker returns from a step, then waits for the next: the step's files are written in that
wait by this thread instead of inside the step. The tensors a job writes are already the capture's own copies
(``tpcheck.capture.copies.as_rows`` copies every captured tensor), so the engine may reuse its buffers at once.

Back-pressure rather than loss: ``submit`` blocks while ``bound`` bytes are queued and not yet written, so a
disk slower than the engine slows the engine down (bounded memory) instead of dropping steps. A job's error is
kept and raised by the next ``submit`` or by ``flush`` (the capture then stops, as it does on a synchronous
error); no job runs after one failed, so a dump never holds a step written after a missing one. A process that
exits normally writes what is queued first: ``close`` is registered with ``threading``'s exit hooks, which run at
the interpreter's exit and at the end of a ``multiprocessing`` child (a vLLM worker) before threads are joined
(``atexit`` where that hook is missing; ``concurrent.futures`` uses the same); the thread itself is a daemon, so
nothing else ever waits for it."""
from __future__ import annotations

import atexit
import sys
import threading
from collections import deque
from typing import Callable


class BackgroundWriter:
    """Runs ``submit``-ted jobs in order on one thread; at most ``bound`` bytes of jobs queued (the one running
    included). ``error`` is the exception type a failed job is re-raised as (its message kept)."""

    def __init__(self, name: str, bound: int, error: type[Exception] = RuntimeError):
        self.bound, self._error_type = bound, error
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Callable[[], None], int]] = deque()
        self._queued = 0
        self._failed: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        at_exit = getattr(threading, "_register_atexit", None)
        try:
            (at_exit or atexit.register)(self._close_at_exit)
        except RuntimeError:  # the interpreter is already shutting down: close() is the caller's
            pass

    def _close_at_exit(self) -> None:
        if self._closed:  # closed by its owner, who was given its error
            return
        try:
            self.close()
        except Exception as e:  # the exit goes on; the dump's own check (compare) names what is missing
            print(f"tpcheck: dump writer {self._thread.name}: {e}", file=sys.stderr)

    def submit(self, job: Callable[[], None], size: int) -> None:
        """Queue ``job`` (``size``: the bytes it holds); blocks while the queue is over its bound (a job larger than
        the bound waits for an empty queue). Raises the error of an earlier job, and on a closed writer."""
        with self._cv:
            while self._jobs and self._queued + size > self.bound and self._failed is None:
                self._cv.wait()
            self._raise_failed()
            if self._closed:
                raise self._error_type("the dump writer is closed")
            self._jobs.append((job, size))
            self._queued += size
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every queued job has run; raise the first error."""
        with self._cv:
            while self._jobs and self._failed is None:
                self._cv.wait()
            self._raise_failed()

    def close(self) -> None:
        """Write what is queued, stop the thread and raise the first error (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._cv:
            self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._error_type(self._failed)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs or self._failed is not None:
                    self._jobs.clear()
                    self._queued = 0
                    self._cv.notify_all()
                    return
                job, size = self._jobs[0]
            try:
                job()
            except Exception as e:  # kept for the engine's thread: a dump's failure must not pass silently
                with self._cv:
                    self._failed = f"{type(e).__name__}: {e}" if not isinstance(e, self._error_type) else str(e)
            with self._cv:
                self._jobs.popleft()
                self._queued -= size
                self._cv.notify_all()
