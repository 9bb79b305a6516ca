"""How tpcheck reaches an engine under test: the adapter protocol every engine implements (built-in engines:
``tpcheck.engines.registry``).

An adapter runs the engine's TP ranks on a checkpoint and, for each step, returns its hook points as
``{name: (placement, [rank 0 tensor, rank 1 tensor, ...])}`` with canonical names (``tpcheck.capture.points``),
``[rows, features]`` tensors and ``impl.placements`` placements (a rank that does not hold a point gives
None). Points an engine does not report are not compared, and listed (``tpcheck.judge.coverage``). See
``docs/adapters.md``."""
from __future__ import annotations

from typing import Protocol

import torch

from tpcheck.reference.reductions import Reductions

Points = dict[str, tuple[object, list[torch.Tensor | None]]]


def by_point(per_rank: list[dict]) -> Points:
    """Each rank's ``{name: (placement, tensor)}`` regrouped as ``{name: (placement, [rank 0, rank 1, ...])}``
    (None where a rank lacks the point)."""
    points: Points = {}
    for rank, pts in enumerate(per_rank):
        for name, (placement, t) in pts.items():
            points.setdefault(name, (placement, [None] * len(per_rank)))[1][rank] = t
    return points


class EngineAdapter(Protocol):
    reductions: Reductions
    """How the engine's row-parallel all-reduces round (``tpcheck.reference.reductions``): its tp and reduce dtype. The
    noise floor admits that rounding; an adapter without it is judged against one-device HF only."""

    teacher_forcing: bool
    """Optional (default False): ``step`` honours ``teacher``. Then the default diff adds the local pass, where each
    layer's own error is judged against a floor that does not grow with depth."""

    takes_prefix: bool
    """Optional (default False): the adapter has ``take_prefix(lens, kv)``, which writes each sequence's first
    ``lens[b]`` positions into its KV cache (``kv[layer]``: keys after RoPE and values, ``[sum(lens), kv_heads *
    head_dim]``) before the first step, which then starts there. The local pass then runs each prompt's last rows
    alone (``tpcheck.pipeline.local_rows``)."""

    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        """Start fresh sequences (one per prompt) with room for ``decode_steps`` more tokens each."""

    def step(self, new_tokens: list[list[int]], teacher: dict[int, torch.Tensor] | None,
             capture_kv: bool) -> Points:
        """Feed each sequence its new tokens (the whole prompt first, then one token per decode step).
        ``teacher`` (isolate mode): ``{layer i: input of decoder layer i, num_layers: input of the final
        norm}``, full ``[rows, hidden]`` tensors the engine should use in place of its own."""

    def close(self) -> None:
        """Release what ``begin`` took; leave the engine reusable."""
