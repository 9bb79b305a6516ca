"""The narrow-point floor and the gain statistic on live runs of impl: one-token prompts on a Qwen2-MoE gate logit
pass, and the two faults they exist for are found at their origin (``moe_shared_gate_reduced``: a doubled gate
logit at tp 2; ``residual_gain``: a residual add scaled by 1 + 2^-7) in bfloat16."""
from __future__ import annotations

import pytest

import tpcheck
from tpcheck.inputs.models.checkpoints import preset_available

moe = pytest.mark.skipif(not preset_available("tiny-qwen2-moe"), reason="MoE presets need transformers 5")


@moe
@pytest.mark.parametrize("prompt", [197, 18])
def test_one_token_prompt_passes_at_the_gate_logit(prompt, ckpt, engines):
    """A one-token prompt makes each step's gate logit one element: [197] reached a near-zero logit at step 2
    (1.35x on one machine), [18] a small one at the prefill (1.12x here), both under the per-row rule."""
    r = tpcheck.diff(model=str(ckpt("tiny-qwen2-moe")), tp=2, dtype="float32", prompts=[[prompt]], decode_steps=4,
                     pool=engines)
    assert r.passed, r.summary()
    gate = r.table[r.table["kind"] == "moe.shared_gate"]
    assert gate["excess"].max() < 0.7


@moe
def test_doubled_gate_logit_is_found_at_the_gate_in_bfloat16(ckpt, engines):
    r = tpcheck.diff(model=str(ckpt("tiny-qwen2-moe")), tp=2, dtype="bfloat16", seq_len=16, batch=2,
                     inject=["moe_shared_gate_reduced"], inject_layer=2, pool=engines)
    fd = r.first_divergence
    assert (fd["point"], fd["step"]) == ("layers.2.moe.shared_gate", 0), r.summary()
    assert fd["excess"] > 10  # before: the gate's threshold ~3 (one near-zero logit), 0.34x


def test_residual_gain_is_found_at_its_origin_in_bfloat16(ckpt, engines):
    r = tpcheck.diff(model=str(ckpt("small")), tp=2, dtype="bfloat16", inject=["residual_gain"], inject_layer=2,
                     pool=engines)
    fd = r.first_divergence
    assert (fd["point"], fd["step"], fd["mode"]) == ("layers.2.attn.residual", 0, "isolated"), r.summary()
    assert fd["excess"] >= 3 and fd["rel_err"] < fd["threshold"]  # the gain finds it, rel_err does not
    assert abs(fd["gain"] - 2**-7) < 1.5e-3 and "why: a systematic gain: every element scaled by +0.00" in r.summary()
    prop = r.table[(r.table["mode"] == "propagated") & (r.table["point"] == "layers.2.attn.residual")]
    assert prop["gain_threshold"].isna().all() and prop["gain"].isna().all()  # the local pass alone
