"""The mixture-of-experts layer (``impl.layers.moe``) and its config (``impl.moe_config``) in-process: the config read
strictly (a missing field named, HF's sparse-layer rule, refused options), routing and the block against HF's own
modules (bit for bit where the ops are the same), each (tp, ep) rank's partial sums adding up to the tp 1 block with
one all-reduce, the loader reading only a rank's experts, ``ShardPlan`` counting what each rank holds.

Simulated ranks (``fake_tp.fake_rank``) build and load the model as rank r of tp; the end-to-end engine tests are
in ``test_moe.py``."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fake_tp import fake_rank
from hf_compare import edit_config, edit_tensors
from impl.config import ConfigError, load_config
from impl.layers.mlp import GatedMLP
from impl.layers.moe import SparseMoeBlock
from impl.loader import LoadError, load_weights
from impl.models import model_class
from impl.placements import Partial, Replicate
from impl.shard_plan import shard_plan

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


def build(d, rank=0, tp=1, ep=1, dtype=torch.float32, load=True):
    cfg = load_config(d)
    with fake_rank(rank, tp):
        model = model_class(cfg)(cfg, dtype, ep)
        read = load_weights(model, d, dtype) if load else None
    return model, read


# ------------------------------------------------------------------------------------------------ config
EXPECTED = {  # preset: (experts, top_k, width, renormalize, shared width, sparse layers, weights cast, windows)
    "tiny-qwen2-moe": (8, 2, 32, False, 48, (True, False, True), True, ()),
    "tiny-qwen3-moe": (8, 2, 32, True, 0, (True, True), True, ()),
    "tiny-mixtral": (8, 2, 32, True, 0, (True, True), False, (16, 16)),
    "tiny-moe-ties": (8, 3, 32, True, 0, (True, True), True, ()),
}


@pytest.mark.parametrize("preset", list(EXPECTED))
def test_config_fields(preset, ckpt):
    cfg = load_config(ckpt(preset))
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.renormalize, m.shared_expert_intermediate_size,
            m.sparse_layers, m.spelling.weights_in_activation_dtype, cfg.sliding_windows) == EXPECTED[preset]
    assert (cfg.qkv_bias, cfg.qk_norm) == {"tiny-qwen2-moe": (True, False), "tiny-mixtral": (False, False)}.get(
        preset, (False, True))


MISSING = [("tiny-qwen2-moe", k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "norm_topk_prob", "shared_expert_intermediate_size")]
MISSING += [("tiny-qwen3-moe", "norm_topk_prob"), ("tiny-mixtral", "num_local_experts"),
            ("tiny-mixtral", "num_experts_per_tok"), ("tiny-mixtral", "intermediate_size")]


@pytest.mark.parametrize("preset,key", MISSING)
def test_missing_field_named_not_defaulted(preset, key, ckpt, tmp_path):
    d = edit_config(ckpt(preset), tmp_path / "x", lambda raw: raw.pop(key))
    with pytest.raises(ConfigError, match=rf"needs {key} in config.json \(impl does not take transformers' default"):
        load_config(d)


def test_qwen3_moe_experts_under_either_name(ckpt, tmp_path):
    """transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``; published checkpoints say
    ``num_experts``: both are read, and a config that has neither names the family's own key."""
    src = ckpt("tiny-qwen3-moe")
    assert "num_local_experts" in json.loads((src / "config.json").read_text())
    d = edit_config(src, tmp_path / "own", lambda raw: raw.update(num_experts=raw.pop("num_local_experts")))
    assert load_config(d).moe.num_experts == 8
    with pytest.raises(ConfigError, match="needs num_experts in config.json"):
        load_config(edit_config(src, tmp_path / "none", lambda raw: raw.pop("num_local_experts")))


