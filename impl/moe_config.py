"""Mixture-of-experts configuration: how each MoE family spells its options (``MoeSpelling``, one per family in
``impl.config.FAMILIES``), what impl reads from a checkpoint's config (``MoeConfig``, ``read_moe``) and which
tensor- / expert-parallel layouts it can split over (``MoeConfig.check_layout``, ``MoeConfig.rank_layout``).

Read strictly: the fields that decide the math (number of experts, top-k, expert width, whether the top-k
weights are renormalised, the shared expert's width) must be in ``config.json``; a missing one is a
``ConfigError`` naming it, never transformers' default (a Qwen2-MoE config without ``num_experts`` would
otherwise get 60). ``decoder_sparse_step`` and ``mlp_only_layers`` may be absent: every transformers version
reads their absence as "every layer is sparse" (1 and ``[]``), which is the architecture's own default.

Expert parallelism (``ep``, with ``tp``; ``tp % ep == 0``): the ``tp`` ranks form ``ep`` groups of
``moe_tp = tp / ep`` consecutive ranks; rank r is in group ``g = r // moe_tp`` and holds the experts
``[g*E/ep, (g+1)*E/ep)``, each split ``moe_tp`` ways (its ``moe_tp`` rank ``r % moe_tp`` holds rows
``[j*I/moe_tp, (j+1)*I/moe_tp)`` of gate and up, the same columns of down). ``ep = 1`` is plain TP (every rank
holds every expert, ``I/tp`` wide); ``ep = tp`` is plain EP (whole experts, ``E/tp`` per rank)."""
from __future__ import annotations

from dataclasses import dataclass

from impl.errors import ConfigError


@dataclass(frozen=True)
class MoeSpelling:
    """How one MoE family spells its config and checkpoint (``impl.config.Family.moe``).

    * ``experts_key`` / ``intermediate_key``: the config fields of the number of experts and of one expert's
      width (Qwen: ``num_experts`` / ``moe_intermediate_size``; Mixtral: ``num_local_experts`` /
      ``intermediate_size``); ``experts_alias``: another name transformers reads for the number of experts
      (Qwen3-MoE: transformers 5 writes ``num_local_experts``, the published checkpoints say ``num_experts``);
    * ``norm_topk``: the config flag that turns on renormalising the top-k weights (``norm_topk_prob``), or
      ``True`` where the family always renormalises (Mixtral);
    * ``shared_expert``: a shared expert of ``shared_expert_intermediate_size`` with a sigmoid
      ``shared_expert_gate`` (Qwen2-MoE);
    * ``sparse_step``: ``decoder_sparse_step`` / ``mlp_only_layers`` choose the sparse layers (else every layer);
    * ``weights_in_activation_dtype``: HF casts the float32 top-k weights back to the activations' dtype
      before weighting the experts (Qwen), or keeps them in float32 (Mixtral: the weighting then runs in
      float32 and its product is cast back);
    * ``checkpoint_prefix``: the checkpoint's name of the block (``mlp``; Mixtral ``block_sparse_moe``);
    * ``expert_names``: the checkpoint's names of an expert's gate, up and down projections."""

    experts_key: str
    intermediate_key: str
    norm_topk: str | bool
    shared_expert: bool
    sparse_step: bool
    weights_in_activation_dtype: bool
    checkpoint_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts_alias: str | None = None


QWEN2_MOE = MoeSpelling("num_experts", "moe_intermediate_size", "norm_topk_prob", shared_expert=True,
                        sparse_step=True, weights_in_activation_dtype=True)
QWEN3_MOE = MoeSpelling("num_experts", "moe_intermediate_size", "norm_topk_prob", shared_expert=False,
                        sparse_step=True, weights_in_activation_dtype=True, experts_alias="num_local_experts")
MIXTRAL = MoeSpelling("num_local_experts", "intermediate_size", True, shared_expert=False, sparse_step=False,
                      weights_in_activation_dtype=False, checkpoint_prefix="block_sparse_moe",
                      expert_names=("w1", "w3", "w2"))


@dataclass(frozen=True)
class MoeRankLayout:
    """What one rank holds of every sparse layer at a (tp, ep) layout (``MoeConfig.rank_layout``)."""

    ep_size: int
    ep_rank: int           # the rank's expert group
    moe_tp_size: int       # ranks that split each expert (tp / ep)
    moe_tp_rank: int       # this rank's shard of its experts
    expert_start: int      # first global expert id the rank holds
    num_local_experts: int
    intermediate: int      # per-expert width on this rank (I / moe_tp)

    @property
    def local_experts(self) -> range:
        return range(self.expert_start, self.expert_start + self.num_local_experts)


