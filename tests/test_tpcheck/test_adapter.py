"""The adapter protocol of docs/adapters.md, end to end through ``compare_engine``, with an engine that is not
impl: Hugging Face itself at the test dtype, reported as if it ran on 2 ranks (q and gate/up sharded, mlp.out
as two partial sums). Its every point must then carry exactly the noise floor's error, its ops HF's bits; a
rank order swapped in one report must fail at that point."""
from __future__ import annotations

import pytest

from hf_engine import PROMPTS, TwoRankHF
from tpcheck.pipeline.diff import compare_engine






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
