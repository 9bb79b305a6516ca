"""argparse types shared by the subcommands: comma-separated lists and regular expressions."""
from __future__ import annotations

import argparse
import re


def int_list(text: str, minimum: int | None = None) -> list[int]:
    """argparse type for ``1,2,4``: a non-empty list of integers (each >= ``minimum`` when given)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or (minimum is not None and any(v < minimum for v in values)):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers{f' >= {minimum}' if minimum is not None else ''}, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    return int_list(text, 1)


def regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return text


def name_list(text: str) -> list[str]:
    """argparse type for ``tiny,tiny-mqa``: the non-empty comma-separated names."""
    return [x.strip() for x in text.split(",") if x.strip()]
