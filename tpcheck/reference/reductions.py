"""The rounding a correct tensor-parallel engine adds, emulated on one device: the noise floor's TP reference.

A row-parallel linear (``o_proj``, ``down_proj``) on ``tp`` ranks computes ``y = sum_r x_r W_r^T``: each
rank's partial product is rounded to the engine's dtype, then the all-reduce adds the partials in that
dtype. One device computes the same sum inside one GEMM (float32 accumulation, one rounding at the end).
With outlier channels (trained weights: residual values in the hundreds) the ``tp`` extra roundings are
large in bfloat16/float16, so "no worse than HF on one device" fails correct engines. The diff therefore
judges each point against the worse of two references: HF at the dtype as it is, and HF at the dtype with
every row-parallel linear computed by ``row_parallel_linear`` (partials in rank order, summed left to
right). The other TP collectives round nothing: the vocab-parallel embedding's all-reduce adds one row and
``tp - 1`` zeros per token (``x + 0`` is exact in any float format), and gathers (column-parallel
outputs, the LM head) only move values."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from impl.config import parse_dtype


@dataclass(frozen=True)
class Reductions:
    """How an engine's row-parallel all-reduces round. ``tp``: ranks in the reduction; ``dtype``: the dtype
    of the partial products and of their sum (None: the activations' dtype, as impl, vLLM and SGLang do
    with a bfloat16 all-reduce). An engine that reduces in float32 declares ``dtype="float32"``: its
    partials are not rounded to bfloat16 and its reference error, hence its floor, is tighter."""

    tp: int = 1
    dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"Reductions.tp must be a positive int, got {self.tp!r}")
        if self.dtype is not None:
            parse_dtype(self.dtype)  # a clear error for an unknown dtype name

    @property
    def emulated(self) -> bool:
        """Whether a reference with these reductions differs from plain one-device HF."""
        return self.tp > 1


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        red: Reductions) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``red.tp`` ranks compute it: ``W[out, in]`` split along
    ``in`` into ``tp`` contiguous blocks, rank r's partial ``x[..., block r] @ W[:, block r]^T`` in the
    reduce dtype (the bias added once, by rank 0), the partials summed in rank order in the reduce dtype,
    the result in ``x``'s dtype."""
    n, tp = x.shape[-1], red.tp
    if n % tp:
        raise ValueError(f"row-parallel input width {n} is not divisible by tp={tp}")
    rd = parse_dtype(red.dtype) if red.dtype is not None else x.dtype
    xs, ws, w = x.to(rd), weight.to(rd), n // tp
    acc = None
    for r in range(tp):
        part = F.linear(xs[..., r * w:(r + 1) * w], ws[:, r * w:(r + 1) * w],
                        bias.to(rd) if bias is not None and r == 0 else None)
        acc = part if acc is None else acc + part
    return acc.to(x.dtype)
