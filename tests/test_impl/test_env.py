"""``impl.env.env_number``: the one reader of a number from an environment variable; any bad value names the
variable, the rule and the value."""
from __future__ import annotations

import pytest

from impl.env import env_number


@pytest.mark.parametrize("raw,kw,want", [
    (None, {}, None), ("", {}, None), ("1.5", {}, 1.5), ("0", {}, 0.0), ("3", {"integer": True}, 3),
    (" 7 ", {"integer": True, "minimum": 1}, 7),
])
def test_good_values(monkeypatch, raw, kw, want):
    if raw is None:
        monkeypatch.delenv("IMPL_TEST_N", raising=False)
    else:
        monkeypatch.setenv("IMPL_TEST_N", raw)
    assert env_number("IMPL_TEST_N", **kw) == want


@pytest.mark.parametrize("raw,kw,rule", [
    ("inf", {}, "a finite number"), ("nan", {}, "a finite number"), ("-inf", {}, "a finite number"),
    ("lots", {"what": "MiB"}, "a finite number of MiB >= 0"), ("-1", {}, ">= 0"),
    ("1.5", {"integer": True}, "an integer"), ("0", {"integer": True, "minimum": 1}, "an integer >= 1"),
    ("1e999", {}, "a finite number"),
])
def test_bad_values_name_the_variable(monkeypatch, raw, kw, rule):
    monkeypatch.setenv("IMPL_TEST_N", raw)
    with pytest.raises(ValueError) as e:
        env_number("IMPL_TEST_N", **kw)
    assert str(e.value).startswith(f"IMPL_TEST_N={raw!r} must be ") and rule in str(e.value), str(e.value)
