"""argparse types shared by the subcommands: comma-separated lists and regular expressions."""
from __future__ import annotations

import argparse
import re

MAX_INDEX = 10_000  # impl.config.MAX_LAYERS: no list of layer indices is longer


def int_list(text: str, minimum: int | None = None) -> list[int]:
    """argparse type for ``1,2,4``: a non-empty list of integers (each >= ``minimum`` when given)."""
    try:
        if len(text) > 100_000:
            raise ValueError(text[:20])
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or (minimum is not None and any(v < minimum for v in values)):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers{f' >= {minimum}' if minimum is not None else ''}, got {text!r}")
    return values


def int_ranges(text: str) -> list[int]:
    """argparse type for ``0,3,10-12``: integers >= 0 and inclusive ranges, in the order given."""
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers and ranges like 0,3,10-12, got {text!r}") from None
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a range a-b with 0 <= a <= b")
        if b >= MAX_INDEX or len(out) + b - a >= MAX_INDEX:  # never allocate from a user's number
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} goes beyond any model's layers (< {MAX_INDEX}); "
                                             "the model's own bound is checked when it is loaded")
        out += range(a, b + 1)
    if not out:
        raise argparse.ArgumentTypeError(f"expected integers and ranges like 0,3,10-12, got {text!r}")
    return out


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


DEVICE_NAMES = ("auto", "cpu", "cuda")  # and cuda:K (tpcheck.inputs.devices resolves them)


def device_name(text: str) -> str:
    """argparse type of ``--device`` / ``--golden-device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:K`` (checked
    against this machine's GPUs when resolved: ``tpcheck.inputs.devices.resolve_device``)."""
    name = text.strip().lower()
    head, sep, index = name.partition(":")
    if name in DEVICE_NAMES or (head == "cuda" and sep and index.isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"expected a device ({', '.join(DEVICE_NAMES)} or cuda:K), got {text!r}")


def add_device_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--device`` (``device_name``, default ``auto``) of a command that is not ``diff`` (whose flag is
    ``DiffOptions.device``'s): ``what`` runs there."""
    parser.add_argument("--device", type=device_name, default="auto", metavar="DEVICE",
                        help=f"where {what} run: auto (CUDA when there is a GPU), cpu, cuda or cuda:K")
