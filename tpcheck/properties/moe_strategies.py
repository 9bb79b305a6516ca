"""Hypothesis strategies for mixture-of-experts models (``tpcheck.properties.strategies`` draws them when its families
include ``MOE_FAMILIES``): the number of experts, top-k, the experts' width, Qwen2-MoE's shared expert, top-k
renormalisation, which layers are sparse, and an expert-parallel size that splits them at the drawn tp.

Every option is drawn whatever the family (as ``strategies._shape`` does), so the shrinker compares like with
like; it shrinks toward 4 experts, top-2, the narrowest experts, every layer sparse, ep 1."""
from __future__ import annotations

from hypothesis import strategies as st

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
EXPERTS = (4, 8, 2, 6)
TOP_K = (2, 1, 3, 4)
EP_SIZES = (1, 2, 4)


def base_family(model_type: str) -> str:
    """The dense family whose attention an MoE family has: what ``strategies._family`` draws its options as."""
    return {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}.get(model_type, model_type)


@st.composite
def moe_options(draw, model_type: str, num_layers: int, unit: int, dense_width: int) -> dict:
    """The MoE keys of a config of ``model_type`` with ``num_layers`` layers: widths are multiples of ``unit`` (a
    multiple of every tp drawn), Mixtral's experts are ``dense_width`` wide (its ``intermediate_size``)."""
    experts = draw(st.sampled_from(EXPERTS))
    top_k = min(draw(st.sampled_from(TOP_K)), experts)
    width = unit * draw(st.integers(1, 4))
    shared = unit * draw(st.integers(1, 4))
    renormalize = draw(st.booleans())
    dense_last = draw(st.booleans()) and num_layers > 1  # Qwen: the last layer a dense MLP (mlp_only_layers)
    if model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": dense_width}
    out = {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
           "norm_topk_prob": renormalize, "decoder_sparse_step": 1,
           "mlp_only_layers": [num_layers - 1] if dense_last else []}
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = shared
    return out


def ep_choices(config: dict, tp: int) -> list[int]:
    """The expert-parallel sizes that split ``config``'s experts at ``tp`` (``tp % ep == 0``, ``E % ep == 0``;
    widths are multiples of tp already)."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        return [1]
    return [ep for ep in EP_SIZES if tp % ep == 0 and experts % ep == 0]


def draw_ep(draw, config: dict, tp: int) -> int:
    """An expert-parallel size for an MoE ``config`` at ``tp`` (1 for a dense one, with nothing drawn)."""
    choices = ep_choices(config, tp)
    return 1 if len(choices) == 1 else draw(st.sampled_from(choices))
