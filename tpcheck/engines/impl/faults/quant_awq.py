"""Faults of 4-bit AWQ linears under TP (``impl.quant_awq``): AWQ's interleaved nibble order read as GPTQ's
sequential one, the row-parallel group scales sharded along the wrong dim, one rank's zero points everywhere. Each
patch rewrites a rank's tensors after loading, from its own tensors or the checkpoint's (read as stored); they show
on AWQ checkpoints in every dtype (W4A16 runs in float32 too: no activation is quantized)."""
from __future__ import annotations

import torch

from impl.quant_awq import AwqScheme, pack_awq
from impl.quant_gptq import unpack_cols
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.quant_gptq import column_targets, load_as_rank0, scales_by_output
from tpcheck.engines.impl.faults.registry import Needs, fault


def _awq_scheme(cfg) -> bool:
    return isinstance(getattr(cfg, "quant", None), AwqScheme)


AWQ = Needs("an AWQ checkpoint's packed tensors (quant_method: awq)", _awq_scheme)


def _awq(cfg, plan, dtype) -> bool:
    return _awq_scheme(cfg)


def _awq_tp(cfg, plan, dtype) -> bool:
    return _awq(cfg, plan, dtype) and plan.tp > 1


@fault(43, "awq_nibble_order_sequential",
       "AWQ column-parallel layers (q/k/v, gate/up) on the last rank: qweight and qzeros unpacked in GPTQ's "
       "sequential nibble order (column 8c+j from nibble j) instead of AWQ's [0, 4, 1, 5, 2, 6, 3, 7]",
       shows_when="AWQ checkpoints, any tp (the last rank is rank 0 at tp 1)",
       expected_origin="layers.{layer}.attn.q", shows=_awq, needs=AWQ)
@torch.no_grad()
def awq_nibble_order_sequential(runner, i, layer):
    for m in {id(m): m for m, _, _ in column_targets(layer)}.values():
        if m.tp_rank != m.tp_size - 1 or not mark(m, "awq_nibble_order_sequential"):
            continue
        for leaf in ("qweight", "qzeros"):  # repacked so that AWQ's unpacking yields the sequential reading
            p = getattr(m, leaf).data
            p.copy_(pack_awq(unpack_cols(p)))


@fault(44, "awq_row_scales_sharded_by_output",
       "AWQ row-parallel layers (o_proj, down_proj): scales / zeros sharded along the output like a column-parallel "
       "layer's (rank r's block of output columns, tiled) instead of by input groups",
       shows_when="AWQ checkpoints, tp > 1", expected_origin="layers.{layer}.attn.out", shows=_awq_tp,
       needs=AWQ)
@torch.no_grad()
def awq_row_scales_sharded_by_output(runner, i, layer):
    scales_by_output(layer, "awq_row_scales_sharded_by_output")


@fault(45, "awq_every_rank_rank0_qzeros",
       "AWQ column-parallel layers (q/k/v, gate/up): every rank loads rank 0's packed columns of qzeros (qweight "
       "and scales right: AWQ's zero points differ per column, so every other rank's are wrong)",
       shows_when="AWQ checkpoints, tp > 1", expected_origin="layers.{layer}.attn.q", shows=_awq_tp,
       needs=AWQ)
@torch.no_grad()
def awq_every_rank_rank0_qzeros(runner, i, layer):
    if mark(layer.self_attn.qkv_proj, "awq_every_rank_rank0_qzeros"):
        load_as_rank0(runner, i, layer, "qzeros", "awq_loader")
