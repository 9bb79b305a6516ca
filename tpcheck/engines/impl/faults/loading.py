"""Faults that strike at load time: a rank ends up with the wrong shard (or the wrong tensor, or too much).

Each patch re-reads the checkpoint tensors it needs (``read_tensors``) and rewrites the rank's shard in
place, through the layers' own ``weight_loader`` at most, never ``impl.loader`` again."""
from __future__ import annotations

import torch
from torch import nn

from tpcheck.engines.impl.faults.patching import mark, read_tensors, seeded_randn
from tpcheck.engines.impl.faults.registry import fault, tp_gt_1
from safetensors.torch import load_file
from impl.loader import checkpoint_files
from impl.pipeline import PPMissingLayer


def _dim1_shardable(cfg, plan, dtype) -> bool:
    return plan.tp > 1 and plan.hidden % plan.tp == 0


@fault(2, "qkv_shard_dim1",
       "q/k/v weights sharded along dim 1 (in_features) instead of dim 0, reshaped to the local shape",
       shows_when="tp > 1", expected_origin="layers.{layer}.attn.q", shows=_dim1_shardable)
@torch.no_grad()
def qkv_shard_dim1(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if not mark(qkv, "qkv_shard_dim1"):
        return
    p = f"model.layers.{i}.self_attn."
    w = read_tensors(runner, [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"])
    hidden = qkv.weight.shape[1]
    # q is split tp ways; k/v over the distinct KV shards (tp, or num_kv_heads when replicated)
    parts = {"q": (qkv.tp_size, qkv.tp_rank), "k": (qkv.tp_size // qkv.kv_replicas, qkv.tp_rank // qkv.kv_replicas)}
    parts["v"] = parts["k"]
    offsets = {"q": (0, qkv.q_size), "k": (qkv.q_size, qkv.kv_size), "v": (qkv.q_size + qkv.kv_size, qkv.kv_size)}
    for s in ("q", "k", "v"):
        n, r = parts[s]
        if hidden % n:
            raise ValueError(f"qkv_shard_dim1: hidden_size {hidden} is not divisible by {n}")
        cols = hidden // n
        off, rows = offsets[s]
        full = w[f"{p}{s}_proj.weight"]
        qkv.weight.data[off:off + rows].copy_(full[:, r * cols:(r + 1) * cols].reshape(rows, hidden))


def _has_qkv_bias(cfg, plan, dtype) -> bool:
    return cfg.qkv_bias


@fault(4, "qkv_bias_missing", "q/k/v projection biases not loaded (left at zero)",
       shows_when="models with q/k/v biases (Qwen2; Llama / Qwen3 with attention_bias)",
       expected_origin="layers.{layer}.attn.q", shows=_has_qkv_bias)
@torch.no_grad()
def qkv_bias_missing(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if qkv.bias is not None and mark(qkv, "qkv_bias_missing"):
        qkv.bias.data.zero_()


def _kv_replicated_multi(cfg, plan, dtype) -> bool:
    return plan.kv_replicas > 1 and plan.total_kv_heads > 1  # one KV head: r % 1 == r // tp == 0


@fault(6, "kv_replica_index",
       "replicated KV head index computed as tp_rank % num_kv_heads instead of tp_rank // replicas",
       shows_when="KV replication (tp > num_kv_heads) with num_kv_heads > 1", expected_origin="layers.{layer}.attn.k",
       shows=_kv_replicated_multi)
@torch.no_grad()
def kv_replica_index(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if qkv.kv_replicas == 1 or not mark(qkv, "kv_replica_index"):
        return  # KV heads partitioned: no replica index to get wrong
    total_kv = runner.cfg.num_kv_heads
    head = qkv.tp_rank % total_kv  # the bug; correct: tp_rank // kv_replicas
    p = f"model.layers.{i}.self_attn."
    kinds = ("weight", "bias") if qkv.bias is not None else ("weight",)  # Llama / Mistral: no q/k/v bias
    names = [p + f"{s}_proj.{t}" for s in ("k", "v") for t in kinds]
    w = read_tensors(runner, names)
    d = qkv.kv_size  # one KV head per rank under replication
    for s, off in (("k", qkv.q_size), ("v", qkv.q_size + qkv.kv_size)):
        for t in kinds:
            getattr(qkv, t).data[off:off + d].copy_(w[f"{p}{s}_proj.{t}"][head * d:(head + 1) * d])


@fault(8, "gate_up_swapped", "gate and up halves of the fused gate_up_proj swapped",
       shows_when="always", expected_origin="layers.{layer}.mlp.gate")
@torch.no_grad()
def gate_up_swapped(runner, i, layer):
    gu = layer.mlp.gate_up_proj
    if mark(gu, "gate_up_swapped"):
        n = gu.weight.shape[0] // 2
        gu.weight.data.copy_(torch.cat([gu.weight.data[n:], gu.weight.data[:n]]))


def _tied(cfg, plan, dtype) -> bool:
    return cfg.tie_word_embeddings


@fault(11, "untied_lm_head",
       "tied lm_head not tied (AutoModel fallback): the head is a fresh N(0, 0.02) tensor, not the embedding",
       shows_when="tied checkpoints (tie_word_embeddings)", expected_origin="logits", shows=_tied)
@torch.no_grad()
def untied_lm_head(runner, i, layer):
    model = runner.model
    if isinstance(model.lm_head, PPMissingLayer):  # the head is the last pipeline stage's
        return
    if not runner.cfg.tie_word_embeddings or not mark(model.lm_head, "untied_lm_head"):
        return
    head = model.lm_head
    old = head.weight
    # the same full matrix on every TP size: rank r keeps its vocab rows; padding rows stay zero
    full = seeded_randn((head.padded_size, old.shape[1]), 2024, old.dtype, old.device) * 0.02
    full[head.vocab_size:] = 0
    head.weight = nn.Parameter(full[head.start:head.end].clone(), requires_grad=False)


@fault(13, "full_state_dict_every_rank",
       "every rank also materialises the whole checkpoint state dict and keeps it (numerics unchanged)",
       shows_when="memory figures only, tp > 1: a rank holds >= the full checkpoint instead of its ~1/tp share; "
                  "tpcheck diff passes",
       expected_origin="memory", shows=tp_gt_1, check="memory")
def full_state_dict_every_rank(runner, i, layer):

    if getattr(runner, "_tpcheck_full_state", None) is None:
        state: dict[str, torch.Tensor] = {}
        for fname in checkpoint_files(runner.cfg.model_dir):
            state.update({n: t.to(runner.dtype) for n, t in load_file(fname).items()})
        runner._tpcheck_full_state = state  # kept referenced for the runner's lifetime, as the bug does


@fault(15, "every_rank_loads_rank0_shard",
       "every rank loads rank 0's slice of the layer's sharded weights (q/k/v, o_proj, gate/up, down): "
       "the weight loader narrows at offset 0 instead of tp_rank * size",
       shows_when="tp > 1", expected_origin="layers.{layer}.attn.q", shows=tp_gt_1)
@torch.no_grad()
def every_rank_loads_rank0_shard(runner, i, layer):
    sa, mlp = layer.self_attn, layer.mlp
    p = f"model.layers.{i}."
    targets = [(sa.qkv_proj, f"self_attn.{s}_proj", s) for s in ("q", "k", "v")]
    targets += [(sa.o_proj, "self_attn.o_proj", None), (mlp.gate_up_proj, "mlp.gate_proj", 0),
                (mlp.gate_up_proj, "mlp.up_proj", 1), (mlp.down_proj, "mlp.down_proj", None)]
    if not mark(sa.qkv_proj, "every_rank_loads_rank0_shard"):
        return
    for m in (sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
        mark(m, "every_rank_loads_rank0_shard")
    names = [p + f"{hf}.{t}" for m, hf, _ in targets for t in ("weight", "bias") if getattr(m, t) is not None]
    full = read_tensors(runner, names)
    for m, hf, sid in targets:
        rank = m.tp_rank
        m.tp_rank = 0  # the layer's own weight loader, narrowing at rank 0's offset
        try:
            for t in ("weight", "bias"):
                param = getattr(m, t)
                if param is not None:
                    m.weight_loader(param, full[p + f"{hf}.{t}"], sid)
        finally:
            m.tp_rank = rank
