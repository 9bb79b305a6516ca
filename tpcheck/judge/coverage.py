"""Coverage is part of the verdict: a run that compared nothing, or not the points that matter, is not a pass.

An engine map that reports no points, or reports them under names tpcheck does not know, would otherwise
"pass" every CI run (0 comparisons, none over the floor). So: a reported name that is not a canonical point
(``tpcheck.capture.points``) is an error naming it, and after the run every canonical point the engine never
reported is listed (``not_reported``); those matching ``require`` (default: the logits and every layer's
``out``) make the run fail with exit 3, as does a run with no comparison at all."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_REQUIRE = r"logits|layers\.\d+\.out"


class CoverageError(RuntimeError):
    """The engine did not report what the verdict needs (the CLI's exit 3)."""


def check_known(names: set[str], canonical: set[str]) -> None:
    """Raise naming every reported point name that is not canonical (a misconfigured engine map).
    ``canonical`` may be the points of a model without per-head q/k norms (``point_names`` by default): a
    family point (``attn.q_norm`` / ``attn.k_norm`` of one of its layers) is still a name tpcheck knows, and
    an engine reports it only where the model has it (the golden decides what is compared)."""
    unknown = sorted(n for n in names - canonical if not _family_point(n, canonical))
    if unknown:
        raise ValueError(f"the engine reported {len(unknown)} point name(s) tpcheck does not know: {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''} (canonical names: tpcheck.capture.points.point_names)")


def _family_point(name: str, canonical: set[str]) -> bool:
    """Whether ``name`` is a per-family point (``tpcheck.capture.points.QK_NORM_POINTS``) of a layer ``canonical`` has."""
    # here, not at the top: importing tpcheck.capture imports torch, and the parser reads DEFAULT_REQUIRE
    from tpcheck.capture.points import QK_NORM_POINTS, split_point
    layer, kind = split_point(name)
    return kind in QK_NORM_POINTS and f"layers.{layer}.out" in canonical


@dataclass
class Coverage:
    """Which canonical points (``expected``, in execution order) the engine reported and which it did not.
    ``expected`` is the model's own list (``tpcheck.capture.points.model_point_names``): a Llama model has no
    ``attn.q_norm``, so an engine that does not report one is not missing it."""

    expected: list[str]
    reported: set[str] = field(default_factory=set)
    require: str = DEFAULT_REQUIRE
    comparisons: int = 0
    # point -> golden rows the engine did not produce, over the run (vLLM computes logits only for the rows it
    # samples: at a prefill one per request); the rows it did produce are compared, named by position
    rows_not_produced: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        try:
            self._re = re.compile(self.require)
        except re.error as e:
            raise ValueError(f"--require-points {self.require!r} is not a regular expression: {e}") from None

    @property
    def not_reported(self) -> list[str]:
        return [n for n in self.expected if n not in self.reported]

    @property
    def missing_required(self) -> list[str]:
        return [n for n in self.not_reported if self._re.fullmatch(n)]

    @property
    def problem(self) -> str:
        """Why coverage fails the run ("" when it does not)."""
        if not self.comparisons:
            return "the engine reported no point: 0 comparisons"
        missing = self.missing_required
        if missing:
            return (f"the engine did not report {len(missing)} required point(s) ({self.require!r}): "
                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        return ""

    def as_meta(self) -> dict:
        return {"require_points": self.require, "comparisons": self.comparisons,
                "not_reported": self.not_reported, "missing_required": self.missing_required,
                "rows_not_produced": dict(self.rows_not_produced), "problem": self.problem}
