"""A sparse layer's ops on the engine's own inputs (``tpcheck.measure.own_moe``): the router, the routed experts'
weighted sum, the shared expert and its gate, the block's output; and the judge's inherited rule through them."""
from __future__ import annotations

import pytest
import torch

from tpcheck.measure.own_input import input_points, own_error
from tpcheck.measure.own_moe import layer_kind
from tpcheck.reference.hf import HFCapture, new_cache

PROMPT = [5, 17, 42, 9, 3, 77, 12, 250]


def _points(model):
    return HFCapture(model).step([PROMPT], [new_cache(model)], [0])


def test_input_points_of_a_sparse_layer():
    assert input_points("layers.1.moe.experts", 2, moe="moe") == \
        ["layers.1.post_attn_norm", "layers.1.moe.topk_ids", "layers.1.moe.topk_weights"]
    assert input_points("layers.1.mlp.out", 2, moe="moe") == ["layers.1.moe.experts"]
    assert input_points("layers.0.mlp.out", 2, moe="shared") == \
        ["layers.0.moe.experts", "layers.0.moe.shared_gate", "layers.0.moe.shared"]
    assert input_points("layers.0.moe.router", 2, moe="moe") == ["layers.0.post_attn_norm"]
    assert input_points("layers.0.mlp.out", 2) == ["layers.0.mlp.act"]  # a dense layer's
    assert input_points("layers.0.moe.router", 2) is None


@pytest.mark.parametrize("preset,kind", [("tiny-mixtral", "moe"), ("tiny-qwen2-moe", "shared"),
                                         ("tiny-qwen3-moe", "moe")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_correct_engine_s_sparse_ops_have_no_own_error(ckpt, hf_model, preset, kind, dtype):
    """Hugging Face at the run's dtype as the engine (its grouped experts kernel, its roundings): every sparse op
    recomputed on its own inputs is within the allowance, at every layer."""
    d = ckpt(preset)
    gold, eng = _points(hf_model(d, "float64")), _points(hf_model(d, dtype))
    model = hf_model(d, dtype)
    assert layer_kind(model, 0) == kind
    names = [n for n in gold if n.split(".", 2)[-1] in
             ("moe.router", "moe.experts", "moe.shared", "moe.shared_gate", "mlp.out", "out")]
    assert len(names) >= 8
    for n in names:
        assert own_error(model, n, eng[n], gold[n], eng.__getitem__) == 0, n


def test_a_wrong_expert_weight_or_gate_is_the_op_s_own_error(ckpt, hf_model):
    """Errors made inside the sparse block on right inputs stay at (nearly) full size in ``own_err``: the experts'
    sum with one slot's weight left out, an expert's output from another expert, the shared expert added
    ungated."""
    d = ckpt("tiny-qwen2-moe")
    gold, eng = _points(hf_model(d, "float64")), _points(hf_model(d, "bfloat16"))
    model = hf_model(d, "bfloat16")
    n = "layers.0.moe.experts"
    get = eng.__getitem__
    w = eng["layers.0.moe.topk_weights"].clone()
    w[:, 0] = 0  # the first slot dropped: the op on these weights is the op the engine ran (no own error) ...
    assert own_error(model, n, eng[n], gold[n], {**eng, "layers.0.moe.topk_weights": w}.__getitem__) > 0.1
    ids = eng["layers.0.moe.topk_ids"]
    other = (ids + 1) % int(ids.max() + 1)  # every token's experts shifted by one
    assert own_error(model, n, eng[n], gold[n], {**eng, "layers.0.moe.topk_ids": other}.__getitem__) > 0.1
    out = "layers.0.mlp.out"
    ungated = (eng[n].double() + eng["layers.0.moe.shared"].double()).to(torch.bfloat16)
    assert own_error(model, out, eng[out], gold[out], get) == 0
    assert own_error(model, out, ungated, gold[out], get) > 0.05
    doubled = eng["layers.0.moe.shared"] * 2
    sh = "layers.0.moe.shared"
    assert own_error(model, sh, doubled, gold[sh], get) > 0.5


def test_a_sparse_layer_passes_an_inherited_error(ckpt, engines):
    """Under a bound no rounding meets at the sparse block's points (router, experts, shared expert and gate, the
    block's output, the layer's output), each goes over and passes as inherited, its op right on the engine's own
    inputs (before, these points had no op: each failed where it landed; the test fails on that code)."""
    import tpcheck
    from tpcheck.judge.tolerances import Tolerances
    kinds = ("moe.router", "moe.experts", "moe.shared", "moe.shared_gate", "mlp.out", "out")
    tight = {k: {"rel_max": {"*": 1e-12}} for k in kinds}
    r = tpcheck.diff(model=str(ckpt("tiny-qwen2-moe")), tp=2, dtype="bfloat16", prompts=[[3, 9, 27, 81, 5]],
                     decode_steps=1, pool=engines, tolerances=Tolerances(kinds=tight))
    t = r.table[r.table["kind"].isin(kinds) & (r.table["point"].str.startswith("layers."))]
    # layers 0 and 2 sparse (six points each), layer 1 dense (mlp.out, out): 14 points, two steps, two passes
    assert len(t) == 14 * 2 * 2 and (t["rel_err"] > 1e-12).all(), t[["point", "rel_err"]]
    # the rest pass raw, within one ulp of the element that holds their norm (the gate's one logit per token)
    assert (t["inherited"] | (t["rel_err"] <= t["rel_floor"] + 1e-12)).all() and (t["own_err"] == 0).all()
    assert set(t.loc[t["inherited"], "kind"]) == set(kinds) and r.passed, r.summary()
