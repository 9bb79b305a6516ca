"""Functions run inside TP workers through ``LLM.call("worker_fns:NAME", ...)`` (tests/ is on the
workers' sys.path: spawn copies the parent's)."""
import os
import time

import torch

from impl.distributed import all_reduce


def exit_on_rank(runner, rank: int, code: int = 3):
    if runner.rank == rank:
        os._exit(code)
    return runner.rank


def sleep_on_rank(runner, rank: int, seconds: float):
    if runner.rank == rank:
        time.sleep(seconds)
    return runner.rank


def raise_on_rank(runner, rank: int):
    if runner.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    return runner.rank


def fail_then_collective(runner, rank: int):
    """Rank ``rank`` fails while its peers wait for it in an all-reduce."""
    if runner.rank == rank:
        raise ValueError("failed before the all-reduce")
    all_reduce(torch.ones(1))
    return runner.rank


def pid(runner):
    return os.getpid()


def runtime_error_on_rank(runner, rank: int):
    """An engine bug: a RuntimeError inside one rank (e.g. a dtype mismatch in an index_put)."""
    if runner.rank == rank:
        torch.zeros(4).index_put_((torch.tensor([0]),), torch.ones(1, dtype=torch.float64))
    return runner.rank
