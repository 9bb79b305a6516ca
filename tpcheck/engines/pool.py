"""Persistent TP engines: one ``impl.LLM`` per TP size, reused across checks and test examples.

Starting a rank costs a fork from impl's fork server, a process-group rendezvous and, at the first start
in a process, the server's own torch import (~1.5 s); loading a tiny checkpoint costs milliseconds. The pool
keeps the workers and reloads weights only when the checkpoint or cache layout changes."""
from __future__ import annotations

import ctypes
import os

from impl import LLM
from impl.executor import start_fork_server


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
    process keep freed memory (``keep_freed_memory``)."""

    def __init__(self, **llm_kwargs):
        start_fork_server()  # its torch import overlaps the caller's work before the first engine starts
        keep_freed_memory()  # the harness allocates the same points, references and statistics every step
        self.llm_kwargs = llm_kwargs
        self._engines: dict[int, LLM] = {}
        self._loaded: dict[int, tuple] = {}
        self._hf_tp: dict[int, tuple] = {}  # tp -> (HFTPAdapter, (checkpoint, dtype))

    def get(self, model_dir: str | os.PathLike, tp: int, dtype: str = "float32", block_size: int = 16,
            num_kv_blocks: int | None = None) -> LLM:
        key = (str(model_dir), dtype, block_size, num_kv_blocks)
        llm = self._engines.get(tp)
        if llm is not None and llm.executor.closed:  # torn down after a rank failure: start afresh
            del self._engines[tp]
            self._loaded.pop(tp, None)
            llm = None
        if llm is None:
            llm = LLM(model_dir, tp_size=tp, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                      **self.llm_kwargs)
            self._engines[tp] = llm
        elif self._loaded.get(tp) != key:
            self._loaded.pop(tp, None)
            llm.load(model_dir, dtype, block_size, num_kv_blocks)
        self._loaded[tp] = key
        return llm

    def get_hf_tp(self, model_dir: str | os.PathLike, tp: int, dtype: str = "float32"):
        """A ``tpcheck.engines.hf_tp.HFTPAdapter`` of ``tp`` ranks (one per tp, kept; reloaded when the checkpoint or
        dtype changes)."""
        from tpcheck.engines.hf_tp import HFTPAdapter
        key = (str(model_dir), dtype)
        adapter, loaded = self._hf_tp.get(tp, (None, None))
        if adapter is not None and adapter.executor.closed:
            adapter = None
        if adapter is None:
            adapter = HFTPAdapter(str(model_dir), tp, dtype, device=self.llm_kwargs.get("device", "cpu"))
        elif loaded != key:
            adapter.reload(str(model_dir), dtype)
        self._hf_tp[tp] = (adapter, key)
        return adapter

    def close(self) -> None:
        for llm in self._engines.values():
            llm.close()
        for adapter, _ in self._hf_tp.values():
            adapter.shutdown()
        self._engines.clear()
        self._loaded.clear()
        self._hf_tp.clear()
