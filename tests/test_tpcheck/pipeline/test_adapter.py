"""The adapter protocol of docs/adapters.md, end to end through ``compare_engine``, with an engine that is not
impl: Hugging Face itself at the test dtype, reported as if it ran on 2 ranks (q and gate/up sharded, mlp.out
as two partial sums). Its every point must then carry exactly the noise floor's error, its ops HF's bits; a
rank order swapped in one report must fail at that point."""
from __future__ import annotations

import pytest

from hf_engine import PROMPTS, TwoRankHF
from tpcheck.pipeline.diff import compare_engine


class SampledLogits(TwoRankHF):
    """``TwoRankHF`` whose logits hold only each prompt's last row at the prefill (``point_rows``, as vLLM samples),
    its lm_head ``scale`` times off there."""

    def __init__(self, model_dir, dtype: str, scale: float):
        super().__init__(model_dir, dtype)
        self.scale, self.point_rows = scale, {}

    def step(self, new_tokens, teacher, capture_kv):
        out = super().step(new_tokens, teacher, capture_kv)
        lens = [len(t) for t in new_tokens]
        self.point_rows = {}
        if max(lens) > 1:
            rows = [sum(lens[:i + 1]) - 1 for i in range(len(lens))]
            placement, ranks = out["logits"]
            out["logits"] = (placement, [t[rows] * self.scale for t in ranks])
            self.point_rows = {"logits": rows}
        return out

@pytest.mark.parametrize("dtype,isolate", [("bfloat16", True), ("float32", False)])
def test_hf_as_the_engine_sits_exactly_on_the_noise_floor(dtype, isolate, ckpt):
    d = str(ckpt("tiny"))
    r = compare_engine(TwoRankHF(d, dtype), d, PROMPTS, dtype, decode_steps=2, isolate=isolate,
                       exact_ops=True)
    assert r.passed, r.summary()
    t = r.table
    assert len(t) > 0 and set(t["step"]) == {0, 1, 2}
    assert (t["rel_err"] == t["ref_rel_err_hf"]).all()  # unsharded back to HF's own tensors, bit for bit
    assert (t["rel_err"] <= t["ref_rel_err"]).all()  # the floor: the largest reference error so far
    assert (t["op_mismatch"].dropna() == 0).all() and t["op_mismatch"].notna().any()


def test_swapped_rank_order_fails_at_that_point(ckpt):
    d = str(ckpt("tiny"))
    r = compare_engine(TwoRankHF(d, "float32", swap="layers.1.mlp.up"), d, PROMPTS, "float32")
    fd = r.first_divergence
    assert (fd["point"], fd["step"]) == ("layers.1.mlp.up", 0), r.summary()
    assert fd["excess"] > 1e3


def test_replicas_a_few_ulps_apart_pass_and_are_reported(ckpt):
    """An engine whose ranks add an all-reduce's partials in their own order (vLLM's CPU shared-memory all-reduce
    at tp >= 3) holds replicas an ulp or so apart: correct rounding, within the noise floor, shown per row."""
    d = str(ckpt("tiny"))
    r = compare_engine(TwoRankHF(d, "float32", ulps=True), d, PROMPTS, "float32")
    assert r.passed, r.summary()
    t = r.table
    replicated = ~t["kind"].isin(["attn.q", "mlp.gate", "mlp.up", "mlp.out"])
    assert ((t.loc[replicated, "rank_spread"] > 0) & (t.loc[replicated, "rank_spread"] < 2 ** -23)).all()
    assert (t.loc[replicated, "rank_spread_by"] == "0 vs 1").all()
    assert t.loc[~replicated, "rank_spread"].isna().all()  # sharded or partial: no replicas
    assert (t["rel_err"] == t["ref_rel_err_hf"]).all()  # rank 0's tensor is the one compared


def test_a_rank_holding_other_data_fails_at_that_point_naming_the_ranks(ckpt):
    d = str(ckpt("tiny"))
    r = compare_engine(TwoRankHF(d, "float32", stray="layers.1.attn.out"), d, PROMPTS, "float32")
    fd = r.first_divergence
    assert (fd["point"], fd["step"]) == ("layers.1.attn.out", 0), r.summary()
    assert fd["rank_spread"] == pytest.approx(0.5) and fd["rank_spread_by"] == "0 vs 1" and fd["note"] == ""
    assert fd["excess"] > 1e4 and fd["rel_err"] <= fd["threshold"]  # rank 0 holds the right values
    assert "origin: layers.1.attn.out (step 0): " in r.summary() and "  why: ranks disagree: ranks 0 vs 1 differ by " \
        "0.5; rel_err " in r.summary() and "  next: check the o_proj all-reduce" in r.summary()
    assert (~r.table["passed"]).sum() == 1  # the other ranks' points and every later point agree


def test_a_point_of_some_rows_gets_its_own_op_measured_on_those_rows(ckpt):
    """The inherited-error rule at a point the engine holds some rows of (vLLM's logits: the sampled rows): the op
    (lm_head) is redone on those rows of its input, so a lm_head that errs by itself is its own error (fails, not
    inherited) and a correct one's is within the kernel allowance (``own_err`` 0)."""
    d = str(ckpt("tiny"))
    bad = compare_engine(SampledLogits(d, "float32", 1 + 1e-3), d, PROMPTS, "float32", decode_steps=1)
    row = bad.table[(bad.table["point"] == "logits") & (bad.table["step"] == 0)].iloc[0]
    assert bad.first_divergence["point"] == "logits" and not row["passed"] and not row["inherited"]
    assert row["own_err"] == pytest.approx(row["rel_err"], rel=0.05)  # the op's own error, measured on 2 rows
    assert bad.meta["coverage"]["rows_not_produced"] == {"logits": 9}
    clean = compare_engine(SampledLogits(d, "float32", 1.0), d, PROMPTS, "float32", decode_steps=1)
    assert clean.passed, clean.summary()
