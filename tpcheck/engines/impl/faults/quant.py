"""Faults of quantized linears under TP (``impl.quant``: INT8 W8A8): the weights load right, a scale does not. These
are the bugs engines have shipped (the scales, not the matmuls; FP8 too: 36-37): a row-parallel scale sharded like a column-parallel
one, fused partitions' scales in the wrong slots, every rank reading rank 0's scale rows.

Each patch rewrites the rank's ``weight_scale`` after loading (from the checkpoint's own scale tensors, read as
stored: ``read_tensors(..., cast=False)``); the int8 weights are untouched. They show on quantized checkpoints
only, in the dtypes tpcheck judges a quantized run in (``shows``: not float32, whose near ties are not handled
yet)."""
from __future__ import annotations

import torch

from tpcheck.engines.impl.faults.patching import mark, read_tensors
from tpcheck.engines.impl.faults.registry import Needs, fault


def _w8a8(cfg) -> bool:  # W8A8 (GPTQ / AWQ and a KV-cache-only scheme have no weight_scale)
    return getattr(getattr(cfg, "quant", None), "weight_strategy", None) in ("channel", "tensor")


def _w8a8_channel(cfg) -> bool:
    return _w8a8(cfg) and cfg.quant.weight_strategy == "channel"


def _w8a8_tensor(cfg) -> bool:
    return _w8a8(cfg) and cfg.quant.weight_strategy == "tensor"


def _fp8_tensor_scheme(cfg) -> bool:
    return _w8a8_tensor(cfg) and cfg.quant.num_type == "float"


def _static_input(cfg) -> bool:
    return _w8a8(cfg) and not cfg.quant.dynamic_input


W8A8 = Needs("an INT8 / FP8 W8A8 checkpoint's weight scales (weight_scale)", _w8a8)
W8A8_CHANNEL = Needs("per-channel W8A8 weight scales (weights.strategy: channel)", _w8a8_channel)
W8A8_TENSOR = Needs("per-tensor W8A8 weight scales (weights.strategy: tensor)", _w8a8_tensor)
FP8_TENSOR = Needs("per-tensor FP8 W8A8 weight scales (format float-quantized, weights.strategy: tensor)",
                   _fp8_tensor_scheme)
STATIC_INPUT = Needs("static W8A8 input scales (input_activations.dynamic: false)", _static_input)


def _quantized(cfg, plan, dtype) -> bool:
    return _w8a8(cfg) and dtype != "float32"


def _channel(cfg, plan, dtype) -> bool:
    return _quantized(cfg, plan, dtype) and _w8a8_channel(cfg)


def _channel_tp(cfg, plan, dtype) -> bool:
    return _channel(cfg, plan, dtype) and plan.tp > 1


def _tensor(cfg, plan, dtype) -> bool:
    return _quantized(cfg, plan, dtype) and _w8a8_tensor(cfg)


@fault(32, "qkv_scale_k_v_swapped",
       "quantized q/k/v: the k and v weight scales loaded into each other's slots (per-tensor: the two numbers; "
       "per-channel: the two row blocks)",
       shows_when="quantized checkpoints (INT8 W8A8), bfloat16 / float16", expected_origin="layers.{layer}.attn.k",
       shows=_quantized, needs=W8A8)
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
       expected_origin="layers.{layer}.attn.q", shows=_channel_tp, needs=W8A8)
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
       expected_origin="layers.{layer}.attn.out", shows=_channel_tp, needs=W8A8_CHANNEL)
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
       expected_origin="layers.{layer}.mlp.gate", shows=_tensor, needs=W8A8_TENSOR)
@torch.no_grad()
def fused_scale_into_first_slot(runner, i, layer):
    gu = layer.mlp.gate_up_proj
    if not mark(gu, "fused_scale_into_first_slot"):
        return
    s = gu.weight_scale.data
    s[0] = s[1].clone()
    s[1] = 1.0


def _fp8_tensor(cfg, plan, dtype) -> bool:
    return _tensor(cfg, plan, dtype) and _fp8_tensor_scheme(cfg)


@fault(36, "fp8_fused_scale_not_max",
       "FP8 fused q/k/v and gate/up with per-tensor scales: the layer takes the maximum of its partitions' scales "
       "but each partition's e4m3 weights are read as stored, not re-quantized to it (vLLM's "
       "requantize_with_max_scale skipped): a partition with a smaller scale is scaled up by s_max / s_i",
       shows_when="FP8 checkpoints with per-tensor scales, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.k", shows=_fp8_tensor, needs=FP8_TENSOR)
@torch.no_grad()
def fp8_fused_scale_not_max(runner, i, layer):
    sa, mlp = layer.self_attn, layer.mlp
    if not mark(sa.qkv_proj, "fp8_fused_scale_not_max"):
        return
    p = f"model.layers.{i}."
    groups = [(sa.qkv_proj, [(f"self_attn.{s}_proj", s) for s in ("q", "k", "v")]),
              (mlp.gate_up_proj, [("mlp.gate_proj", 0), ("mlp.up_proj", 1)])]
    names = [p + hf + suffix for _, parts in groups for hf, _ in parts for suffix in (".weight", ".weight_scale")]
    full = read_tensors(runner, names, cast=False)
    for m, parts in groups:
        for hf, sid in parts:  # the stored e4m3 values, through the layer's own row rule
            m.weight_loader(m.weight, full[p + hf + ".weight"], sid)
        m.weight_scale.data.fill_(max(float(full[p + hf + ".weight_scale"].max()) for hf, _ in parts))


def _fp8_static_tp(cfg, plan, dtype) -> bool:
    return _quantized(cfg, plan, dtype) and cfg.quant.num_type == "float" and not cfg.quant.dynamic_input \
        and plan.tp > 1


@fault(37, "fp8_input_scale_rank0_only",
       "FP8 static activation scales loaded on rank 0 only: the other ranks keep the input_scale's initial value "
       "(vLLM's create_fp8_input_scale fills it with float32's lowest, -3.4e38), so their quantized inputs are 0 "
       "and their shards of every linear output 0 (ranks disagree on a tensor each must hold whole)",
       shows_when="FP8 checkpoints with static input scales, tp > 1, bfloat16 / float16",
       expected_origin="layers.{layer}.attn.q", shows=_fp8_static_tp, needs=STATIC_INPUT)
@torch.no_grad()
def fp8_input_scale_rank0_only(runner, i, layer):
    mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    for m in mods:
        if mark(m, "fp8_input_scale_rank0_only") and m.tp_rank > 0:
            m.input_scale.data.fill_(torch.finfo(torch.float32).min)
