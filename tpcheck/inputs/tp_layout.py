"""What impl makes of a config keyword dict of any family (a preset's, or one drawn by ``tpcheck.properties.strategies``) at a
TP size: whether it splits, and whether its KV heads are partitioned or replicated (head counts and MLP width
decide, whatever the family). impl's own rules, read from ``impl.config.ModelConfig.check_tp`` and
``impl.shard_plan.kv_split``, never re-derived here."""
from __future__ import annotations

from impl.config import ConfigError, ModelConfig
from impl.shard_plan import kv_split


def splits(tp: int, heads: int, kv_heads: int, intermediate: int) -> bool:
    """Whether impl can split these query / KV head counts and MLP width over ``tp`` ranks: ``check_tp`` of a
    ``ModelConfig`` that holds just the numbers it reads."""
    cfg = ModelConfig(hf=None, model_dir="", hidden_size=0, num_heads=heads, num_kv_heads=kv_heads, head_dim=0,
                      intermediate_size=intermediate, num_layers=0, vocab_size=0, rope_theta=0.0, rms_norm_eps=0.0,
                      max_position=0, tie_word_embeddings=False, eos_token_ids=())
    try:
        cfg.check_tp(tp)
    except ConfigError:
        return False
    return True


def tp_compatible(config: dict, tp: int) -> bool:
    """Whether impl can split ``config`` over ``tp`` ranks (``ModelConfig.check_tp``: query heads divisible by
    tp, KV heads divisible by tp or tp by KV heads, intermediate size divisible by tp)."""
    return splits(tp, config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"])


def kv_layout(num_kv_heads: int, tp: int) -> str:
    """``"partition"`` (each rank holds ``num_kv_heads / tp`` KV heads) or ``"replication"`` (each KV head on
    ``tp / num_kv_heads`` ranks), as ``impl.shard_plan.kv_split`` places them at a ``tp`` that ``splits``."""
    return "replication" if kv_split(num_kv_heads, tp)[1] > 1 else "partition"
