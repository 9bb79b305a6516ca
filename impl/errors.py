"""The error impl raises for a checkpoint config or engine setting it refuses (``ConfigError``), in a module of its
own so that every config reader (``impl.config``, ``impl.moe_config``) can raise it without importing the other;
``impl.config`` re-exports it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint config or engine setting that impl refuses, with the numbers in the message."""
