"""Progress bars with an ETA for long commands (diff steps, sweep configurations, fault-matrix runs), on stderr.

A bar (tqdm) is shown only when stderr is a terminal and the ``tpcheck`` logger shows INFO (the CLI without
``--quiet``); otherwise nothing is drawn and the INFO lines alone say what is happening (CI logs, pipes).
``LogHandler`` writes log lines through ``tqdm.write`` so a line does not tear a bar apart."""
from __future__ import annotations

import logging
import sys

from tqdm import tqdm

logger = logging.getLogger("tpcheck")


def shown(stream=None) -> bool:
    """Whether a bar would be drawn: ``stream`` (default stderr) is a terminal and tpcheck logs at INFO."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and logger.isEnabledFor(logging.INFO)


def bar(total: int, desc: str, unit: str = "step") -> tqdm:
    """A bar of ``total`` ``unit``s (``update(n)`` as they finish; use it as a context manager), or a disabled
    one that draws nothing (``shown()``)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not shown(), leave=False,
                dynamic_ncols=True, bar_format="{desc}: {n_fmt}/{total_fmt} {unit}s |{bar}| {elapsed}<{remaining}")


class LogHandler(logging.StreamHandler):
    """tpcheck's CLI handler: INFO lines to stderr, above any progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise (logging.Handler's own contract)
            self.handleError(record)
