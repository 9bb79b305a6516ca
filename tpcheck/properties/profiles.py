"""Hypothesis profiles for tpcheck's property tests, chosen by an environment variable, and the count of
property examples a test run executed.

Profiles (``HYPOTHESIS_PROFILE=<name>`` or ``TPCHECK_PROFILE=<name>``; the first one set wins; default
``dev``):

* ``dev``: quick local runs, a few examples per property; failures saved in ``.hypothesis/`` and replayed
  first on the next run.
* ``ci``: what ``.ci/run`` uses: bounded so the whole suite stays within its budget on 2 cores,
  ``derandomize=True`` (every CI run draws the same examples; Hypothesis then keeps no database).
* ``thorough``: a longer local or scheduled run; twenty times ``ci``'s examples, random seeds, database kept.

Every profile has ``deadline=None`` (a forward pass at tp 4 on a loaded machine takes what it takes) and
suppresses the ``too_slow`` / ``data_too_large`` / ``function_scoped_fixture`` health checks. Property
tests size themselves from the profile with ``examples(weight)``: ``weight * max_examples``.

Importing this module registers and loads the profile. As a pytest plugin (``pytest_plugins =
["tpcheck.properties.profiles"]`` in ``conftest.py``) it also collects ``record_examples(...)`` from every
test, across pytest-xdist workers, prints the total at the end of the run and writes it to
``reports/property_examples.txt``."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

ENV_VARS = ("HYPOTHESIS_PROFILE", "TPCHECK_PROFILE")
DEFAULT_PROFILE = "dev"
DATABASE_DIR = Path(".hypothesis") / "examples"   # relative to the directory pytest runs in (git-ignored)

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])

PROFILES: dict[str, dict] = {
    "dev": dict(_COMMON, max_examples=10),
    "ci": dict(_COMMON, max_examples=50, derandomize=True, database=None),
    "thorough": dict(_COMMON, max_examples=1000),
}


def _database():
    return DirectoryBasedExampleDatabase(str(DATABASE_DIR))


def register() -> None:
    for name, kw in PROFILES.items():
        kw = dict(kw)
        if "database" not in kw:
            kw["database"] = _database()
        settings.register_profile(name, **kw)


def selected_profile() -> str:
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return value
    return DEFAULT_PROFILE


def load() -> str:
    """Register the profiles and load the one the environment names; returns its name."""
    register()
    name = selected_profile()
    if name not in PROFILES:
        raise ValueError(f"{'/'.join(ENV_VARS)}={name!r}: unknown Hypothesis profile; expected one of "
                         f"{', '.join(PROFILES)}")
    settings.load_profile(name)
    return name


PROFILE = load()


def examples(weight: float = 1.0) -> int:
    """A property test's example budget under the loaded profile: ``weight * max_examples`` (at least 1)."""
    return max(1, round(weight * settings.default.max_examples))


# ---- the example count ------------------------------------------------------------------------------------

_COUNTS: dict[str, int] = {}
_KEY = "tpcheck_property_examples"


def record_examples(test: str, n: int) -> None:
    """Add ``n`` executed examples of property ``test`` to this process's count."""
    _COUNTS[test] = _COUNTS.get(test, 0) + int(n)


def recorded() -> dict[str, int]:
    return dict(_COUNTS)


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand this worker's counts to the controller
        workeroutput[_KEY] = json.dumps(_COUNTS)


def _pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", None) or {}
    for test, n in json.loads(out.get(_KEY, "{}")).items():
        record_examples(test, n)


try:  # only a hook where pytest-xdist is installed
    import pytest

    pytest_testnodedown = pytest.hookimpl(optionalhook=True)(_pytest_testnodedown)
except ImportError:  # pragma: no cover - imported outside pytest
    pass


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None or not _COUNTS:
        return
    total = sum(_COUNTS.values())
    detail = ", ".join(f"{t} {n}" for t, n in sorted(_COUNTS.items()))
    line = f"property examples: {total} (profile {PROFILE}): {detail}"
    terminalreporter.write_sep("-", line)
    try:
        path = Path(config.rootpath) / "reports" / "property_examples.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n" + json.dumps({"profile": PROFILE, "total": total, "per_test": _COUNTS},
                                                 sort_keys=True) + "\n")
    except OSError as e:  # a read-only checkout must not fail the run
        terminalreporter.write_line(f"(could not write reports/property_examples.txt: {e})")
