"""How tpcheck reaches an engine under test: ``EngineAdapter``, the base class every engine's adapter derives from
(built-in engines: ``tpcheck.engines.registry``; a live engine from Python: ``tpcheck.pipeline.diff.compare_engine``).

An adapter runs the engine's TP ranks on a checkpoint and, for each step, returns its hook points as
``{name: (placement, [rank 0 tensor, rank 1 tensor, ...])}`` with canonical names (``tpcheck.capture.points``),
``[rows, features]`` tensors and ``impl.placements`` placements (a rank that does not hold a point gives
None). Points an engine does not report are not compared, and listed (``tpcheck.judge.coverage``).

Three methods are required (``begin``, ``step``, ``close``); every other member is an optional capability,
declared here with the default an adapter that lacks it gets, so the pipeline reads each one directly (the
adapter reference, ``docs/reference/adapter.md``, is generated from this class: ``python -m tpcheck.cli.adapter_reference``).
An object that follows the protocol without deriving from the class is wrapped by ``as_adapter``, which gives it
the same defaults."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tpcheck.capture.batches import StepBatch
from tpcheck.capture.points import point_stage
from tpcheck.capture.rounding import Rounding
from tpcheck.reference.reductions import Reductions

Points = dict[str, tuple[object, list[torch.Tensor | None]]]
Stages = tuple[tuple[int, int], ...]
NONE: Mapping = MappingProxyType({})  # the read-only empty default of a per-step mapping


def by_point(per_rank: list[dict]) -> Points:
    """Each rank's ``{name: (placement, tensor)}`` regrouped as ``{name: (placement, [rank 0, rank 1, ...])}``
    (None where a rank lacks the point)."""
    points: Points = {}
    for rank, pts in enumerate(per_rank):
        for name, (placement, t) in pts.items():
            points.setdefault(name, (placement, [None] * len(per_rank)))[1][rank] = t
    return points


class EngineAdapter(ABC):
    """An engine under test, driven step by step from one process (Polygraphy's ``BaseRunner`` is the model: one
    class, every capability declared with its default)."""

    reductions: Reductions | None = None
    """How the engine's row-parallel all-reduces round (``tpcheck.reference.reductions``): its tp and reduce dtype.
    The noise floor admits that rounding. None: the run notes it and judges against one-device HF only."""

    teacher_forcing: bool = False
    """``step`` honours ``teacher``. Then the default diff adds the local pass, where each layer's own error is
    judged against a floor that does not grow with depth."""

    takes_prefix: bool = False
    """The adapter implements ``take_prefix``; the local pass then runs each prompt's last rows alone
    (``tpcheck.pipeline.local_rows``)."""

    rounding: Rounding | None = None
    """The engine's declared rounding of activations (``tpcheck.capture.rounding``: to nearest, or truncated by
    vLLM's CPU kernels without hardware bfloat16). None: to nearest. ``--rounding`` overrides it."""

    cpu_bf16_rounding: bool | None = None
    """Whether the CPU the engine's kernels run on converts float32 to bfloat16 in hardware, recorded in a
    ``--dump`` written from the driver (``tpcheck.engines.dump.dumping``). None: not known, not recorded."""

    stages: Stages | None = None
    """``--pp``: each pipeline stage's decoder layers ``[start, end)`` (each row then names the stage that reported
    its point, ``point_stage``). None: one stage."""

    point_rows: Mapping[str, list[int]] = NONE
    """After each ``step``: ``{point: flat row indices}`` of the points that hold only some of the step's rows
    (vLLM's ``logits``: the sampled rows); the golden and the references are compared at those rows. A point
    not named holds every row."""

    point_notes: Mapping[str, str] = NONE
    """After each ``step``: the engine's own findings about a point (a pipeline hand-off that arrived changed),
    put first in the point's row note; a note fails the row."""

    def point_stage(self, name: str, stages: Stages) -> int:
        """The pipeline stage whose ranks report point ``name`` (default ``tpcheck.capture.points.point_stage``: the
        stage that holds its layer; vLLM reports a stage's last ``out`` on the next stage, in its fused norm)."""
        return point_stage(name, stages)

    def schedule(self, step: int) -> StepBatch | None:
        """The requests, tokens and positions the engine ran at ``step`` (a replayed dump: the golden replays them
        instead of its own greedy choice). None (the default): a live engine, fed the golden's greedy tokens."""
        return None

    def lacking(self, names: list[str]) -> dict[str, int] | None:
        """A replayed dump: ``{point: the first step}`` of each of ``names`` some step does not record at every
        row (its local pass forces the golden onto every layer's recorded ``out``, so it needs them all). None (the
        default): not a replay, the local pass is teacher forcing (``teacher_forcing``)."""
        return None

    def take_prefix(self, lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """With ``takes_prefix``, before the first step: write each sequence's first ``lens[b]`` positions into its
        KV cache (``kv[layer]``: keys after RoPE and values, ``[sum(lens), kv_heads * head_dim]``); the first step
        then starts there. Called only where ``takes_prefix`` is set."""
        raise NotImplementedError(f"{type(self).__name__} does not take a KV-cache prefix (takes_prefix is False)")

    @abstractmethod
    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        """Start fresh sequences (one per prompt) with room for ``decode_steps`` more tokens each."""

    @abstractmethod
    def step(self, new_tokens: list[list[int]], teacher: dict[int, torch.Tensor] | None,
             capture_kv: bool) -> Points:
        """Feed each sequence its new tokens (the whole prompt first, then one token per decode step) and return
        the step's points. ``teacher`` (the local pass): ``{layer i: input of decoder layer i, num_layers: input of
        the final norm}``, full ``[rows, hidden]`` tensors the engine should use in place of its own.
        ``capture_kv``: also return ``layers.{i}.kv.k`` / ``.kv.v``, the cache read back at every position."""

    @abstractmethod
    def close(self) -> None:
        """Release what ``begin`` took; leave the engine reusable."""


#: the optional members, in the order the reference lists them (``tpcheck.cli.adapter_reference``)
CAPABILITIES: tuple[str, ...] = ("reductions", "teacher_forcing", "takes_prefix", "rounding", "cpu_bf16_rounding",
                                 "stages", "point_rows", "point_notes", "point_stage", "schedule", "lacking",
                                 "take_prefix")


class ProtocolAdapter(EngineAdapter):
    """An object that has ``begin`` / ``step`` / ``close`` without deriving from ``EngineAdapter`` (a duck-typed
    adapter, as the protocol was before the base class), delegated to explicitly: each capability is the object's
    own where it has one (read when used: ``point_rows`` and ``point_notes`` change every step), else
    ``EngineAdapter``'s default."""

    def __init__(self, inner):
        self.inner = inner

    def _own(self, name: str):
        return getattr(self.inner, name, getattr(EngineAdapter, name))

    reductions = property(lambda self: self._own("reductions"))
    teacher_forcing = property(lambda self: bool(self._own("teacher_forcing")))
    takes_prefix = property(lambda self: bool(self._own("takes_prefix")))
    rounding = property(lambda self: self._own("rounding"))
    cpu_bf16_rounding = property(lambda self: self._own("cpu_bf16_rounding"))
    stages = property(lambda self: self._own("stages"))
    point_rows = property(lambda self: self._own("point_rows") or NONE)
    point_notes = property(lambda self: self._own("point_notes") or NONE)

    def point_stage(self, name: str, stages: Stages) -> int:
        own = getattr(self.inner, "point_stage", None)
        return point_stage(name, stages) if own is None else own(name, stages)

    def schedule(self, step: int) -> StepBatch | None:
        own = getattr(self.inner, "schedule", None)
        return None if own is None else own(step)

    def lacking(self, names: list[str]) -> dict[str, int] | None:
        own = getattr(self.inner, "lacking", None)
        return None if own is None else own(names)

    def take_prefix(self, lens, kv) -> None:
        self.inner.take_prefix(lens, kv)

    def begin(self, prompts, decode_steps) -> None:
        self.inner.begin(prompts, decode_steps)

    def step(self, new_tokens, teacher, capture_kv) -> Points:
        return self.inner.step(new_tokens, teacher, capture_kv)

    def close(self) -> None:
        self.inner.close()


def as_adapter(engine) -> EngineAdapter:
    """``engine`` itself where it derives from ``EngineAdapter``; else a ``ProtocolAdapter`` over it (idempotent:
    the pipeline's entry points and the helpers that take an engine call it)."""
    return engine if isinstance(engine, EngineAdapter) else ProtocolAdapter(engine)
