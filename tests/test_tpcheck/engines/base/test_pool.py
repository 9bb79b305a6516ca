"""The harness process keeps freed memory (tpcheck.engines.pool.keep_freed_memory)."""
import os

import torch

from tpcheck.engines.pool import keep_freed_memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_large_tensors_stay_with_the_process():
    """Under glibc's defaults a 128 MiB tensor is mapped afresh and unmapped on free (RSS drops by 128 MiB);
    kept, its pages stay this process's to serve the next step's tensors (the reuse is the allocator's: the
    gain is measured by benchmarks/diff_overhead.py, not asserted here)."""
    assert keep_freed_memory()  # glibc on this machine: the call must take
    x = torch.ones(2**25)
    held = _rss()
    del x
    assert held - _rss() < 16 * 2**20
