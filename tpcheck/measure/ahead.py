"""A step's per-point statistics computed ahead, in worker threads, and read back in order.

Why: every point of a step is measured against the golden by pure functions of two tensors (``metrics.compare``,
``gain.gain_fields``, the noise floor's ``row_errors`` and ``gain_of``), one point after another. Their float64
arithmetic runs in torch's intra-op threads, but their selections (medians, the p99, the column groups' medians)
are numpy's and single-threaded, so one core works while the others wait: on a 16-core CPU a default diff of
qwen2.5-0.5b spent 4 s of 6.4 s in them, against 1.4 s for the bare forwards. torch and numpy release the GIL in
that arithmetic, so points measured side by side use the cores. What is computed, and in which order the results
are used (the noise floor's bookkeeping, the rows), is unchanged: the same numbers, bit for bit. Measured there
(4 interleaved runs each, every point ahead): 6.88 s in place, 5.31 s with 4 workers; on 2 cores 0.93-0.95x the
time in place (torch's own threads already use both cores).

``WORKERS`` threads (at most 4: each also runs torch's intra-op threads, and each holds one point's float64
buffers, a logits point's ~0.2 GB at 128 tokens of a 152k vocab). Only a point of at least ``MIN_ELEMENTS`` goes
ahead: a small point's statistics are a string of short calls that each take the GIL, and the main thread, which
needs it between its own, waits up to the interpreter's switch interval (5 ms) each time a worker holds it. Measured
with every point ahead (`benchmarks/diff_overhead.py --in-place`, 2 cores): `deep-sink` (hidden 128) 1.60 s
against 1.12 s in place, `small` 0.24 s against 0.17 s; with this threshold `deep-sink` at 128 tokens (a few points
ahead) 1.33 s against 1.29 s."""
from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

WORKERS = max(1, min(4, os.cpu_count() or 1))
MIN_ELEMENTS = 1 << 15  # a point this large goes ahead (module docstring): 128 tokens of a 256-wide point
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)


def _pool() -> ThreadPoolExecutor:
    """The shared pool of this process: a forked process inherits its parent's pool object but none of its threads
    (a job submitted there would never run), so it makes its own."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(WORKERS, thread_name_prefix="tpcheck-measure"))
    return _POOL[1]


class Ahead:
    """``fn(*args)`` of each submitted key, started at once in the shared pool; ``take(key)`` waits for it and
    returns it (its exception raised there, as the call in place would have), once. Keys not taken are dropped
    with the object (their work finishes, unread). With one worker (a one-core machine), or for a small point,
    nothing is submitted: a caller that finds its key absent computes in place, as it does for what it never
    submitted."""

    def __init__(self) -> None:
        self._jobs: dict[Hashable, Future] = {}

    def submit(self, key: Hashable, fn: Callable, *args, elements: int) -> None:
        """Start ``fn(*args)``, a point's statistics over ``elements`` elements, unless the point is smaller than
        ``MIN_ELEMENTS`` (then the caller finds no key, and computes in place)."""
        if WORKERS > 1 and elements >= MIN_ELEMENTS:
            self._jobs[key] = _pool().submit(fn, *args)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._jobs

    def take(self, key: Hashable):
        return self._jobs.pop(key).result()
