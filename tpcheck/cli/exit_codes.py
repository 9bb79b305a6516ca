"""Exit codes, the same for every subcommand:

  0  pass: every check passed
  1  diverged: a point left the noise floor (the origin is named)
  2  bad input: a file, config field, flag or path (named)
  3  the engine or the harness failed: a rank died, hung or raised (named, with its last words), the engine
     did not report what the verdict needs (coverage), or an I/O error (the path)"""
from __future__ import annotations

import sys
from enum import IntEnum

# the only declaration of the codes: the CLI, gate, sweep, compare-results and the fault matrix return these


class Exit(IntEnum):
    PASS = 0
    DIVERGED = 1
    BAD_INPUT = 2
    FAILED = 3


def verdict(passed: bool) -> Exit:
    return Exit.PASS if passed else Exit.DIVERGED


def result_exit_code(r) -> int:
    """A DiffResult's exit code: 1 when a point diverged, else 3 when coverage fails the run, else 2 when the dtype
    overflowed in Hugging Face too (``meta["overflow"]``: the dtype cannot hold the model), else 0."""
    if not bool(r.table["passed"].all()):
        return Exit.DIVERGED
    problem = r.meta.get("coverage", {}).get("problem")
    if problem:
        print(f"tpcheck: error: coverage: {problem}", file=sys.stderr)
        return Exit.FAILED
    over = r.meta.get("overflow")
    if over:
        print(f"tpcheck: error: --dtype {r.meta['dtype']}: the model's activations overflow it at {over['point']} "
              f"(step {over['step']}) in Hugging Face too: not a verdict about the engine", file=sys.stderr)
        return Exit.BAD_INPUT
    return Exit.PASS
