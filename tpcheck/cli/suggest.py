"""Names on the command line checked before the parser and before any banner: a ``--preset``, ``--engine``,
``--inject`` / ``--faults`` name tpcheck does not know is one error line with the closest known names ("did you
mean"), and a ``--model`` that is not a checkpoint directory is named at once (argparse would print its whole
usage and every choice; a run would print its header first). ``refuse`` prints it, and ``main`` exits 2 there."""
from __future__ import annotations

import difflib
from pathlib import Path
import sys
from typing import Callable, Iterable

from tpcheck.cli.exit_codes import Exit


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """``"; did you mean 'small'?"`` (up to three close names, difflib's ratio >= 0.6), or ``""``."""
    close = difflib.get_close_matches(word, list(names), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def _presets() -> list[str]:
    from tpcheck.inputs.checkpoints import preset_names
    return list(preset_names())


def _engines() -> list[str]:
    from tpcheck.engines.registry import ENGINES
    return list(ENGINES)


def _faults() -> list[str]:
    from tpcheck.engines.impl.faults import FAULTS
    return list(FAULTS)


# flag -> (what the names are, where they are listed, the known names, comma-separated values)
KNOWN: dict[str, tuple[str, str, Callable[[], list[str]], bool]] = {
    "--preset": ("preset", "tpcheck presets", _presets, True),  # sweep takes a list of presets
    "--engine": ("engine", "tpcheck diff --help", _engines, False),
    "--inject": ("fault", "tpcheck faults list", _faults, True),
    "--faults": ("fault", "tpcheck faults list", _faults, True),
}


def _values(argv: list[str], flag: str) -> list[str]:
    """The values given to ``flag`` (``--flag V`` or ``--flag=V``), in order."""
    out = []
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif tok.startswith(flag + "="):
            out.append(tok.split("=", 1)[1])
    return out


def check_argv(argv: list[str]) -> str | None:
    """The first name or path on ``argv`` that cannot be right, as one error line (exit 2); None when none is."""
    for flag, (what, where, names, listed) in KNOWN.items():
        values = _values(argv, flag)
        if not values:
            continue
        known = names()
        for value in values:
            for word in (value.split(",") if listed else [value]):
                if word.strip() and word.strip() not in known:
                    return f"{flag}: unknown {what} {word.strip()!r}{did_you_mean(word.strip(), known)} ({where} lists them)"
    for value in _values(argv, "--model"):
        path = Path(value).expanduser()
        if not path.exists():
            return f"--model {value}: no such directory"
        if path.is_dir() and not (path / "config.json").is_file():
            return f"--model {value}: no config.json (not a Hugging Face checkpoint directory)"
    return None


def refuse(bad: str) -> int:
    """``bad`` (``check_argv``'s line) on stderr; the exit code 2 (the parser's own usage listing and every choice
    are not printed)."""
    print(f"tpcheck: error: {bad}", file=sys.stderr)
    return Exit.BAD_INPUT
