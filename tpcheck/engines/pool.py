"""Persistent TP engines: one running engine per (kind, TP size), reused across checks and test examples.

Starting a rank costs a fork from impl's fork server, a process-group rendezvous and, at the first start
in a process, the server's own torch import (~1.5 s); loading a tiny checkpoint costs milliseconds. The pool
keeps the workers and reloads weights only when the checkpoint or cache layout changes. Which engine and how it
starts or reloads is the engine module's business (``tpcheck.engines.registry``); the pool only keeps them."""
from __future__ import annotations

import ctypes
import os
from typing import Callable, TypeVar

from impl.executor import start_fork_server
from tpcheck.engines.impl.adapter import get_llm
from tpcheck.inputs.devices import resolve_device

E = TypeVar("E")


def keep_freed_memory() -> bool:
    """Serve every allocation of this (the harness's) process from its heap and keep freed memory for reuse
    (glibc ``mallopt``: ``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` 2 GiB). By default glibc maps each allocation
    over 32 MiB afresh and unmaps it when freed, so a loop that allocates the same large tensors every step
    (logits, captured points, their float64 copies) pays first-touch page faults every time: measured on a
    2-core VM, 0.23 ms per MiB, 5x a float32 -> float64 conversion; a diff of qwen2.5-0.5b went from
    1.16-1.34x its bare forwards to 0.97-1.09x. RSS then stays at its high-water mark instead of falling
    between steps. The ranks are left as they are (kept freed memory would count in their load footprint).
    Returns False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


class EnginePool:
    """The engines of one harness process; creating a pool also starts impl's fork server and makes this
    process keep freed memory (``keep_freed_memory``). ``device``: where its engines run unless a run names one
    (``--device auto`` of a diff on this pool: this device; None: CUDA when present; ``tpcheck.inputs.devices``);
    ``llm_kwargs``: extra ``impl.LLM`` keywords (``cache``). An engine is kept per (kind, device, tp)."""

    def __init__(self, device: str | None = None, **llm_kwargs):
        self.device = None if device is None else resolve_device(device)  # a GPU that is not there: refused now
        start_fork_server()  # its torch import overlaps the caller's work before the first engine starts
        keep_freed_memory()  # the harness allocates the same points, references and statistics every step
        self.llm_kwargs = llm_kwargs
        self._engines: dict[tuple[str, int], tuple[object, tuple, Callable]] = {}  # (kind, tp) -> (engine, key, close)

    def acquire(self, kind: str, tp: int, key: tuple, start: Callable[[], E], reload: Callable[[E], None],
                close: Callable[[E], None]) -> E:
        """The running ``kind`` engine of ``tp`` ranks loaded as ``key``: started by ``start()`` when there is
        none (or its ranks were torn down after a failure), ``reload(engine)`` when it holds another ``key``."""
        engine, loaded, _ = self._engines.get((kind, tp), (None, None, close))
        if engine is not None and engine.executor.closed:  # torn down after a rank failure: start afresh
            engine = None
        if engine is None:
            engine = start()
        elif loaded != key:
            self._engines[(kind, tp)] = (engine, None, close)  # a reload that fails leaves it held, not loaded
            reload(engine)
        self._engines[(kind, tp)] = (engine, key, close)
        return engine

    def get(self, model_dir: str | os.PathLike, tp: int, dtype: str = "float32", block_size: int = 16,
            num_kv_blocks: int | None = None, ep: int = 1, pp: int = 1, pp_partition: str | None = None,
            device: str | None = None):
        """impl's ``LLM`` of ``tp`` ranks, experts in ``ep`` groups, in ``pp`` pipeline stages, on ``device``
        (default ``engine_device()``; ``tpcheck.engines.impl.adapter.get_llm``)."""
        return get_llm(self, model_dir, tp, dtype, block_size, num_kv_blocks, ep, pp, pp_partition,
                       device or self.engine_device())

    def engine_device(self) -> str:
        """The device of an engine no run placed: the pool's ``device``, else CUDA when present, else the CPU."""
        return self.device or resolve_device("auto")

    def close(self) -> None:
        for engine, _, close in self._engines.values():
            close(engine)
        self._engines.clear()
