"""Which points a run compares (``--points`` / ``--layers``), as one regex."""
from __future__ import annotations

import re


def selection(points: str | None = None, layers: list[int] | tuple[int, ...] | None = None) -> str | None:
    """One regex of the points to compare: those ``points`` (a regex) fullmatches, within decoder ``layers``
    when given (the embedding, final norm and logits are then left out); None: every point."""
    if layers is not None and not layers:
        raise ValueError("--layers selects no layer")
    in_layers = None if layers is None else r"layers\.(?:%s)\..+" % "|".join(str(i) for i in sorted(set(layers)))
    if points is not None:
        try:
            re.compile(points)
        except re.error as e:
            raise ValueError(f"--points {points!r} is not a regular expression: {e}") from None
    if in_layers and points:
        return f"(?={in_layers}$)(?:{points})"
    return in_layers or points
