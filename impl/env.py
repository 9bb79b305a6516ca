"""The one reader of a number from an environment variable (impl's and tpcheck's): ``env_number(name)`` is the
variable's value checked to be a finite number (an integer where ``integer``) of at least ``minimum``, None when
unset or empty; anything else (text, inf, NaN, a negative or fractional count) is a ``ValueError`` naming the
variable, the rule and the value, never an ``OverflowError`` or an ``int()`` traceback later."""
from __future__ import annotations

import math
import os


def env_number(name: str, *, integer: bool = False, minimum: float = 0, what: str = "") -> float | int | None:
    """``os.environ[name]`` as a finite number ``>= minimum`` (an ``int`` when ``integer``); None when unset or
    empty. ``what``: the unit said in the error (e.g. "MiB")."""
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return None
    kind = "an integer" if integer else f"a finite number{f' of {what}' if what else ''}"
    try:
        value = int(raw, 10) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name}={raw!r} must be {kind} >= {minimum}")
    return value
