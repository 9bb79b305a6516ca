"""What the statistics read of a golden point, computed once for the engine and every reference.

Why: a point's golden is measured against three tensors each step (the engine's, Hugging Face's at the dtype, and
at tp > 1 the TP reference's), and every statistic began by recomputing its own view of the golden: ``compare``
and each reference's ``row_errors`` took its float64 norm (and ``row_errors`` its row norms), and each of the local
pass's three gains (``tpcheck.measure.gain``) took its magnitudes, their row medians and the mask of the
qualifying elements. ``of(golden)`` holds them, each computed by the first statistic that asks (the others, in
other worker threads of ``tpcheck.measure.ahead``, wait for it). Measured with ``metrics``' one pass a chunk of rows
at a time, on qwen2.5-0.5b (tp 2, float32, 128 tokens, 2 cores, statistics in place): a default diff 0.97x the time
(README, "The statistics' golden side once").

The memo is keyed by the golden tensor itself (its identity and its in-place version counter: a golden changed in
place is measured afresh) and lives as long as the tensor does; an inference tensor (``torch.inference_mode``) has
no version counter and is not memoised."""
from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch

_LOCK = threading.RLock()  # reentrant: a golden's weakref callback (_forget) may run inside of(), under it
_MEMO: dict[int, tuple[weakref.ref, int, GoldenStats]] = {}  # id(golden) -> (golden, its _version, its stats)


class GoldenStats:
    """One golden tensor's float64 view (``g64``) and what is computed of it once (``get``)."""

    def __init__(self, golden: torch.Tensor):
        self.g64 = golden.detach().to(torch.float64)
        self._lock = threading.RLock()  # reentrant: one value may be computed from another (norm from row_norms)
        self._values: dict[str, object] = {}

    def get(self, key: str, fn: Callable[[torch.Tensor], object]):
        """``fn(g64)``, computed by the first caller of ``key``; callers in other threads wait for it."""
        with self._lock:
            if key not in self._values:
                self._values[key] = fn(self.g64)
            return self._values[key]

    def row_norms(self) -> torch.Tensor:
        """Each row's norm: a ``[rows]`` float64 tensor, the last dim the features and every other dim rows (a
        1-D golden is one row), as ``metrics`` computes the engine's."""
        return self.get("row_norms", lambda g: as_rows(g).norm(dim=-1))

    def norm(self) -> float:
        """``||g||``: the norm of the row norms, as ``metrics`` computes the engine's whole error."""
        return self.get("norm", lambda _: float(torch.linalg.vector_norm(self.row_norms())))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, features]``: the last dim the features, every other dim rows (a scalar: one element)."""
    features = t.shape[-1] if t.dim() else 1
    return t.reshape(math.prod(t.shape[:-1]) if t.dim() else 1, features)


def _forget(key: int) -> None:
    with _LOCK:
        _MEMO.pop(key, None)


def of(golden: torch.Tensor) -> GoldenStats:
    """The ``GoldenStats`` of this golden tensor (new for a tensor not seen, or changed in place since; an inference
    tensor, which keeps no version counter, gets its own each time: nothing shared, nothing stale)."""
    try:
        version = golden._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return GoldenStats(golden)
    key = id(golden)
    with _LOCK:
        held = _MEMO.get(key)
        if held is not None and held[0]() is golden and held[1] == version:
            return held[2]
        stats = GoldenStats(golden)
        _MEMO[key] = (weakref.ref(golden, lambda _, k=key: _forget(k)), version, stats)
        return stats
