"""``--help`` is fast and plain: building the parser (every subcommand) and printing any command's help imports
none of the heavy libraries a run needs (torch, transformers, pandas); their names come from light modules."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "pandas")

# every command path of the parser, then each one's --help (SystemExit 0 after the help), in one fresh interpreter
_CODE = """
import contextlib, io, sys
from tpcheck.cli.app import _parser, main
from tpcheck.cli.completion import _paths
paths = [p.split() for p, _ in _paths(_parser(), "")]
for argv in [["--help"], ["-h"], *[[*p, "--help"] for p in paths]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    assert rc == 0 and "usage: tpcheck" in out.getvalue(), (argv, rc, out.getvalue()[-300:])
err = io.StringIO()
with contextlib.redirect_stderr(err):  # a preset's did-you-mean reads the light list of names too
    assert main(["diff", "--preset", "smal"]) == 2 and "did you mean 'small'" in err.getvalue(), err.getvalue()
print(len(paths), " ".join(m for m in {heavy!r} if m in sys.modules))
"""


def test_help_of_every_command_imports_no_torch_pandas_or_transformers():
    r = subprocess.run([sys.executable, "-c", _CODE.format(heavy=HEAVY)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    count, *heavy = r.stdout.split()
    assert int(count) >= 10  # the subcommands were found (diff, compare, gate, faults matrix, ...)
    assert heavy == [], f"--help imported {heavy}"


def test_fault_matrix_help_is_the_matrix_modules_first_line():
    """``tpcheck faults matrix --help`` describes the matrix with the first line of its module (which imports torch,
    so the parser keeps a copy)."""
    from tpcheck.cli import fault_matrix, fault_matrix_command
    assert fault_matrix_command.DESCRIPTION == fault_matrix.__doc__.split("\n\n")[0]
