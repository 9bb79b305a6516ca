"""The docs site says true things and builds.

* Every shell command on a docs page runs as written (a fresh directory per page, the page's blocks in order), or
  its block is marked with why it cannot run here (``tests/doc_commands.py`` defines the markers); a block with no
  language that holds commands is refused (it would escape both). README.md's commands: ``tests/test_readme.py``.
* ``pip install`` lines name extras that ``pyproject.toml`` defines.
* The worked name map of ``docs/guides/engine.md`` is real: it builds, its dry run says what the page says, and it
  hooks every point it reports on the page's module tree.
* ``docs/reference/cli.md`` is what ``tpcheck.cli.reference`` renders from the parser ``tpcheck`` runs.
* ``mkdocs build --strict`` passes (every page in the nav, every link and anchor resolved), where mkdocs is
  installed (``pip install -e '.[docs]'``)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import MARKERS, ROOT, blocks, expected_exit, run_page, shell_blocks, unlabelled_command_blocks

PAGES = sorted((ROOT / "docs").rglob("*.md"))
ALL = [ROOT / "README.md", *PAGES]
RUNNABLE = [p for p in PAGES if any(not b.needs for b in shell_blocks(p))]


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_markers_are_known():
    bad = [f"{b.where}: {sorted(b.needs - MARKERS)}" for p in ALL for b in shell_blocks(p) if b.needs - MARKERS]
    assert not bad, f"unknown needs: markers (known: {sorted(MARKERS)}):\n" + "\n".join(bad)


def test_no_unlabelled_command_blocks():
    bad = [x for p in ALL for x in unlabelled_command_blocks(p)]
    assert not bad, "a block of commands must be labelled ```bash (then it is run, or marked):\n" + "\n".join(bad)


def test_the_guides_run_most_of_their_commands():
    # marking everything would pass the run test vacuously: the newcomer's paths must be run
    for page in ("index.md", "guides/checkpoint.md", "guides/engine.md", "guides/ci.md", "guides/advanced.md"):
        assert ROOT / "docs" / page in RUNNABLE, page
    n = sum(len(b.commands()) for p in RUNNABLE for b in shell_blocks(p) if not b.needs)
    assert n >= 25, n


def test_pip_extras_exist():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {(f"{b.where}", e) for p in ALL for b in shell_blocks(p) for _, c in b.commands() if "pip install" in c
             for group in re.findall(r"\.\[([\w,-]+)\]", c) for e in group.split(",")}
    assert named, "no pip install line with an extra found"
    missing = sorted(f"{w}: {e}" for w, e in named if e not in extras)
    assert not missing, f"extras not in pyproject.toml ({sorted(extras)}):\n" + "\n".join(missing)


@pytest.mark.parametrize("page", RUNNABLE, ids=_rel)
def test_page_commands_run(page, tmp_path):
    failures = run_page(page, tmp_path)
    assert not failures, "\n\n".join(failures)


def test_engine_guide_name_map():
    """The page's two Python blocks run as written; the map reports every canonical point but the KV cache (what
    the page prints), and installing it on the page's module tree hooks a site for each."""
    from tpcheck.capture.points import point_names
    text = (ROOT / "docs" / "guides" / "engine.md").read_text()
    code = [b for b in blocks(text, "engine.md") if b.lang == "python"][:2]
    ns: dict = {}
    for b in code:
        exec(compile("\n".join(line for _, line in b.lines), b.where, "exec"), ns)
    m = ns["MY_MAP"]
    kv = [n for n in point_names(2, with_kv=True) if ".kv." in n]
    assert m.not_reported(2, with_kv=True) == kv
    assert f"# {kv}" in text.replace('"', "'")  # the page prints what the map says
    cap = ns["capture"].install(ns["MyModel"](), m)
    hooked = {s.name + part for s in cap.sites for part in (s.rule.parts or ("",))}
    cap.remove()
    assert set(m.reports(2)) <= hooked, set(m.reports(2)) - hooked


def test_cli_reference_matches_the_parser():
    from tpcheck.cli.reference import render
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == render(), ("docs/reference/cli.md differs from the parser: run "
                              "`python -m tpcheck.cli.reference > docs/reference/cli.md`")
    assert "## `tpcheck faults matrix`" in page and "`--tp TP`" in page


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300,
                       env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "guides" / "engine" / "index.html").is_file()
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [_rel(p) for p in PAGES if p.relative_to(ROOT / "docs").as_posix() not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


# ---- the checkers can fail ---------------------------------------------------------------------------------
def test_checkers_catch_bad_pages(tmp_path):
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("\n".join([
        "<!-- needs: vllm -->", "```bash", "false", "```", "",
        "```bash", "true  # exit 0", "bash -c 'exit 1'   # exit 1", "echo a \\", "  b > out.txt", "```", "",
        "```", "tpcheck diff --tp 2", "```", "",
        "```bash", "cat out.txt", "false", "echo never", "```",
    ]))
    import doc_commands
    old = doc_commands.ROOT
    doc_commands.ROOT = tmp_path
    try:
        sb = shell_blocks(page)
        assert [b.needs for b in sb] == [{"vllm"}, set(), set()]
        assert sb[1].commands() == [(7, "true  # exit 0"), (8, "bash -c 'exit 1'   # exit 1"), (9, "echo a  b > out.txt")]
        assert [expected_exit(c) for _, c in sb[1].commands()] == [0, 1, 0]
        assert unlabelled_command_blocks(page) == ["docs/p.md:13: 'tpcheck diff --tp 2'"]
        failures = run_page(page, tmp_path)
    finally:
        doc_commands.ROOT = old
    assert len(failures) == 1 and failures[0].startswith("docs/p.md:19: exit 1, the page says 0: false"), failures
    assert (tmp_path / "out.txt").read_text() == "a b\n"
