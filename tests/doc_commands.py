"""The shell commands of the docs, as a reader would type them: extracted, classified and run.

A shell block is a fenced block labelled ``bash``, ``sh``, ``shell`` or ``console``. A marker on the line before
its fence, ``<!-- needs: NAME[, NAME] -->``, says why the test suite does not run it:

* ``gpu``, ``vllm``, ``chromium``: needs what this suite's machine lacks (vLLM's own environment runs its
  commands: ``.ci/vllm``);
* ``network``: installs from a package index (``.ci/run`` performs the install; ``pip install`` lines are
  checked against ``pyproject.toml``'s extras instead);
* ``minutes``: a measurement that takes minutes (its figure, with the command, is on the page);
* ``synopsis``: a command line with placeholders (``[--optional]``, ``DIR``, ``CKPT``): its flags are checked by
  ``tests/test_readme.py``; the guides run their literal forms.

Every other shell block is run: each page's blocks in order, one command line (``\\`` continuations joined) at a
time, by ``bash`` in one fresh directory per page, so a page's later commands see what its earlier ones wrote (as a
reader following the page would). A command must exit 0 unless its comment says ``# exit N``."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
MARKERS = {"gpu", "vllm", "chromium", "network", "minutes", "synopsis"}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_NEEDS = re.compile(r"^<!--\s*needs:\s*([\w, -]+?)\s*-->$")
_EXIT = re.compile(r"#.*\bexit (\d+)\b")
# the first word of a line that is a command, in a block with no language (then it must be labelled bash)
_COMMAND_WORDS = re.compile(r"^(\$ )?(tpcheck|python3?|pip|torchrun|pytest|apt-get|mkdocs|vllm|\.venv[\w-]*/bin/\S+|"
                            r"[A-Z][A-Z0-9_]*=\S+ \S+)( |$)")


@dataclass
class Block:
    where: str                 # "FILE:LINE" of the fence
    lang: str
    lines: list[tuple[int, str]]
    needs: set[str] = field(default_factory=set)

    def commands(self) -> list[tuple[int, str]]:
        """(line, command) of each command line: comments and blank lines dropped, continuations joined."""
        out, i = [], 0
        while i < len(self.lines):
            no, s = self.lines[i][0], self.lines[i][1].strip()
            while s.endswith("\\") and i + 1 < len(self.lines):
                i += 1
                s = s[:-1] + " " + self.lines[i][1].strip()
            if s and not s.startswith("#"):
                out.append((no, s))
            i += 1
        return out


def blocks(text: str, name: str) -> list[Block]:
    """Every fenced block of a Markdown text, with its language and the needs its marker declares."""
    out, fence, cur = [], None, None
    lines = text.splitlines()
    for no, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prev = next((p.strip() for p in reversed(lines[:no - 1]) if p.strip()), "")
            nm = _NEEDS.match(prev)
            needs = {w.strip() for w in nm.group(1).split(",")} if nm else set()
            cur = Block(f"{name}:{no}", m.group(2).lower(), [], needs)
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not line.strip(" `~"):
            out.append(cur)
            fence = None
        elif fence is not None:
            cur.lines.append((no, line))
    return out


def shell_blocks(path: Path) -> list[Block]:
    name = str(path.relative_to(ROOT))
    return [b for b in blocks(path.read_text(), name) if b.lang in SHELL_LANGS]


def unlabelled_command_blocks(path: Path) -> list[str]:
    """Blocks with no language whose first line is a command: a shell block that escapes the rules above."""
    name = str(path.relative_to(ROOT))
    bad = []
    for b in blocks(path.read_text(), name):
        first = next((s.strip() for _, s in b.lines if s.strip() and not s.strip().startswith("#")), "")
        if not b.lang and _COMMAND_WORDS.match(first):
            bad.append(f"{b.where}: {first[:80]!r}")
    return bad


def expected_exit(command: str) -> int:
    m = _EXIT.search(command)
    return int(m.group(1)) if m else 0


def run_page(path: Path, cwd: Path, timeout: float = 600) -> list[str]:
    """Run every unmarked shell block of a page, in order, in ``cwd``; the failures (empty when all ran as said)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               PATH=os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", ""))))  # the venv's tpcheck
    failures = []
    for b in shell_blocks(path):
        if b.needs:
            continue
        for no, cmd in b.commands():
            want = expected_exit(cmd)
            r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            if r.returncode != want:
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-8:])
                failures.append(f"{b.where.split(':')[0]}:{no}: exit {r.returncode}, the page says {want}: {cmd}\n{tail}")
                return failures  # later commands build on this one
    return failures
