"""A vLLM pipeline stage inside a rank (``tpcheck.engines.vllm.pp`` for ``tpcheck diff --engine vllm --pp``,
``tpcheck.engines.vllm.plugin`` for ``TPCHECK_DUMP``): the decoder layers the stage holds (``stage_range``) and
its hand-off points (``StageHandoffs``, on ``tpcheck.capture.stages.HandoffHooks``)."""
from __future__ import annotations

from tpcheck.capture.stages import HandoffHooks


def stage_range(model) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` that this rank's pipeline stage holds (vLLM's ``get_pp_indices``, as
    its model recorded them); every layer without pipeline parallelism."""
    inner = model.model
    return int(getattr(inner, "start_layer", 0)), int(getattr(inner, "end_layer", len(inner.layers)))


class StageHandoffs(HandoffHooks):
    """A vLLM stage's hand-offs (``HandoffHooks``) on its model (``Qwen2ForCausalLM`` and the like: called with
    ``intermediate_tensors``, a stage before the last returning them), for the stage's own boundaries
    (``stage_range``); none on a one-stage model, nor for a hand-off the ``points`` regex (``--points``) does not
    keep."""

    def __init__(self, model, points: str | None = None):
        start, end = stage_range(model)
        super().__init__(model, start - 1 if start > 0 else None, end - 1 if end < len(model.model.layers) else None,
                         "intermediate_tensors", points)
