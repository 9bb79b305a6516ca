"""The user docs say true things about their own form and about the CLI.

* Every Markdown table in README.md, benchmarks/README.md and docs/**/*.md is well formed: the header, the
  delimiter row (``|---|``) and every row have the same number of cells (GitHub renders a table whose
  header and delimiter differ as plain text, and drops or pads the cells of a row that differs). A ``|``
  inside a code span or escaped as ``\\|`` does not separate cells; a table ends at the first line that does
  not start with ``|``.
* Inside a table an unescaped ``|`` in a code span is written ``\\|``: GitHub's table parser splits cells
  on it before it sees code spans (GFM spec, tables extension), so ```a|b``` breaks the row there.
* README.md is at most 250 lines, and every shell command in it runs as written (``tests/doc_commands.py``; the
  docs pages' commands: ``tests/test_docs.py``).
* Every ``tpcheck ...`` command the docs show (code-block lines starting with ``tpcheck `` or
  ``$ tpcheck ``, with ``\\`` continuations followed, and inline code spans starting with ``tpcheck ``)
  names subcommands and ``--flags`` that ``tpcheck.cli._parser()`` defines, at that subcommand (nested ones
  such as ``faults matrix`` included); placeholders in brackets (``[--examples N]``) are checked too, and a
  flag must be spelled out in full (argparse would accept an abbreviation, the docs should not show one).

Apart from the README's commands, no engine runs here: the parser is built in-process and the files are read as
text.
"""
from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250  # a guide of a page; the measurements and the argument live on docs/ pages

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_DELIM_CELL = re.compile(r"^\s*:?-+:?\s*$")
_DELIM_LINE = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---- Markdown structure ------------------------------------------------------------------------------------
def prose_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            out.append((no, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
            fence = None
    return out


def code_blocks(text: str) -> list[list[tuple[int, str]]]:
    """The lines (with 1-based numbers) of every fenced code block."""
    blocks, fence, cur = [], None, []
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, cur = m.group(1), []
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
            blocks.append(cur)
            fence = None
        else:
            cur.append((no, line))
    return blocks


def split_cells(line: str) -> tuple[list[str], list[str]]:
    """The cells of a table line, and the code spans in it that hold an unescaped ``|``.

    ``\\|`` never separates; a ``|`` inside a code span (a backtick run closed by a run of the same length)
    does not either. The leading and trailing pipe are dropped."""
    s = line.strip()
    cells, cur, piped_spans = [], [], []
    i, code, span_start, span_has_pipe = 0, 0, 0, False
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and (s[i + 1] == "|" or not code):
            cur.append(s[i:i + 2])
            i += 2
            continue
        if c == "`":
            j = i
            while j < len(s) and s[j] == "`":
                j += 1
            run = j - i
            if not code:
                # a run opens a code span only if the same run closes it later on the line
                if re.search(rf"(?<!`)`{{{run}}}(?!`)", s[j:]):
                    code, span_start, span_has_pipe = run, i, False
            elif run == code:
                if span_has_pipe:
                    piped_spans.append(s[span_start:j])
                code = 0
            cur.append(s[i:j])
            i = j
            continue
        if c == "|":
            if code:
                span_has_pipe = True
            else:
                cells.append("".join(cur))
                cur = []
                i += 1
                continue
        cur.append(c)
        i += 1
    cells.append("".join(cur))
    if s.startswith("|"):
        cells = cells[1:]
    if len(cells) > 1 and s.endswith("|") and not s.endswith("\\|") and cells[-1] == "":
        cells = cells[:-1]
    return [c.strip() for c in cells], piped_spans


@dataclass
class Table:
    where: str            # "FILE:LINE" of the header
    lines: list[tuple[int, str]]


def find_tables(text: str, name: str) -> tuple[list[Table], list[str]]:
    """The pipe tables of a document (runs of lines starting with ``|``), and problems found on the way:
    a delimiter row with no ``|``-led header above it (a table GitHub may render differently)."""
    tables, problems, cur, prev = [], [], [], None
    for no, line in prose_lines(text) + [(None, "")]:
        if line.lstrip().startswith("|"):
            cur.append((no, line))
        else:
            if cur:
                tables.append(Table(f"{name}:{cur[0][0]}", cur))
                cur = []
            if no is not None and _DELIM_LINE.match(line) and prev is not None and prev[1].strip():
                problems.append(f"{name}:{no}: a delimiter row under a header that does not start with '|'")
        prev = (no, line)
    return tables, problems


def table_problems(t: Table) -> list[str]:
    """Why a table is malformed (empty when it is not)."""
    (hno, header), *rest = t.lines
    name = t.where.rsplit(":", 1)[0]
    n, _ = split_cells(header)
    n = len(n)
    out = []
    if not rest:
        return [f"{t.where}: a '|' line with no delimiter row under it (renders as text)"]
    dno, delim = rest[0]
    dcells, _ = split_cells(delim)
    if not all(_DELIM_CELL.match(c) for c in dcells):
        return [f"{name}:{dno}: the line under the header is not a delimiter row (|---|): {delim.strip()!r}"]
    if len(dcells) != n:
        out.append(f"{name}:{dno}: delimiter row has {len(dcells)} cells, header has {n} (renders as text)")
    for no, row in rest[1:]:
        cells, _ = split_cells(row)
        if len(cells) != n:
            out.append(f"{name}:{no}: {len(cells)} cells, header has {n}: {row.strip()[:100]!r}")
    return out


def piped_code_spans(t: Table) -> list[str]:
    name = t.where.rsplit(":", 1)[0]
    return [f"{name}:{no}: {span}" for no, line in t.lines for span in split_cells(line)[1]]


def all_tables() -> list[Table]:
    return [t for p in DOCS for t in find_tables(p.read_text(), _rel(p))[0]]


def test_docs_exist():
    for p in DOCS:
        assert p.is_file(), p
    assert len(DOCS) >= 3


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_tables_well_formed(doc):
    tables, problems = find_tables(doc.read_text(), _rel(doc))
    for t in tables:
        problems += table_problems(t)
    assert not problems, "malformed Markdown tables:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_table_code_spans_escape_pipes(doc):
    tables, _ = find_tables(doc.read_text(), _rel(doc))
    bad = [s for t in tables for s in piped_code_spans(t)]
    assert not bad, ("a '|' in a code span inside a table splits the cell on GitHub; write it '\\|':\n"
                     + "\n".join(bad))


def test_readme_has_tables():
    # the parser must see the tables at all (a parser that finds none would pass anything)
    tables, _ = find_tables((ROOT / "README.md").read_text(), "README.md")
    assert len(tables) >= 3  # the verdict's columns, the exit codes, where to go next
    assert len(all_tables()) >= 60


def test_readme_is_a_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move detail to docs/)"


def test_readme_commands_run(tmp_path):
    """Every shell command of the README, as a newcomer types it, in a fresh directory: the main job, a checkpoint
    of one's own, a dump compared. Only what this machine cannot run is marked (vLLM, a GPU, the install)."""
    from doc_commands import run_page, shell_blocks
    readme = ROOT / "README.md"
    marked = {n for b in shell_blocks(readme) for n in b.needs}
    assert marked <= {"vllm", "gpu", "network"}, marked
    run = [c for b in shell_blocks(readme) if not b.needs for _, c in b.commands()]
    for piece in ("tpcheck", "tpcheck diff --model my-checkpoint", "tpcheck compare dumps/run1"):
        assert any(c.startswith(piece) for c in run), piece
    failures = run_page(readme, tmp_path)
    assert not failures, "\n\n".join(failures)


# ---- tpcheck commands --------------------------------------------------------------------------------------
def cli_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], tuple[set, dict]]:
    """{subcommand path: (option strings of that parser, {subcommand: parser})}, every level."""
    opts = {o for a in parser._actions for o in a.option_strings}
    subs = {}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            subs.update(a.choices)
    tree = {path: (opts, subs)}
    for name, sp in subs.items():
        tree.update(cli_tree(sp, path + (name,)))
    return tree