@dataclass(frozen=True)
class MoeConfig:
    """The MoE numbers of a checkpoint (``ModelConfig.moe``): ``num_experts`` experts of width
    ``intermediate_size``, ``top_k`` per token, renormalised when ``renormalize``; a shared expert when
    ``shared_expert_intermediate_size`` > 0; ``sparse_layers[i]`` says whether layer i is sparse (else a dense
    MLP of the config's ``intermediate_size``); ``spelling``: the family's names and dtype rule."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    spelling: MoeSpelling

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.sparse_layers)

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse an expert / tensor parallel layout the experts cannot be split over, with the numbers."""
        if ep < 1:
            raise ConfigError(f"ep_size must be >= 1, got {ep}")
        if tp % ep:
            raise ConfigError(f"tp_size={tp} is not divisible by ep_size={ep} (the ep groups split the tp ranks)")
        if self.num_experts % ep:
            raise ConfigError(f"{self.spelling.experts_key}={self.num_experts} is not divisible by ep_size={ep}")
        moe_tp = tp // ep
        if self.intermediate_size % moe_tp:
            raise ConfigError(f"{self.spelling.intermediate_key}={self.intermediate_size} is not divisible by "
                              f"tp_size/ep_size="
                              f"{tp}/{ep}={moe_tp} (each expert is split over the {moe_tp} ranks of its ep group)")
        if self.shared_expert_intermediate_size % tp:
            raise ConfigError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} is not "
                              f"divisible by tp_size={tp}")

    def rank_layout(self, rank: int, tp: int, ep: int) -> MoeRankLayout:
        """Rank ``rank``'s experts and shard at a layout ``check_layout`` accepted (module docstring)."""
        moe_tp = tp // ep
        g, n = rank // moe_tp, self.num_experts // ep
        return MoeRankLayout(ep_size=ep, ep_rank=g, moe_tp_size=moe_tp, moe_tp_rank=rank % moe_tp,
                             expert_start=g * n, num_local_experts=n, intermediate=self.intermediate_size // moe_tp)


def _positive(raw: dict, key: str, path) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def _required(raw: dict, keys: list[str], path, model_type: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ConfigError(f"{path}: model_type {model_type!r} needs {', '.join(missing)} in config.json "
                          "(impl does not take transformers' default for it)")


def _sparse_layers(raw: dict, path, num_layers: int) -> tuple[bool, ...]:
    """HF's rule: layer i is sparse unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``."""
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"{path}: decoder_sparse_step must be a positive integer, got {step!r}")
    only = raw.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ConfigError(f"{path}: mlp_only_layers must be a list of layer indices, got {only!r}")
    bad = [i for i in only if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"{path}: mlp_only_layers names layer(s) {bad} outside 0..{num_layers - 1}")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))


def _experts_key(spelling: MoeSpelling, raw: dict, path) -> str:
    """The key of ``raw`` that holds the number of experts: the family's own, or its alias (not both, unless equal)."""
    alias = spelling.experts_alias
    if alias is None or alias not in raw:
        return spelling.experts_key
    if spelling.experts_key in raw and raw[spelling.experts_key] != raw[alias]:
        raise ConfigError(f"{path}: {spelling.experts_key}={raw[spelling.experts_key]!r} and {alias}="
                          f"{raw[alias]!r} disagree")
    return alias


def read_moe(spelling: MoeSpelling, raw: dict, hf, path, model_type: str) -> MoeConfig:
    """The ``MoeConfig`` of a checkpoint's raw ``config.json`` dict (``raw``) and transformers' reading of it
    (``hf``), its fields spelt as ``spelling`` says; anything missing or out of range is a ``ConfigError``."""
    experts_key = _experts_key(spelling, raw, path)
    keys = [experts_key, "num_experts_per_tok", spelling.intermediate_key]
    if isinstance(spelling.norm_topk, str):
        keys.append(spelling.norm_topk)
    if spelling.shared_expert:
        keys.append("shared_expert_intermediate_size")
    _required(raw, keys, path, model_type)
    experts = _positive(raw, experts_key, path)
    top_k = _positive(raw, "num_experts_per_tok", path)
    if top_k > experts:
        raise ConfigError(f"{path}: num_experts_per_tok={top_k} > {experts_key}={experts}")
    width = _positive(raw, spelling.intermediate_key, path)
    renorm = spelling.norm_topk
    if isinstance(renorm, str):
        if not isinstance(raw[renorm], bool):
            raise ConfigError(f"{path}: {renorm} must be true or false, got {raw[renorm]!r}")
        renorm = raw[renorm]
    shared = _positive(raw, "shared_expert_intermediate_size", path) if spelling.shared_expert else 0
    n = hf.num_hidden_layers
    sparse = _sparse_layers(raw, path, n) if spelling.sparse_step else (True,) * n
    for key in keys:  # one reading: transformers must build its model from the numbers impl read
        if getattr(hf, key, None) != raw[key]:
            raise ConfigError(f"{path}: transformers reads {key}={getattr(hf, key, None)!r}, the file says "
                              f"{raw[key]!r}")
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=width, renormalize=renorm,
                     shared_expert_intermediate_size=shared, sparse_layers=sparse, spelling=spelling)
