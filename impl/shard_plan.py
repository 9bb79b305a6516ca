"""How a model (any family of ``impl.config.FAMILIES``) splits over ``tp`` ranks: the one place
tensor-parallel arithmetic is written.

vLLM's rules, which the parallel layers (``impl.layers``) apply and everything else (the KV cache size,
the memory check, the property strategies, the CLI, the benchmarks) reads from here:

* query heads: ``H / tp`` per rank (``H % tp == 0``);
* KV heads: partitioned, ``K / tp`` per rank, when ``tp <= K`` (``K % tp == 0``); replicated when ``tp > K``
  (``tp % K == 0``): each KV head on ``tp / K`` consecutive ranks, rank r holding head ``r // (tp / K)``;
* MLP intermediate: ``I / tp`` per rank (gate/up column-parallel, down row-parallel);
* vocab: padded to a multiple of ``VOCAB_PADDING``, then of ``tp``; ``padded / tp`` rows per rank;
* replicated whole on every rank: the norms (Qwen3's per-head ``q_norm`` / ``k_norm`` included: a head is
  never split) and the biases of the row-parallel ``o_proj`` / ``down_proj`` (added once, by rank 0);
* mixture of experts (``impl.moe_config``, ``impl.layers.moe``) at ``ep`` expert groups (``moe_tp = tp / ep``):
  the router and the shared expert's gate replicated; the shared expert like the dense MLP (``I_shared / tp``);
  rank r holds the ``E / ep`` experts of its group ``r // moe_tp``, ``I_expert / moe_tp`` of each.

``ModelConfig.check_tp`` is the validity test; ``shard_plan`` calls it."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_EXPERT = re.compile(r".*\.experts\.(\d+)\.\w+\.weight")

VOCAB_PADDING = 64


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to ``VOCAB_PADDING``, then to a multiple of ``tp``."""
    vp = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-vp // tp) * tp


def kv_split(num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads per rank, ranks holding each KV head) — ``(K / tp, 1)`` partitioned, ``(1, tp / K)``
    replicated. The caller has validated ``tp`` (``ModelConfig.check_tp``)."""
    return (num_kv_heads // tp, 1) if tp <= num_kv_heads else (1, tp // num_kv_heads)


@dataclass(frozen=True)
class ShardPlan:
    """Per-rank sizes of one model at one ``tp`` (``shard_plan(cfg, tp)``)."""

    tp: int
    heads: int            # query heads per rank
    kv_heads: int         # KV heads per rank (1 when replicated)
    kv_replicas: int      # ranks holding each KV head (1: partitioned)
    total_kv_heads: int
    head_dim: int
    intermediate: int     # MLP intermediate width per rank
    vocab: int            # real vocab size
    padded_vocab: int     # padded vocab size (all ranks)
    hidden: int
    ep: int = 1           # expert-parallel groups (MoE)
    experts: int = 0      # experts per sparse layer (0: dense model)

    @property
    def vocab_rows(self) -> int:
        """Embedding / LM-head rows per rank."""
        return self.padded_vocab // self.tp

    def kv_head_of(self, rank: int) -> int:
        """The first (global) KV head rank ``rank`` holds."""
        return rank // self.kv_replicas if self.kv_replicas > 1 else rank * self.kv_heads

    def kv_cache_bytes_per_block(self, num_layers: int, block_size: int, itemsize: int) -> int:
        """One rank's K and V cache bytes for one block of ``block_size`` tokens over every layer."""
        return 2 * num_layers * block_size * self.kv_heads * self.head_dim * itemsize

    def tensor_elements(self, name: str, shape: list[int], tied: bool = False, rank: int = 0) -> int:
        """Elements rank ``rank`` holds of checkpoint tensor ``name`` (full ``shape``): vocab rows padded and
        split, KV projections split or replicated, other projections split, norms, routers and row-parallel
        biases replicated; an expert's tensors split ``tp / ep`` ways on the ranks of its group, absent
        elsewhere; a tied ``lm_head.weight`` is not held (the embedding serves)."""
        n = math.prod(shape)
        if tied and name == "lm_head.weight":
            return 0
        if self.experts and (m := _EXPERT.fullmatch(name)) is not None:
            moe_tp = self.tp // self.ep
            return n // moe_tp if int(m.group(1)) // (self.experts // self.ep) == rank // moe_tp else 0
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self.vocab_rows * shape[1]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return n * self.kv_heads // self.total_kv_heads
        if name.endswith(("o_proj.bias", "down_proj.bias")):  # row parallel: the bias is held whole
            return n
        if name.endswith(("_proj.weight", "_proj.bias")):  # q, o, gate, up, down
            return n // self.tp
        return n


def shard_plan(cfg, tp: int, ep: int = 1) -> ShardPlan:
    """The plan of ``cfg`` (``impl.config.ModelConfig``) at ``tp`` (and ``ep`` expert groups); raises
    ``ConfigError`` for a layout the model cannot be split over (``cfg.check_tp``)."""
    cfg.check_tp(tp, ep)
    kv_heads, replicas = kv_split(cfg.num_kv_heads, tp)
    return ShardPlan(tp=tp, heads=cfg.num_heads // tp, kv_heads=kv_heads, kv_replicas=replicas,
                     total_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, intermediate=cfg.intermediate_size // tp, vocab=cfg.vocab_size,
                     padded_vocab=padded_vocab_size(cfg.vocab_size, tp), hidden=cfg.hidden_size, ep=ep,
                     experts=cfg.moe.num_experts if cfg.moe is not None else 0)