@pytest.mark.parametrize("preset,edit,message", [
    ("tiny-qwen2-moe", dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    ("tiny-qwen3-moe", dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    ("tiny-qwen2-moe", dict(mlp_only_layers=[3]), r"mlp_only_layers names layer\(s\) \[3\] outside 0..2"),
    ("tiny-qwen3-moe", dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer, got 0"),
    ("tiny-mixtral", dict(num_experts_per_tok=9), "num_experts_per_tok=9 > num_local_experts=8"),
    ("tiny-mixtral", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_refused_options(preset, edit, message, ckpt, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(edit_config(ckpt(preset), tmp_path / "x", lambda raw: raw.update(edit)))


@pytest.mark.parametrize("edit", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0]),
                                  dict(decoder_sparse_step=2, mlp_only_layers=[1]), dict(decoder_sparse_step=1)])
def test_sparse_layers_follow_hf(edit, ckpt, tmp_path):
    """Which layers are sparse: impl's reading = the module HF's own model builds for each layer."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = load_config(edit_config(ckpt("tiny-qwen3-moe"), tmp_path / "x", lambda raw: raw.update(edit)))
    hf = Qwen3MoeForCausalLM(cfg.hf)
    assert cfg.moe.sparse_layers == tuple(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers)
    with fake_rank(0, 1):
        model = model_class(cfg)(cfg)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == list(cfg.moe.sparse_layers)
    assert all(isinstance(layer.mlp, GatedMLP) for layer, s in zip(model.model.layers, cfg.moe.sparse_layers)
               if not s)


@pytest.mark.parametrize("tp,ep,message", [
    (4, 3, "tp_size=4 is not divisible by ep_size=3"),
    (2, 4, "tp_size=2 is not divisible by ep_size=4"),
    (1, 0, "ep_size must be >= 1, got 0"),
])
def test_layouts_refused_with_numbers(tp, ep, message, ckpt):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(ckpt("tiny-qwen2-moe")).check_tp(tp, ep)


@pytest.mark.parametrize("edit,tp,ep,message", [
    (dict(num_experts=6), 4, 4, "^num_experts=6 is not divisible by ep_size=4$"),
    (dict(moe_intermediate_size=30), 4, 1, r"^moe_intermediate_size=30 is not divisible by tp_size/ep_size=4/1=4 "),
    (dict(shared_expert_intermediate_size=50), 4, 2, "^shared_expert_intermediate_size=50 is not divisible by tp_size=4$"),
    (dict(intermediate_size=90), 4, 4, "^intermediate_size=90 is not divisible by tp_size=4$"),  # the dense layer
])
def test_expert_sizes_refused_with_numbers(edit, tp, ep, message, ckpt, tmp_path):
    cfg = load_config(edit_config(ckpt("tiny-qwen2-moe"), tmp_path / "x", lambda raw: raw.update(edit)))
    with pytest.raises(ConfigError, match=message):
        cfg.check_tp(tp, ep)


def test_ep_makes_a_layout_possible(ckpt, tmp_path):
    """Width 30 cannot split 4 ways, but at ep 2 each expert splits over the 2 ranks of its group; a model with no
    dense layer does not need its (unused) ``intermediate_size`` to divide tp."""
    cfg = load_config(edit_config(ckpt("tiny-qwen3-moe"), tmp_path / "x",
                                  lambda raw: raw.update(moe_intermediate_size=30, intermediate_size=90)))
    cfg.check_tp(4, 2)
    with pytest.raises(ConfigError, match="moe_intermediate_size=30"):
        cfg.check_tp(4, 1)


# ------------------------------------------------------------------------------------------------ vs HF's modules
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-moe-ties"])
def test_block_is_hf_bit_for_bit(preset, dtype, ckpt, hf_model):
    """Router logits, top-k weights (their dtype: the activations' for Qwen, float32 for Mixtral) and ids equal
    HF's router's bit for bit; in bfloat16 the whole block equals HF's (its default grouped_mm experts) bit for
    bit; in float32 within 1e-6 (another matmul kernel)."""
    d = ckpt(preset)
    hf = hf_model(d, str(dtype).removeprefix("torch."))
    model, _ = build(d, dtype=dtype)
    x = torch.randn(37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        hb, ib = hf.model.layers[0].mlp, model.model.layers[0].mlp
        logits, weights, ids = hb.gate(x)
        got_logits = ib.gate(x)
        got_weights, got_ids = ib.topk(got_logits)
        ref, got = hb(x[None])[0], ib(x)
    assert torch.equal(got_logits, logits) and torch.equal(got_ids, ids) and torch.equal(got_weights, weights)
    assert got_weights.dtype == weights.dtype == (torch.float32 if preset == "tiny-mixtral" else dtype)
    assert got_ids.dtype == torch.int64 and got_ids.shape == (37, model.cfg.moe.top_k)
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        assert (got - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("tp,ep", LAYOUTS[1:])
@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_partials_sum_to_the_block(preset, tp, ep, ckpt):
    """Each simulated rank's experts output (before the block's all-reduce) is a partial sum: the ranks' outputs
    add up to the tp 1 block's, and the block all-reduces once (routed and shared experts together)."""
    d = ckpt(preset)
    full, _ = build(d)
    x = torch.randn(29, full.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = full.model.layers[0].mlp(x)
    parts = []
    for r in range(tp):
        model, _ = build(d, r, tp, ep)
        block = model.model.layers[0].mlp
        assert isinstance(block.experts.output_placement, Partial) and isinstance(block.output_placement, Replicate)
        assert block.experts.layout.local_experts == range(r // (tp // ep) * 8 // ep, (r // (tp // ep) + 1) * 8 // ep)
        assert block.experts.w13_weight.shape == (8 // ep, 2 * 32 * ep // tp, full.cfg.hidden_size)
        with fake_rank(r, tp) as calls, torch.no_grad():
            parts.append(block(x))
        assert calls["all_reduce"] == 1, calls
    assert (torch.stack(parts).sum(0) - want).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------------ loader
@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2), (4, 4), (4, 1)])
def test_rank_reads_only_its_experts(tp, ep, ckpt):
    """What the loader read (``load_weights``' return): rank r's group's experts, ``1 / (tp/ep)`` of each, and
    no byte of another group's; Mixtral's checkpoint names (``block_sparse_moe.experts.{e}.w1``)."""
    d = ckpt("tiny-mixtral")
    moe_tp, n = tp // ep, 8 // ep
    for r in range(tp):
        _, read = build(d, r, tp, ep)
        for layer in range(2):
            m = f"model.layers.{layer}.block_sparse_moe."
            experts = {k: v for k, v in read.items() if k.startswith(m + "experts.")}
            group = r // moe_tp
            assert sorted({int(k.split(".")[5]) for k in experts}) == list(range(group * n, (group + 1) * n))
            assert set(experts.values()) == {32 * 64 // moe_tp} and len(experts) == 3 * n
            assert read[m + "gate.weight"] == 8 * 64


def test_missing_expert_named_only_where_held(ckpt, tmp_path):
    d = tmp_path / "x"
    shutil.copytree(ckpt("tiny-qwen2-moe"), d)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    edit_tensors(d, lambda t: t.__delitem__(gone))  # changes the dict in place (returns None)
    with pytest.raises(LoadError, match=rf"lacks 1 tensor\(s\): \['{gone}'\]"):
        build(d)
    build(d, rank=0, tp=2, ep=2)  # experts 0-3: expert 5 is rank 1's business
    with pytest.raises(LoadError, match="lacks 1 tensor"):
        build(d, rank=1, tp=2, ep=2)


@pytest.mark.parametrize("extra,hint", [
    ("model.layers.0.mlp.experts.8.gate_proj.weight", "no parameter for it$"),
    ("model.layers.1.mlp.experts.0.gate_proj.weight", "no parameter for it$"),  # layer 1 is dense
    ("model.layers.0.mlp.experts.gate_up_proj", "experts fused in one 3-D tensor"),
])
def test_unexpected_expert_tensor_refused(extra, hint, ckpt, tmp_path):
    d = tmp_path / "x"
    shutil.copytree(ckpt("tiny-qwen2-moe"), d)
    edit_tensors(d, lambda t: t.update({extra: torch.zeros(32, 64)}))
    for rank, tp, ep in ((0, 1, 1), (1, 4, 4)):  # a tensor no rank has a place for is an error on every rank
        with pytest.raises(LoadError, match=rf"unexpected tensor '{extra}'.*{hint}"):
            build(d, rank, tp, ep)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_shard_plan_counts_what_each_rank_holds(preset, tp, ep, ckpt):
    d = ckpt(preset)
    cfg = load_config(d)
    plan = shard_plan(cfg, tp, ep)
    shapes = {n: list(t.shape) for n, t in load_file(str(d / "model.safetensors")).items()}
    for r in range(tp):
        model, _ = build(d, r, tp, ep, load=False)
        want = sum(plan.tensor_elements(n, s, cfg.tie_word_embeddings, rank=r) for n, s in shapes.items())
        assert sum(p.numel() for p in model.parameters()) == want, r


# ------------------------------------------------------------------------------------------------ presets
def test_ties_preset_draws_near_ties(ckpt, hf_model):
    """``tiny-moe-ties``: router rows in pairs 1% apart, so in HF's own float32 router most tokens' 3rd and 4th
    logits (the top-3 boundary) are within 0.02 of each other, where the other presets' rarely are."""
    from tpcheck.inputs.models.checkpoints import describe_preset
    assert "top-3 of 8 experts renormalised; near-tie router rows (pairs 0.01 apart)" in describe_preset("tiny-moe-ties")
    router = load_file(str(ckpt("tiny-moe-ties") / "model.safetensors"))["model.layers.0.mlp.gate.weight"]
    spread = (router[1::2] - router[0::2]).norm(dim=-1) / router[0::2].norm(dim=-1)
    assert ((spread > 0.005) & (spread < 0.02)).all(), spread
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    share = {}
    for preset in ("tiny-moe-ties", "tiny-qwen3-moe"):
        hf, logits = hf_model(ckpt(preset)), []
        hook = hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, o, out=logits: out.append(o[0]))
        with torch.no_grad():
            hf(ids)
        hook.remove()
        k = hf.config.num_experts_per_tok
        top = logits[0].topk(k + 1, dim=-1).values
        share[preset] = ((top[:, k - 1] - top[:, k]) < 0.02).float().mean().item()
    assert share["tiny-moe-ties"] > 0.5 and share["tiny-qwen3-moe"] < 0.1, share
