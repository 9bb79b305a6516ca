"""Pipeline parallelism: how the decoder layers split into ``pp`` contiguous stages, each stage a TP group.

World layout (vLLM's): ``world = pp * tp`` processes, global rank ``g = stage * tp + tp_rank``; stage ``s`` holds
decoder layers ``[start_s, end_s)`` (``stage_range``). Stage 0 also holds the embedding, the last stage the final
norm and the LM head (with tied embeddings the last stage reads ``model.embed_tokens.weight`` into its own LM
head, as vLLM does). Between stages, TP rank ``r`` of stage ``s`` sends its (replicated) ``IntermediateTensors``
to TP rank ``r`` of stage ``s + 1``: ``hidden_states`` (the boundary layer's MLP output) and ``residual`` (the
stream before that MLP add); the receiving stage starts from ``residual + hidden_states``, the very add the
boundary layer would have done, so a pipelined forward gives the same numbers as one stage."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from impl.errors import ConfigError

# vLLM's names for what crosses a stage boundary (vllm.sequence.IntermediateTensors), in the order they are sent
INTERMEDIATE_NAMES = ("hidden_states", "residual")


def parse_partition(text: str) -> tuple[int, ...]:
    """``"3,3,2"`` -> ``(3, 3, 2)``: layers per stage, as vLLM's ``VLLM_PP_LAYER_PARTITION``."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"pp_partition {text!r} is not comma-separated layer counts (e.g. '3,3,2')") from None


def layer_partition(num_layers: int, pp: int, partition: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage. ``partition`` None: vLLM's rule (``vllm.distributed.utils.get_pp_indices``):
    ``num_layers // pp`` each, and the remainder one each to the stages before the last, counting back from the
    second-to-last (``partitions[-i] += 1`` for ``i`` in ``2 .. remainder + 1``), since the last stage carries the
    final norm and LM head. An explicit ``partition`` must name ``pp`` stages that together hold every layer once
    (counts summing to ``num_layers``); unlike vLLM, a stage of no layers is refused (it would only forward)."""
    if pp < 1:
        raise ConfigError(f"pp_size must be >= 1, got {pp}")
    if pp > num_layers:
        raise ConfigError(f"pp_size={pp} exceeds num_hidden_layers={num_layers}: every stage needs a layer")
    if partition is None:
        parts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            parts[-i] += 1
        return tuple(parts)
    parts = list(parse_partition(partition) if isinstance(partition, str) else partition)
    if len(parts) != pp:
        raise ConfigError(f"pp_partition {parts} names {len(parts)} stages, pp_size is {pp}")
    if any(not isinstance(n, int) or n < 1 for n in parts):
        raise ConfigError(f"pp_partition {parts}: every stage needs at least one layer")
    if sum(parts) != num_layers:
        raise ConfigError(f"pp_partition {parts} sums to {sum(parts)} layers, the model has num_hidden_layers="
                          f"{num_layers} (a partition must hold every layer exactly once)")
    return tuple(parts)


def pipeline_shape(pp: int | str | Sequence[int]) -> tuple[int, tuple[int, ...] | None]:
    """(stages, explicit partition or None) of an engine's ``pp_size``: a stage count (layers split by vLLM's
    rule), or the layers per stage (``"3,3,2"`` or ``(3, 3, 2)``), as many stages as it names."""
    if isinstance(pp, bool) or not isinstance(pp, (int, str, tuple, list)):
        raise ConfigError(f"pp_size must be a stage count or layers per stage ('3,3,2'), got {pp!r}")
    if isinstance(pp, int):
        return pp, None
    parts = parse_partition(pp) if isinstance(pp, str) else tuple(pp)
    return len(parts), parts


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index of ``size`` and the global decoder layers ``[start, end)`` it runs."""

    index: int
    size: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer < self.end


def stage_of(partition: Sequence[int], index: int) -> Stage:
    """Stage ``index`` of a ``layer_partition``."""
    start = sum(partition[:index])
    return Stage(index, len(partition), start, start + partition[index])


def single_stage(num_layers: int) -> Stage:
    """The one stage of a model run without pipeline parallelism."""
    return Stage(0, 1, 0, num_layers)


class PPMissingLayer(nn.Identity):
    """The placeholder of a module another stage holds (vLLM's ``PPMissingLayer``): keeps the global module
    names (``model.layers.{i}``) of the layers that are here; has no parameters and is never called."""
