"""Faults of 4-bit GPTQ linears under TP (``impl.quant_gptq``): the packed weights or their group scales land on
the wrong rank or the wrong tile. Each patch rewrites a rank's tensors after loading, from the checkpoint's own
tensors (read as stored) or the rank's own; they show on GPTQ checkpoints at tp > 1, in every dtype (W4A16 runs
in float32 too: no activation is quantized)."""
from __future__ import annotations

import torch

from impl.quant_gptq import GptqScheme
from tpcheck.engines.impl.faults.patching import mark, read_tensors
from tpcheck.engines.impl.faults.registry import Needs, fault


def _gptq(cfg) -> bool:
    return isinstance(getattr(cfg, "quant", None), GptqScheme)


GPTQ = Needs("a GPTQ checkpoint's packed tensors (quant_method: gptq)", _gptq)


def _gptq_tp(cfg, plan, dtype) -> bool:
    return _gptq(cfg) and plan.tp > 1


def _gptq_grouped_tp(cfg, plan, dtype) -> bool:
    return _gptq_tp(cfg, plan, dtype) and not cfg.quant.desc_act


def _row_layers(layer):
    return ((layer.self_attn.o_proj, "self_attn.o_proj"), (layer.mlp.down_proj, "mlp.down_proj"))


def column_targets(layer) -> list[tuple]:
    """``(fused layer, HF projection, shard_id)`` of each column-parallel projection of a decoder layer."""
    sa, mlp = layer.self_attn, layer.mlp
    return [(sa.qkv_proj, f"self_attn.{s}_proj", s) for s in ("q", "k", "v")] + \
        [(mlp.gate_up_proj, "mlp.gate_proj", 0), (mlp.gate_up_proj, "mlp.up_proj", 1)]


def load_as_rank0(runner, i: int, layer, leaf: str, loader: str) -> None:
    """Every column-parallel projection's ``leaf`` reloaded by the layer's own ``loader`` at rank 0's columns."""
    p = f"model.layers.{i}."
    targets = column_targets(layer)
    full = read_tensors(runner, [p + f"{hf}.{leaf}" for _, hf, _ in targets], cast=False)
    for m, hf, sid in targets:
        rank = m.tp_rank
        m.tp_rank = 0
        try:
            getattr(m, loader)(getattr(m, leaf), full[p + f"{hf}.{leaf}"], sid)
        finally:
            m.tp_rank = rank


def scales_by_output(layer, tag: str) -> None:
    """Row-parallel layers' ``scales`` / ``qzeros``: rank r's block of output columns, tiled across the output."""
    for m, _ in _row_layers(layer):
        if not mark(m, tag):
            continue
        for leaf in ("scales", "qzeros"):  # qzeros: rank r's block of packed columns (8 outputs each)
            s = getattr(m, leaf).data
            cols = s.shape[1] // m.tp_size
            s.copy_(s[:, m.tp_rank * cols:(m.tp_rank + 1) * cols].clone().repeat(1, m.tp_size))


@fault(40, "gptq_row_group_scales_misaligned",
       "GPTQ row-parallel layers (o_proj, down_proj): every rank reads the scales / zeros of the first group tile "
       "(groups [0, G/tp), rank 0's) instead of its own [r G/tp, (r+1) G/tp)",
       shows_when="GPTQ checkpoints without act-order, tp > 1", expected_origin="layers.{layer}.attn.out",
       shows=_gptq_grouped_tp, needs=GPTQ)
@torch.no_grad()
def gptq_row_group_scales_misaligned(runner, i, layer):
    p = f"model.layers.{i}."
    for m, hf in _row_layers(layer):
        if not mark(m, "gptq_row_group_scales_misaligned"):
            continue
        full = read_tensors(runner, [p + f"{hf}.scales", p + f"{hf}.qzeros"], cast=False)
        for leaf in ("scales", "qzeros"):
            param = getattr(m, leaf)
            param.data.copy_(full[p + f"{hf}.{leaf}"][:param.shape[0]])


@fault(41, "gptq_every_rank_rank0_qweight",
       "GPTQ column-parallel layers (q/k/v, gate/up): every rank loads rank 0's output columns of the packed "
       "qweight (scales and zeros right: shapes right, numbers wrong)",
       shows_when="GPTQ checkpoints, tp > 1", expected_origin="layers.{layer}.attn.q", shows=_gptq_tp,
       needs=GPTQ)
@torch.no_grad()
def gptq_every_rank_rank0_qweight(runner, i, layer):
    if mark(layer.self_attn.qkv_proj, "gptq_every_rank_rank0_qweight"):
        load_as_rank0(runner, i, layer, "qweight", "gptq_loader")


@fault(42, "gptq_row_scales_sharded_by_output",
       "GPTQ row-parallel layers (o_proj, down_proj): scales / zeros sharded along the output like a column-parallel "
       "layer's (rank r's block of output columns, tiled), where a rank needs every output column of its groups",
       shows_when="GPTQ checkpoints, tp > 1", expected_origin="layers.{layer}.attn.out", shows=_gptq_tp,
       needs=GPTQ)
@torch.no_grad()
def gptq_row_scales_sharded_by_output(runner, i, layer):
    scales_by_output(layer, "gptq_row_scales_sharded_by_output")
