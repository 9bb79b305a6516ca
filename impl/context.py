"""Attention metadata for one forward pass over a flattened, ragged batch (no padding compute).

Tokens of all sequences are concatenated: ``input_ids`` and ``positions`` are ``[T]`` with
``T = sum(seq_lens_q)``. Sequence i contributes ``seq_lens_q[i]`` new tokens and attends over
``seq_lens_k[i]`` keys (cached prefix + its new tokens). The model runner sets the context before a
forward and clears it after; ``Attention`` reads it (nano-vllm's pattern: one place, no argument plumbing)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Context:
    seq_lens_q: list[int]
    seq_lens_k: list[int]
    slot_mapping: torch.Tensor | None = None  # [T] cache slot of each new token; None: no KV cache
    block_tables: torch.Tensor | None = None  # [B, max_blocks]; None: attend over the new tokens only

    @property
    def is_decode(self) -> bool:
        return self.block_tables is not None and all(n == 1 for n in self.seq_lens_q)


_CTX: Context | None = None


def set_context(ctx: Context | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> Context:
    if _CTX is None:
        raise RuntimeError("no attention context: the model must be run through the model runner")
    return _CTX
