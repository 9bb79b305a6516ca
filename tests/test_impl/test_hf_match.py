"""impl's logits against Hugging Face Qwen2ForCausalLM on the same checkpoint, float32, tp 1/2/4.

Each case asserts max |diff| <= 1e-4 and the same argmax wherever HF's top-2 gap exceeds 1e-4."""
from __future__ import annotations

import random

import pytest
import torch

CASES = [(p, tp) for p in ("tiny", "tiny-untied", "tiny-mha", "tiny-mqa", "small") for tp in (1, 2, 4)]
LENGTHS = (1, 2, 17, 64, 300)


def check_logits(got: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4) -> None:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all()
    diff = (got.double() - ref.double()).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("preset,tp", CASES, ids=[f"{p}-tp{t}" for p, t in CASES])
def test_logits_match_hf(preset, tp, ckpt, engines, hf_model):
    d = ckpt(preset)
    llm = engines.get(d, tp)
    hf = hf_model(d)
    rng = random.Random(f"{preset}-{tp}")
    for n in LENGTHS:
        ids = [rng.randrange(llm.cfg.vocab_size) for _ in range(n)]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        assert got.shape == (n, llm.cfg.vocab_size)
        check_logits(got, ref)


def test_vocab_edges_match_hf(ckpt, engines, hf_model):
    """Ids at the first/last real vocab entry and at each rank's shard boundary (tiny: vocab 250, tp 4)."""
    d = ckpt("tiny")
    llm = engines.get(d, 4)
    ids = [0, 249, 63, 64, 127, 128, 191, 192, 248, 1]
    with torch.no_grad():
        ref = hf_model(d)(torch.tensor([ids])).logits[0]
    check_logits(llm.logits(ids), ref)
