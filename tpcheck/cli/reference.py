"""The CLI reference page (``docs/reference/cli.md``), rendered from the parser that ``tpcheck`` runs, so the page
cannot fall behind the flags: ``python -m tpcheck.cli.reference > docs/reference/cli.md`` writes it, and
``tests/test_docs.py`` fails when the committed page differs from what this renders.

Each (sub)command gets a section: its description, a synopsis (positionals, then ``[options]``), and one table row
per option (its spellings with the value's metavar, its default where it has one, its help text). ``diff``'s flags
come from ``tpcheck.options.DiffOptions`` through the parser, so this covers them too."""
from __future__ import annotations

import argparse
import sys

HEADER = """# CLI reference

Generated from the parser `tpcheck` runs (`python -m tpcheck.cli.reference > docs/reference/cli.md`;
`tests/test_docs.py` checks the page matches it). Exit codes, the same for every subcommand: 0 pass, 1 a point over
its tolerance, 2 bad input, 3 the engine or the harness failed ([exit codes and errors](errors.md)). Any `diff` flag
without a subcommand means `diff` (`tpcheck --tp 4`).
"""


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped (GitHub splits cells on them, code spans included)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _spelling(action: argparse.Action) -> str:
    """``--tp N`` / ``--isolate, --no-isolate`` / ``-o OUT``: the option strings with the value's metavar."""
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices is not None and action.metavar is None:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.metavar or action.dest.upper()
    if isinstance(value, tuple):
        value = " ".join(value)
    return f"{names} {value}"


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d == [] or d is False:
        return ""
    return f"`{d}`"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out.update(a.choices)
    return out


def _section(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    fmt = parser._get_formatter()
    name = " ".join(("tpcheck", *path))
    lines = [f"## `{name}`", ""]
    if parser.description:  # reStructuredText's ``code`` is Markdown's `code`; the line breaks kept
        lines += [line.strip() for line in parser.description.replace("``", "`").strip().splitlines()] + [""]
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    subs = _subparsers(parser)
    synopsis = " ".join([name, *(a.metavar or a.dest.upper() for a in positionals)]
                        + (["{" + ",".join(subs) + "}"] if subs else []) + ["[options]"])
    lines += ["```text", "usage: " + synopsis, "```", ""]
    rows = [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]
    if rows:
        lines += ["| option | default | what |", "|---|---|---|"]
        for a in rows:
            what = fmt._expand_help(a).replace("``", "`") if a.help else ""
            lines.append(f"| `{_cell(_spelling(a))}` | {_cell(_default(a))} | {_cell(what)} |")
        lines.append("")
    for sub, sp in subs.items():
        lines += _section(path + (sub,), sp)
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page for ``parser`` (default: ``tpcheck``'s own)."""
    if parser is None:
        from tpcheck.cli.app import _parser
        parser = _parser()
    return "\n".join([HEADER, *_section((), parser)]).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
