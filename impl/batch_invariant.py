"""Batch-invariant mode: a request's every tensor, bit for bit, whatever else runs in its batch and at whichever
slot (``LLM(batch_invariant=True)``, ``python -m impl generate --batch-invariant``).

What makes a request's bits depend on its batch in the default mode, measured on this CPU build of torch
(``docs/invariance.md``):

* **GEMMs over the concatenated batch.** A linear layer multiplies ``[T, K]`` rows, ``T`` the tokens of every
  sequence in the step; the BLAS picks its kernel and its blocking of the ``K`` reduction by the shape, so row ``i``
  of ``x W^T`` changes in its last bits with ``T`` (float32: ``T = 1`` runs a GEMV, ``T >= 2`` GEMMs blocked by
  ``T``). In this mode every GEMM runs on blocks of exactly ``ROWS`` rows (the last one zero-padded): each block has
  the same shape, so the same kernel and the same reduction order, and a row's result depends on its own values
  only (checked: neither its place in the block nor its neighbours change it; ``tests/test_impl``).
* **Decode attention over a padded batch.** The default decode gathers every sequence's keys into one
  ``[B, max_len]`` batch under a mask; SDPA's blocking then depends on ``B`` and ``max_len``. Here each sequence
  attends alone over exactly its own keys, as a prefill of one query does.

* **Element-wise ops on a narrow tensor.** A MoE block's shared-expert gate is ``sigmoid`` of a ``[T, 1]`` logit:
  the CPU kernel computes full vectors one way and the tail past the last full vector another, so a row's bits
  depend on ``T`` and its place in the step. Here it runs on blocks of ``ROWS`` rows (``rowwise``).

What is row-wise already and stays as it is: RMSNorm (a mean over one row's hidden dim), RoPE, activations, the
embedding gather, the residual adds, the sampler (each row on its own generator: ``impl.sampler``).

What this mode does *not* give: invariance across TP sizes (a row-parallel layer's all-reduce adds ``tp`` partial
sums, each over ``K / tp`` of the reduction: tp 1 and tp 2 add in other orders, so their bits differ unless the
reduction itself were computed in one fixed order over ``K`` whatever ``tp``), nor across chunked and whole
prefills (a chunk's queries are another SDPA shape). Both are measured, not promised (``tpcheck invariance``).

The switch is per process (each TP rank is one): ``set_enabled`` from ``ModelRunner.set_batch_invariant``."""
from __future__ import annotations

from typing import Callable

import torch

ROWS = 16  # the rows of every GEMM in this mode (a fixed shape: one kernel, one reduction order)

_enabled = False


def enabled() -> bool:
    """Whether this process runs in batch-invariant mode."""
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def fixed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (``[T, ...] -> [T, ...]``, row ``i`` of the output a function of row ``i``
    of the input alone, e.g. a linear layer) computed on blocks of exactly ``rows`` rows, the last block padded
    with zero rows (dropped from the result): every call of ``fn`` sees the same leading size whatever ``T``."""
    n = x.shape[0]
    if n == 0:
        return fn(x)
    pad = -n % rows
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    out = torch.cat([fn(x[i:i + rows]) for i in range(0, x.shape[0], rows)])
    return out[:n]


def linear(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` (a GEMM over ``x``'s rows; ``x`` of any leading shape, flattened to rows and back): in blocks of
    ``ROWS`` rows in batch-invariant mode, in one call otherwise."""
    if not _enabled:
        return fn(x)
    lead = x.shape[:-1]
    out = fixed_rows(fn, x.reshape(-1, x.shape[-1]))
    return out.reshape(*lead, out.shape[-1])


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn`` with a vector and a scalar path (``torch.sigmoid``: the CPU kernels
    compute the vector's lanes and the scalar tail of a tensor by other formulas, so an element's bits depend on
    where it falls in the whole tensor): in batch-invariant mode on blocks of exactly ``ROWS`` rows, each the same
    size whatever the batch; in one call otherwise."""
    return fixed_rows(fn, x) if _enabled else fn(x)
