"""Canonical hook points: one name per point, the same for Hugging Face and the engine, in execution order.

Every point's tensor is laid out ``[rows, features]``: rows are the step's tokens of all prompts
concatenated (prompt 0's tokens first), features the hidden / head dims flattened (heads major). For the
KV-cache points (``layers.{i}.kv.k|v``) rows are every cached position of every prompt.

Some points exist only in some model families: ``attn.q_norm`` / ``attn.k_norm`` (``QK_NORM_POINTS``) are
the outputs of the per-head RMSNorms of q and k, before RoPE, of models with ``ModelConfig.qk_norm``
(Qwen3, Gemma 3); ``attn.post_norm`` / ``mlp.post_norm`` (``SANDWICH_POINTS``) the norms Gemma 3 applies to the
attention's and the MLP's outputs before each residual add. ``point_names`` lists a model's points (``model_point_names(cfg)`` reads the flags from its
config); ``all_point_names`` every name tpcheck knows, whatever the model (what a name map is checked
against)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impl.config import ModelConfig


@dataclass(frozen=True)
class Kind:
    """One point kind (a point name's second part, ``split_point``) and what the stages need to know of it: the
    pipeline (which golden points a step keeps, how rows are laid out, which points are routes), the judge
    (routing, tolerances), ``--exact-ops`` and the coverage check all read this table and nothing else.

    * ``family``: where it exists: ``""`` every model; ``"qk_norm"`` models with per-head q/k norms (Qwen3,
      ``ModelConfig.qk_norm``); ``"kv"`` runs with decode steps (the cache read back); ``"dense"`` a dense MLP
      layer; ``"moe"`` a mixture-of-experts layer; ``"shared"`` one with a shared expert (Qwen2-MoE); ``"pp"``
      the last layer of a pipeline stage before the last (``handoffs``: what crosses the stage boundary).
    * ``rows``: ``"tokens"`` the step's rows, prompts concatenated; ``"cache"`` every cached position of every
      prompt (the KV-cache points).
    * ``judged``: ``"floor"`` rel_err against the noise floor; ``"set"`` expert ids compared as a set per token
      (``tpcheck.judge.routing``).
    * ``route``: MoE routing: ``"logits"`` (the router: the golden follows the engine's route from it), ``"ids"``
      and ``"weights"`` (the top-k, put in one order by ``tpcheck.pipeline.routes.sort_routes``).
    * ``routed``: decided by a token's route: a token whose route legitimately flips is left out of it.
    * ``teacher``: a decoder layer's input (``embed``, a layer's ``out``): the local pass's teacher is the
      golden's.
    * ``exact_ops``: ``--exact-ops`` (``tpcheck.measure.exact_ops``): ``"checked"`` its op is held to HF's bits,
      ``"input"`` a checked op reads it, ``"both"``."""

    name: str
    family: str = ""
    rows: str = "tokens"
    judged: str = "floor"
    route: str = ""
    routed: bool = False
    teacher: bool = False
    exact_ops: str = ""


#: every point kind, in execution order (``embed``, a decoder layer's kinds, ``final_norm``, ``logits``)
KIND_TABLE = (
    Kind("embed", teacher=True, exact_ops="input"),
    Kind("input_norm", exact_ops="checked"),
    Kind("attn.q", exact_ops="input"), Kind("attn.k", exact_ops="input"), Kind("attn.v"),
    Kind("attn.q_norm", family="qk_norm", exact_ops="checked"),
    Kind("attn.k_norm", family="qk_norm", exact_ops="checked"),
    Kind("attn.q_rope"), Kind("attn.k_rope"),
    Kind("kv.k", family="kv", rows="cache"), Kind("kv.v", family="kv", rows="cache"),
    Kind("attn.context"),
    Kind("attn.out", exact_ops="input"),
    # Gemma 3's "sandwich" norms: post_attention_layernorm on the attention's output before the residual add, and
    # post_feedforward_layernorm on the MLP's (its MLP input norm, pre_feedforward_layernorm, is post_attn_norm)
    Kind("attn.post_norm", family="sandwich", exact_ops="both"),
    Kind("attn.residual", exact_ops="both"),
    Kind("post_attn_norm", exact_ops="checked"),
    # a mixture-of-experts layer: router logits [rows, E], the chosen experts [rows, k] (ids) and their weights
    # [rows, k] (in ascending expert id order), the routed experts' weighted sum [rows, hidden], and (Qwen2-MoE)
    # the shared expert's output and its gate logit [rows, 1]
    Kind("moe.router", family="moe", route="logits"),
    Kind("moe.topk_ids", family="moe", route="ids", judged="set"),
    Kind("moe.topk_weights", family="moe", route="weights", routed=True),
    Kind("moe.experts", family="moe", routed=True),
    Kind("moe.shared", family="shared"), Kind("moe.shared_gate", family="shared"),
    Kind("mlp.gate", family="dense"), Kind("mlp.up", family="dense"), Kind("mlp.act", family="dense"),
    Kind("mlp.out", routed=True, exact_ops="input"),
    Kind("mlp.post_norm", family="sandwich", routed=True, exact_ops="both"),
    # a pipeline stage boundary after this layer (impl.pipeline): the IntermediateTensors the next stage received,
    # [hidden_states | residual] along features (the layer's mlp.out, then its attn.residual); the engine also
    # holds it bit-equal to what the stage before sent (tpcheck.engines.impl.adapter.stage_points). Before ``out``, the sum
    # of its two parts: vLLM's next stage computes that sum from what it received (tpcheck.engines.vllm.pp)
    Kind("handoff", family="pp", routed=True),
    Kind("out", routed=True, teacher=True, exact_ops="both"),
    Kind("final_norm", exact_ops="checked"),
    Kind("logits"),
)
KINDS = {k.name: k for k in KIND_TABLE}
_OUTSIDE_LAYERS = ("embed", "final_norm", "logits")

LAYER_POINTS = tuple(k.name for k in KIND_TABLE if k.name not in _OUTSIDE_LAYERS)
KV_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "kv")
QK_NORM_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "qk_norm")
SANDWICH_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "sandwich")
DENSE_MLP_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "dense")  # a sparse layer has MOE_POINTS
MOE_POINTS = tuple(k.name for k in KIND_TABLE if k.family in ("moe", "shared"))
SHARED_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "shared")
PP_POINTS = tuple(k.name for k in KIND_TABLE if k.family == "pp")  # a stage boundary's, after its last layer
ROUTED_POINTS = tuple(k.name for k in KIND_TABLE if k.routed)  # what a token's route decides, per layer
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def point_names(num_layers: int, with_kv: bool = False, qk_norm: bool = False, sparse=(),
                shared: bool = False, every: bool = False, handoffs=(), sandwich: bool = False) -> list[str]:
    """The points of a model of ``num_layers`` decoder layers, in execution order. ``with_kv``: the KV-cache
    points too (a run with decode steps reads the cache back); ``qk_norm``: the model normalises q and k per
    head before RoPE (``ModelConfig.qk_norm``), so it has ``attn.q_norm`` / ``attn.k_norm``; ``sparse``: the
    layers that are mixture-of-experts blocks (``MOE_POINTS`` instead of ``DENSE_MLP_POINTS``), ``shared``:
    those have a shared expert; ``handoffs``: the layers after which a pipeline stage hands its
    ``IntermediateTensors`` to the next (``layers.{i}.handoff``); ``sandwich``: the model normalises the attention's
    and the MLP's outputs before their residual adds (Gemma 3: ``attn.post_norm``, ``mlp.post_norm``);
    ``every``: every name of every kind of layer.
    The default is a dense model
    without q/k norms (Qwen2, Llama, Mistral): every point such a model has, and no other."""
    names = ["embed"]
    for i in range(num_layers):
        moe = i in sparse
        names += [f"layers.{i}.{p}" for p in LAYER_POINTS
                  if (with_kv or p not in KV_POINTS) and (qk_norm or p not in QK_NORM_POINTS) and
                  (sandwich or p not in SANDWICH_POINTS) and
                  (every or (p not in MOE_POINTS if not moe else p not in DENSE_MLP_POINTS and
                                                                 (shared or p not in SHARED_POINTS))) and
                  (every or p not in PP_POINTS or i in handoffs)]
    return names + ["final_norm", "logits"]


def model_point_names(cfg: ModelConfig, with_kv: bool = False, handoffs=()) -> list[str]:
    """``point_names`` of the model ``cfg`` describes (its layer count and family options); ``handoffs``: the
    layers that end a pipeline stage before the last (``stage_handoffs``)."""
    moe = getattr(cfg, "moe", None)
    sparse = () if moe is None else {i for i in range(cfg.num_layers) if cfg.is_sparse(i)}
    return point_names(cfg.num_layers, with_kv, qk_norm=cfg.qk_norm, sparse=sparse,
                       shared=moe is not None and moe.shared_expert_intermediate_size > 0, handoffs=handoffs,
                       sandwich=getattr(cfg, "gemma", None) is not None)


def stage_handoffs(partition) -> tuple[int, ...]:
    """The layers after which a stage hands over to the next, of a pipeline's layers per stage
    (``impl.pipeline.layer_partition``): ``(3, 1)`` -> ``(2,)``; one stage -> ``()``."""
    ends, end = [], 0
    for n in list(partition)[:-1]:
        end += n
        ends.append(end - 1)
    return tuple(ends)


def all_point_names(num_layers: int) -> list[str]:
    """Every canonical name of a ``num_layers``-layer model of any family, in execution order: what a reported
    or mapped name is checked against (a name outside it is a misconfigured map)."""
    return point_names(num_layers, with_kv=True, qk_norm=True, every=True, sandwich=True)


def point_order(name: str) -> int:
    """A number that sorts point names in execution order (``embed``, each layer's points in ``LAYER_POINTS``
    order, ``final_norm``, ``logits``): the same in every pass of a run, whatever the model."""
    layer, kind = split_point(name)
    if layer is None:
        return {"embed": -1}.get(kind, 10**9 + (kind == "logits"))
    return layer * 1000 + (LAYER_POINTS.index(kind) if kind in LAYER_POINTS else len(LAYER_POINTS))


def split_point(name: str) -> tuple[int | None, str]:
    """``layers.3.attn.q`` -> ``(3, "attn.q")``; ``logits`` -> ``(None, "logits")``. The second part is the
    point's *kind*, the key for per-kind tolerances."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def point_stage(name: str, stages) -> int:
    """The pipeline stage that computes point ``name`` (``stages``: each stage's ``[start, end)`` layers): a layer's
    point on the stage holding the layer, the embedding on the first, the final norm and the logits on the last;
    a stage boundary's ``handoff`` (after the last layer of stage s) on the stage that received it, s + 1: what the
    next layers were given."""
    layer, kind = split_point(name)
    if layer is None:
        return 0 if name == "embed" else len(stages) - 1
    owner = next(s for s, (start, end) in enumerate(stages) if start <= layer < end)
    return owner + 1 if kind == "handoff" else owner


def fused_out_stage(name: str, stages) -> int:
    """The stage whose ranks report point ``name`` in an engine that adds a layer's MLP output to its residual in
    the *next* layer's fused add + RMSNorm (vLLM): as ``point_stage``, except the output of a stage's last layer
    before the last stage (``layers.{end-1}.out``), which that add computes, and reports, on the next stage from
    what it received."""
    layer, kind = split_point(name)
    owner = point_stage(name, stages)
    if kind == "out" and layer is not None and owner < len(stages) - 1 and layer == stages[owner][1] - 1:
        return owner + 1
    return owner


def kind_of(name: str) -> Kind:
    """The ``Kind`` of point ``name`` (``layers.3.kv.k`` -> ``kv.k``'s); a name of no known kind is a KeyError
    (names are checked against ``all_point_names`` where they enter: ``tpcheck.judge.coverage.check_known``)."""
    kind = split_point(name)[1]
    try:
        return KINDS[kind]
    except KeyError:
        raise KeyError(f"point {name!r}: unknown point kind {kind!r} (kinds: {', '.join(KINDS)})") from None
