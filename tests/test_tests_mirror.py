"""The tests of ``tpcheck`` mirror its packages, so the tests of a module are found by the module's name:

* ``tests/test_tpcheck/<package>/`` holds the tests of ``tpcheck/<package>/`` (``engines/<engine>/`` those of
  ``tpcheck/engines/<engine>/``, and ``engines/base/`` those of the modules directly in ``tpcheck/engines/``:
  the adapter base class, the pool, the registry);
* the files directly in ``tests/test_tpcheck/`` test a top-level module of ``tpcheck`` (``ROOT_TESTS``);
* no test file sits directly in ``tests/test_tpcheck/engines/``: pytest (its default import mode) puts a test file's
  folder on ``sys.path``, and that folder's ``vllm/`` and ``impl/`` would then import as empty namespace packages in
  place of a missing vLLM (a test that should skip would fail) or shadow nothing useful;
* every test file's name is unique under ``tests/`` (the same import mode imports each by its bare name).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "test_tpcheck"
#: test files directly in tests/test_tpcheck/ -> the top-level module of tpcheck they test
ROOT_TESTS = {"test_options.py": "options.py", "test_progress.py": "progress.py", "test_plugin.py": "pytest_plugin.py"}


def _mirror_violations(tests: Path, package: Path) -> list[str]:
    """Every way the test tree ``tests`` fails to mirror ``package`` (the rules of this module's docstring)."""
    bad = []
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests)
        folder = rel.parent.as_posix()
        if folder == ".":
            if rel.name not in ROOT_TESTS or not (package / ROOT_TESTS[rel.name]).is_file():
                bad.append(f"{rel}: directly in {tests.name}/ but tests no top-level module (ROOT_TESTS)")
        elif folder == "engines":
            bad.append(f"{rel}: directly in engines/ (put it in engines/<engine>/ or engines/base/)")
        elif folder != "engines/base" and not (package / folder / "__init__.py").is_file():
            bad.append(f"{rel}: {folder}/ mirrors no package of {package.name}/")
    names = Counter(f.name for f in tests.parent.rglob("test_*.py"))
    bad += [f"{n}: {c} test files of that name under tests/" for n, c in names.items() if c > 1]
    return bad


def test_tests_mirror_the_packages():
    bad = _mirror_violations(TESTS, ROOT / "tpcheck")
    assert not bad, "\n".join(bad)


def test_the_mirror_check_sees_each_kind(tmp_path):
    """A flat test, one in ``engines/``, one under a folder no package has and a repeated name are each named."""
    pkg, tests = tmp_path / "pkg", tmp_path / "tests" / "test_pkg"
    for d in ("judge", "engines/vllm"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "options.py").write_text("")
    for f in ("test_options.py", "test_flat.py", "engines/test_e.py", "nowhere/test_n.py", "judge/test_j.py",
              "engines/vllm/test_j.py", "engines/base/test_pool.py"):
        (tests / f).parent.mkdir(parents=True, exist_ok=True)
        (tests / f).write_text("")
    bad = _mirror_violations(tests, pkg)
    assert [b.split(":")[0] for b in bad] == ["engines/test_e.py", "nowhere/test_n.py", "test_flat.py", "test_j.py"], bad
