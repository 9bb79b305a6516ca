"""Faults of quantized linears under TP (``impl.quant``: INT8 W8A8): the weights load right, a scale does not. These
are the bugs engines have shipped (the scales, not the matmuls): a row-parallel scale sharded like a column-parallel
one, fused partitions' scales in the wrong slots, every rank reading rank 0's scale rows.

Each patch rewrites the rank's ``weight_scale`` after loading (from the checkpoint's own scale tensors, read as
stored: ``read_tensors(..., cast=False)``); the int8 weights are untouched. They show on quantized checkpoints
only, in the dtypes tpcheck judges a quantized run in (``shows``: not float32, whose near ties are not handled
yet)."""
from __future__ import annotations

import torch

from tpcheck.inputs.faults.patching import mark, read_tensors
from tpcheck.inputs.faults.registry import fault


def _quantized(cfg, plan, dtype) -> bool:
    quant = getattr(cfg, "quant", None)  # INT8 W8A8 (a GPTQ scheme has no weight_scale: quant_gptq.py)
    return quant is not None and getattr(quant, "weight_strategy", None) != "group" and dtype != "float32"


def _channel(cfg, plan, dtype) -> bool:
    return _quantized(cfg, plan, dtype) and cfg.quant.weight_strategy == "channel"


def _channel_tp(cfg, plan, dtype) -> bool:
    return _channel(cfg, plan, dtype) and plan.tp > 1


def _tensor(cfg, plan, dtype) -> bool:
    return _quantized(cfg, plan, dtype) and cfg.quant.weight_strategy == "tensor"


@fault(32, "qkv_scale_k_v_swapped",
       "quantized q/k/v: the k and v weight scales loaded into each other's slots (per-tensor: the two numbers; "
       "per-channel: the two row blocks)",
       shows_when="quantized checkpoints (INT8 W8A8), bfloat16 / float16", expected_origin="layers.{layer}.attn.k",
       shows=_quantized)
@torch.no_grad()
def qkv_scale_k_v_swapped(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if not mark(qkv, "qkv_scale_k_v_swapped"):
        return
    s = qkv.weight_scale.data
    if s.dim() == 1:  # per tensor: slots q, k, v
        s[1:3] = s[[2, 1]].clone()
    else:
        q, kv = qkv.q_size, qkv.kv_size
        k = s[q:q + kv].clone()
        s[q:q + kv] = s[q + kv:q + 2 * kv]
        s[q + kv:q + 2 * kv] = k


@fault(33, "column_scale_rank0_rows",
       "quantized column-parallel layers (q/k/v, gate/up): every rank loads rank 0's rows of the per-channel weight "
       "scale (the weights are right: shapes right, numbers wrong)",
       shows_when="quantized checkpoints with per-channel scales, tp > 1, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.q", shows=_channel_tp)
@torch.no_grad()
def column_scale_rank0_rows(runner, i, layer):
    sa, mlp = layer.self_attn, layer.mlp
    if not mark(sa.qkv_proj, "column_scale_rank0_rows"):
        return
    p = f"model.layers.{i}."
    targets = [(sa.qkv_proj, f"self_attn.{s}_proj", s) for s in ("q", "k", "v")]
    targets += [(mlp.gate_up_proj, "mlp.gate_proj", 0), (mlp.gate_up_proj, "mlp.up_proj", 1)]
    full = read_tensors(runner, [p + f"{hf}.weight_scale" for _, hf, _ in targets], cast=False)
    for m, hf, sid in targets:
        rank = m.tp_rank
        m.tp_rank = 0  # the layer's own scale loader, narrowing at rank 0's rows
        try:
            m.scale_loader(m.weight_scale, full[p + f"{hf}.weight_scale"], sid)
        finally:
            m.tp_rank = rank


@fault(34, "row_scale_sharded_by_output",
       "quantized row-parallel layers (o_proj, down_proj): the per-channel weight scale sharded along the output "
       "like a column-parallel layer's (rank r's block of rows, tiled), where every rank needs it whole",
       shows_when="quantized checkpoints with per-channel scales, tp > 1, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.out", shows=_channel_tp)
@torch.no_grad()
def row_scale_sharded_by_output(runner, i, layer):
    for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
        if not mark(m, "row_scale_sharded_by_output"):
            continue
        s = m.weight_scale.data  # [out, 1], whole
        rows = s.shape[0] // m.tp_size
        block = s[m.tp_rank * rows:(m.tp_rank + 1) * rows].clone()
        s.copy_(block.repeat(m.tp_size, 1))


@fault(35, "fused_scale_into_first_slot",
       "quantized fused gate/up with per-tensor scales: both partitions' scales written into slot 0 (the last one "
       "loaded, up's, wins); slot 1 keeps its initial value (1.0 here)",
       shows_when="quantized checkpoints with per-tensor scales, bfloat16 / float16",
       expected_origin="layers.{layer}.mlp.gate", shows=_tensor)
@torch.no_grad()
def fused_scale_into_first_slot(runner, i, layer):
    gu = layer.mlp.gate_up_proj
    if not mark(gu, "fused_scale_into_first_slot"):
        return
    s = gu.weight_scale.data
    s[0] = s[1].clone()
    s[1] = 1.0
