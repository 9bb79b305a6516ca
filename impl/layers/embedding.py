"""Vocab-parallel embedding and LM head.

The vocab ``V`` is padded to ``Vp = round_up(round_up(V, 64), tp)`` (vLLM's padding of 64) and rank r owns
rows ``[r*Vp/tp, (r+1)*Vp/tp)``. Rows past the real vocab are zero and never selected.

* Embedding: ids outside the rank's range are masked (looked up as row 0, then zeroed), every rank
  contributes its rows, one all-reduce sums them: output ``Replicate``.
* LM head: rank r computes logits for its rows (``Shard(-1)`` of the padded vocab); they are gathered on
  rank 0 and the padding columns stripped, so the driver sees ``[T, V]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import batch_invariant
from impl.distributed import all_reduce, gather, get_tp_rank, get_tp_size
from impl.layers.linear import check_shape
from impl.placements import Replicate, Shard

from impl.shard_plan import VOCAB_PADDING, padded_vocab_size  # noqa: F401 - the rule lives in shard_plan


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.padded_size = padded_vocab_size(vocab_size, self.tp_size)
        self.rows = self.padded_size // self.tp_size
        self.start = self.tp_rank * self.rows
        self.end = self.start + self.rows
        # zeros, not empty: the padding rows must hold defined values even though no id selects them
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.output_placement = Replicate()

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        check_shape(loaded, (self.vocab_size, param.shape[1]))
        n = max(0, min(self.end, self.vocab_size) - self.start)  # real (unpadded) rows this rank owns
        param.data.zero_()
        if n:
            param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """``logits = h W^T`` over the rank's vocab rows; full ``[T, V]`` logits on rank 0, None elsewhere.
    With tied embeddings the model passes the embedding's parameter in place of its own."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__(vocab_size, hidden_size, dtype)
        self.output_placement = Shard(-1)  # local logits before the gather, padding included

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(hidden, lambda rows: F.linear(rows, self.weight))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        full = gather(self.local_logits(hidden), dim=-1, dst=0)
        return None if full is None else full[..., : self.vocab_size]
