"""Faults that strike around the TP collectives: the row-parallel all-reduces (o_proj, down_proj) and the
vocab-parallel embedding's masking before its all-reduce."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.distributed import all_reduce
from impl.pipeline import PPMissingLayer
from tpcheck.engines.impl.faults.patching import mark, seeded_randn
from tpcheck.engines.impl.faults.registry import fault, tp_gt_1

LOW_PRECISION_REDUCE = torch.bfloat16


def _init_row_parallel(m) -> None:
    """An instance ``forward`` for a row-parallel layer (o_proj, down_proj) whose behaviour the row-parallel
    faults switch on through attributes."""
    if "forward" in m.__dict__:
        return

    def forward(x):
        y = F.linear(x, m.weight, m.bias if m.tp_rank == 0 else None)
        extra = getattr(m, "_tpcheck_extra_bias", None)
        if extra is not None and m.tp_rank > 0:  # the bug adds b on every rank; rank 0's copy is the
            y = y + extra                        # correct one, so only the extra copies are added
        if getattr(m, "_tpcheck_skip_allreduce", False):
            return y
        low = getattr(m, "_tpcheck_reduce_dtype", None)
        if low is not None and low != y.dtype:  # partial sums rounded to, and summed in, the lower precision
            return all_reduce(y.to(low)).to(y.dtype)
        return all_reduce(y)

    m.forward = forward


@fault(7, "row_bias_every_rank",
       "row-parallel (o_proj) bias added by every rank before the all-reduce instead of once",
       shows_when="tp > 1", expected_origin="layers.{layer}.attn.out", shows=tp_gt_1)
def row_bias_every_rank(runner, i, layer):
    o = layer.self_attn.o_proj
    if mark(o, "row_bias_every_rank"):
        # the model's own o_proj bias where it has one (Llama with attention_bias); Qwen2's o_proj has none: a
        # fixed b (zero for a correct engine) that every rank adds
        o._tpcheck_extra_bias = o.bias.detach().clone() if o.bias is not None else \
            seeded_randn((o.output_size,), 1000 + i, o.weight.dtype, o.weight.device) * 0.1
        _init_row_parallel(o)


@fault(9, "skip_o_proj_allreduce",
       "all-reduce after o_proj skipped: each rank keeps its partial sum (ranks disagree on a replicated tensor)",
       shows_when="tp > 1", expected_origin="layers.{layer}.attn.out", shows=tp_gt_1)
def skip_o_proj_allreduce(runner, i, layer):
    o = layer.self_attn.o_proj
    if mark(o, "skip_o_proj_allreduce"):
        o._tpcheck_skip_allreduce = True
        _init_row_parallel(o)


@fault(14, "vocab_ids_not_masked",
       "vocab-parallel embedding does not zero ids outside the rank's vocab range: each rank adds its row 0",
       shows_when="tp > 1", expected_origin="embed", shows=tp_gt_1)
def vocab_ids_not_masked(runner, i, layer):
    emb = runner.model.model.embed_tokens
    if isinstance(emb, PPMissingLayer) or emb.tp_size == 1 or not mark(emb, "vocab_ids_not_masked"):
        return  # the embedding is another pipeline stage's, or one rank owns every id: nothing to mask

    def forward(ids):
        mine = (ids >= emb.start) & (ids < emb.end)
        # the bug: out.masked_fill(~mine[..., None], 0) is missing, so foreign ids contribute local row 0
        return all_reduce(F.embedding(torch.where(mine, ids - emb.start, 0), emb.weight))

    emb.forward = forward


def _tp_gt_1_float32(cfg, plan, dtype) -> bool:
    return plan.tp > 1 and dtype == "float32"


@fault(19, "allreduce_low_precision",
       "the o_proj and down_proj all-reduces run in bfloat16 while the activations are float32",
       shows_when="tp > 1 with float32 activations", expected_origin="layers.{layer}.attn.out",
       shows=_tp_gt_1_float32)
def allreduce_low_precision(runner, i, layer):
    for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
        if mark(m, "allreduce_low_precision"):
            m._tpcheck_reduce_dtype = LOW_PRECISION_REDUCE
            _init_row_parallel(m)