@pytest.fixture(scope="module")
def tree():
    from tpcheck.cli.app import _parser
    return cli_tree(_parser())


@dataclass
class Command:
    where: str
    text: str


def block_commands(text: str, name: str) -> list[Command]:
    """``tpcheck`` command lines of the fenced code blocks, continuations joined."""
    out = []
    for block in code_blocks(text):
        i = 0
        while i < len(block):
            no, line = block[i]
            s = line.strip()
            if s.startswith("$ "):
                s = s[2:].lstrip()
            if s == "tpcheck" or s.startswith("tpcheck "):
                parts = [s]
                while parts[-1].endswith("\\") and i + 1 < len(block):
                    parts[-1] = parts[-1][:-1]
                    i += 1
                    parts.append(block[i][1].strip())
                out.append(Command(f"{name}:{no}", " ".join(parts)))
            i += 1
    return out


def inline_commands(text: str, name: str) -> list[Command]:
    """Inline code spans (outside code blocks) that start with ``tpcheck ``; a span may wrap lines."""
    lines = prose_lines(text)
    joined = "\n".join(line for _, line in lines)
    starts = [0]
    for _, line in lines:
        starts.append(starts[-1] + len(line) + 1)
    out = []
    for m in re.finditer(r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)", joined, flags=re.S):
        body = " ".join(m.group(2).split())
        if body.startswith("tpcheck "):
            k = max(i for i, s in enumerate(starts) if s <= m.start())
            out.append(Command(f"{name}:{lines[k][0]}", body))
    return out


def doc_commands() -> list[Command]:
    cmds = []
    for p in DOCS:
        text = p.read_text()
        cmds += block_commands(text, _rel(p)) + inline_commands(text, _rel(p))
    return cmds


