"""Exit codes, the same for every subcommand:

  0  pass: every check passed
  1  diverged: a point left the noise floor (the origin is named)
  2  bad input: a file, config field, flag or path (named)
  3  the engine or the harness failed: a rank died, hung or raised (named, with its last words), the engine
     did not report what the verdict needs (coverage), or an I/O error (the path)"""
from __future__ import annotations

from enum import IntEnum

# the only declaration of the codes: the CLI, gate, sweep, compare-results and the fault matrix return these


class Exit(IntEnum):
    PASS = 0
    DIVERGED = 1
    BAD_INPUT = 2
    FAILED = 3


def verdict(passed: bool) -> Exit:
    return Exit.PASS if passed else Exit.DIVERGED
