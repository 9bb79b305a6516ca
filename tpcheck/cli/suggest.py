"""Names on the command line checked before the parser and before any banner: a ``--preset``, ``--engine``,
``--inject`` / ``--faults`` name tpcheck does not know is one error line with the closest known names ("did you
mean"), and a ``--model`` that is not a checkpoint directory is named at once (argparse would print its whole
usage and every choice; a run would print its header first). ``refuse`` prints it, and ``main`` exits 2 there.
A flag the command does not have is named the same way, with the command's closest flags (``unknown_flag``); and
``PlainParser`` prints every help as plain text (the reStructuredText ````code```` of the descriptions, which the
CLI reference renders as code, without its backticks)."""
from __future__ import annotations

import argparse
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
    from tpcheck.inputs.models.presets import preset_names
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


def unknown_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first argument of ``argv`` that ``parser``'s command does not take, as one error line with its closest
    flags (``tpcheck diff --tpp 2`` -> ``did you mean '--tp'?``); None when there is none. Any other parse error
    is the parser's own (its usage, exit 2)."""
    ns, extra = parser.parse_known_args(argv)
    if not extra:
        return None
    cmd = parser
    for name in (getattr(ns, "cmd", None), getattr(ns, "action", None)):  # the (sub)command that got the argument
        subs = [a for a in cmd._actions if isinstance(a, argparse._SubParsersAction)]
        if name and subs and name in subs[0].choices:
            cmd = subs[0].choices[name]
    word = extra[0].split("=", 1)[0]
    if not word.startswith("-"):
        return f"{extra[0]}: an argument {cmd.prog} does not take ({cmd.prog} --help lists what it takes)"
    flags = [f for a in cmd._actions for f in a.option_strings if f.startswith("--")]
    return f"{word}: not a flag of {cmd.prog}{did_you_mean(word, flags)} ({cmd.prog} --help lists them)"


class PlainParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help is plain text: reStructuredText's ````code```` markup, which the
    descriptions carry for the CLI reference (``tpcheck.cli.reference``), printed without its backticks. The
    subcommands' parsers are of the same class (argparse makes them so)."""

    def format_help(self) -> str:
        return super().format_help().replace("``", "")
