"""The errors impl raises for a checkpoint config or engine setting it refuses (``ConfigError``) and for a checkpoint
tensor of the wrong shape (``ShapeMismatch``, ``check_shape``), in a module of their own so that every config reader
(``impl.config``, ``impl.moe_config``) and every weight loader (``impl.layers``, ``impl.quant``) can raise them
without importing each other; ``impl.config`` and ``impl.layers.linear`` re-export them."""
from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint config or engine setting that impl refuses, with the numbers in the message."""


class ShapeMismatch(ValueError):
    """Checkpoint tensor shape differs from what the layer expects; the loader adds the tensor name."""


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    got = tuple(loaded.shape)
    if got != tuple(expected):
        raise ShapeMismatch(f"checkpoint shape {list(got)} != expected {list(expected)}")