def command_problems(cmd: str, tree: dict) -> tuple[list[str], list[str]]:
    """(what does not exist, the names of those that do not exist) for one ``tpcheck ...`` line."""
    try:
        tokens = shlex.split(cmd, comments=True)
    except ValueError:
        tokens = cmd.split("#", 1)[0].split()
    assert tokens and tokens[0] == "tpcheck", cmd
    from tpcheck.cli.app import default_command
    tokens = default_command(tokens[1:])  # diff's flags without a command mean diff
    path: tuple[str, ...] = ()
    problems, names = [], []
    rest = list(tokens)
    # descend through subcommands: the first word that is not a flag at each level that has subparsers
    while tree[path][1]:
        words = [t for t in rest if not t.lstrip("[(").startswith("-")]
        if not words:
            break
        word = words[0]
        if word not in tree[path][1]:
            problems.append(f"subcommand {' '.join(('tpcheck', *path, word))!r} does not exist "
                            f"(there: {', '.join(sorted(tree[path][1]))})")
            names.append(word)
            return problems, names
        rest = rest[rest.index(word) + 1:]
        path = path + (word,)
    allowed = set().union(*(tree[path[:k]][0] for k in range(len(path) + 1)))
    for t in tokens:
        m = re.match(r"^[\[(]*(--?[A-Za-z][A-Za-z0-9-]*)", t)
        if m and m.group(1) not in allowed:
            problems.append(f"{m.group(1)} is not an option of {' '.join(('tpcheck', *path))!r}")
            names.append(m.group(1))
    return problems, names


COMMANDS = doc_commands()


def test_commands_found():
    # the extraction must see the docs' commands (one that finds none would pass anything)
    readme = [c for c in COMMANDS if c.where.startswith("README.md:")]
    assert len(readme) >= 8, readme
    joined = " ".join(c.text for c in readme)
    for piece in ("tpcheck make-checkpoint", "--engine vllm", "tpcheck compare", "--inject skip_o_proj_allreduce"):
        assert piece in joined, piece
    joined = " ".join(c.text for c in COMMANDS)
    for piece in ("tpcheck faults matrix", "tpcheck sweep", "--inject-layer 3", "--examples N", "--isolate"):
        assert piece in joined, piece


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_uses_real_subcommands_and_flags(cmd, tree):
    problems, _ = command_problems(cmd.text, tree)
    assert not problems, f"{cmd.where}: {cmd.text}\n" + "\n".join(problems)


# ---- the checkers themselves can fail ----------------------------------------------------------------------
def test_checker_catches_malformed_tables():
    bad = "\n".join([
        "| a | b | c |",
        "|---|---|",              # delimiter one short: GitHub shows text
        "| 1 | 2 | 3 |",
        "",
        "| a | b |",
        "|---|---|",
        "| 1 | 2 | bogus |",      # a row with an extra cell
        "| `x|y` | \\| |",          # a code-span pipe and an escaped pipe: two cells, fine for counting
        "",
        "| no delimiter |",
        "text",
    ])
    tables, _ = find_tables(bad, "bad.md")
    found = [p for t in tables for p in table_problems(t)]
    assert any("bad.md:2: delimiter row has 2 cells, header has 3" in p for p in found), found
    assert any(p.startswith("bad.md:7: 3 cells") for p in found), found
    assert not any(p.startswith("bad.md:8:") for p in found), found
    assert any(p.startswith("bad.md:10:") for p in found), found
    assert [s for t in tables for s in piped_code_spans(t)] == ["bad.md:8: `x|y`"]
    ok = "| a | b |\n|:--|--:|\n| `a|b` | c \\| d |\n\nafter | text\n"
    tables, problems = find_tables(ok, "ok.md")
    assert len(tables) == 1 and not problems and not table_problems(tables[0])
    assert split_cells("| `a|b` | c \\| d |")[0] == ["`a|b`", "c \\| d"]
    assert split_cells("| a | |")[0] == ["a", ""]


def test_checker_catches_bogus_flags(tree):
    text = "\n".join([
        "```bash",
        "tpcheck diff --preset tiny --tp 2 \\",
        "    [--bogus-flag N] [--isolate]",
        "$ tpcheck faults matrix --no-clean --exact-ops",
        "tpcheck frobnicate --tp 2",
        "tpcheck diff --layer --tp 2",       # an abbreviation argparse would accept
        "tpcheck sweep --tp 1,2 [--examples N] [--preset tiny | --random-configs] # --not-a-flag in a comment",
        "```",
        "prose with `tpcheck check --tp 1,2 --no-such",
        "option` wrapped",
    ])
    cmds = block_commands(text, "x.md") + inline_commands(text, "x.md")
    assert [c.where for c in cmds] == ["x.md:2", "x.md:4", "x.md:5", "x.md:6", "x.md:7", "x.md:9"]
    got = {c.where: command_problems(c.text, tree)[1] for c in cmds}
    assert got == {"x.md:2": ["--bogus-flag"], "x.md:4": ["--exact-ops"], "x.md:5": ["frobnicate"],
                   "x.md:6": ["--layer"], "x.md:7": [], "x.md:9": ["--no-such"]}
