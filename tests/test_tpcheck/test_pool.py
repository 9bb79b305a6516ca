"""The harness process keeps freed memory (tpcheck.pool.keep_freed_memory): the same large tensors every step
must not cost fresh pages every step."""
import os

import torch

from tpcheck.pool import keep_freed_memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_large_tensors_stay_with_the_process():
    assert keep_freed_memory()  # glibc on this machine: the call must take
    for _ in range(3):  # the steady state of a loop that allocates the same tensor every step
        x = torch.ones(2**25)  # 128 MiB: mapped afresh and unmapped on free under glibc's defaults
        del x
    held = _rss()
    x = torch.ones(2**25)
    assert _rss() - held < 16 * 2**20  # served from kept memory, not from 128 MiB of fresh pages
    del x
    assert held - _rss() < 16 * 2**20  # and kept again
