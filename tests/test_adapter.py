"""The adapter protocol of docs/adapters.md, end to end through ``compare_engine``, with an engine that is not
impl: Hugging Face itself at the test dtype, reported as if it ran on 2 ranks (q and gate/up sharded, mlp.out
as two partial sums). Its every point must then carry exactly the noise floor's error, its ops HF's bits; a
rank order swapped in one report must fail at that point."""
from __future__ import annotations

import pytest

from impl.placements import Partial, Replicate, Shard
from tpcheck.capture_hf import HFCapture, load_hf_model, new_cache
from tpcheck.layer_diff import compare_engine
from tpcheck.points import split_point



class TwoRankHF:
    """An ``EngineAdapter`` over HF ``Qwen2ForCausalLM``; ``swap``: a sharded point whose ranks it reports in
    the wrong order."""

    def __init__(self, model_dir, dtype: str, swap: str | None = None):
        self.cap, self.swap = HFCapture(load_hf_model(model_dir, dtype)), swap

    def begin(self, prompts, decode_steps):
        self.caches, self.starts = [new_cache(self.cap.model) for _ in prompts], [0] * len(prompts)

    def step(self, new_tokens, teacher, capture_kv):
        points = self.cap.step(new_tokens, self.caches, self.starts, teacher, capture_kv)
        self.starts = [s + len(t) for s, t in zip(self.starts, new_tokens)]
        out = {}
        for name, t in points.items():
            kind = split_point(name)[1]
            if kind in ("attn.q", "mlp.gate", "mlp.up"):
                ranks = list(t.chunk(2, dim=-1))
                out[name] = (Shard(-1), ranks[::-1] if name == self.swap else ranks)
            elif kind == "mlp.out":
                out[name] = (Partial(), [t / 2, t / 2])  # halves of a float sum back exactly
            else:  # replicated points and the KV cache contents
                out[name] = (Replicate(), [t, t])
        return out

    def close(self):
        self.caches = []


PROMPTS = [[5, 17, 42, 99, 7, 3, 1, 64], [200, 11, 9]]


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
