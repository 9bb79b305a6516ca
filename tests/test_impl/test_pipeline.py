"""Pipeline parallelism (pp stages of tp ranks each): vLLM's layer split, refused partitions, and logits and greedy
generate equal to one stage's (bit for bit) and to Hugging Face's at pp 2 x tp 1 / 2 and pp 4 x tp 1."""
from __future__ import annotations

import pytest
import torch

from impl import LLM, SamplingParams
from impl.errors import ConfigError
from impl.pipeline import layer_partition, stage_of
from hf_compare import check_logits, hf_greedy
from procs import descendants

PROMPT = [3, 17, 42, 99, 7, 1, 200, 5, 64, 63, 128, 11, 9, 150, 31, 77, 240]  # 17 tokens: past one KV block


@pytest.mark.parametrize("layers,pp,want", [
    (4, 2, (2, 2)), (4, 4, (1, 1, 1, 1)), (3, 2, (2, 1)), (4, 3, (1, 2, 1)), (5, 3, (2, 2, 1)),
    (24, 5, (5, 5, 5, 5, 4)), (7, 1, (7,)),
])
def test_vllm_split(layers, pp, want):
    """vLLM's get_pp_indices: the remainder goes one layer each to the stages before the last, second-to-last
    first."""
    assert layer_partition(layers, pp) == want
    stages = [stage_of(want, s) for s in range(pp)]
    assert [(s.start, s.end) for s in stages] == [(sum(want[:i]), sum(want[:i + 1])) for i in range(pp)]
    assert stages[0].is_first and stages[-1].is_last and stages[-1].end == layers


@pytest.mark.parametrize("layers,pp,partition,match", [
    (4, 2, "3,2", r"sums to 5 layers.*num_hidden_layers=4"),
    (4, 2, "4,0", r"\[4, 0\]: every stage needs at least one layer"),
    (4, 3, "2,2", r"names 2 stages, pp_size is 3"),
    (4, 2, "2;2", r"'2;2' is not comma-separated"),
    (2, 3, None, r"pp_size=3 exceeds num_hidden_layers=2"),
    (2, 0, None, r"pp_size must be >= 1, got 0"),
])
def test_bad_partition(layers, pp, partition, match):
    with pytest.raises(ConfigError, match=match):
        layer_partition(layers, pp, partition)


def test_bad_partition_refused_before_workers(ckpt):
    before = descendants()
    with pytest.raises(ConfigError, match=r"pp_partition \[1, 2\] sums to 3 layers.*num_hidden_layers=4"):
        LLM(ckpt("small"), pp_size="1,2")
    assert descendants() - before == set()


CASES = [("tiny", 2, 1, None), ("tiny", 2, 2, None), ("small", 4, 1, None), ("small", 2, 1, "3,1")]


@pytest.mark.parametrize("preset,pp,tp,partition", CASES, ids=[f"{c[0]}-pp{c[1]}-tp{c[2]}-{c[3]}" for c in CASES])
def test_pipeline_matches_one_stage_and_hf(preset, pp, tp, partition, ckpt, engines, hf_model):
    """Logits bit-equal to the same tp without stages (the receiving stage does the boundary layer's own add),
    close to HF's; greedy generate through the paged cache (prefill past one block, then decode) equal to HF's."""
    d = ckpt(preset)
    one = engines.get(d, tp).logits(PROMPT)
    llm = engines.get(d, tp, pp=pp, pp_partition=partition)
    got = llm.logits(PROMPT)
    assert torch.equal(got, one)
    hf = hf_model(d)
    check_logits(llm, hf, PROMPT, 1e-4, f"{preset} pp {pp} x tp {tp}")
    outs = llm.generate([PROMPT, PROMPT[:3]], SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, out in zip([PROMPT, PROMPT[:3]], outs):
        ref, gaps = hf_greedy(hf, prompt, 6)
        assert min(gaps) > 1e-4, "a near-tie: pick another prompt"  # then the tokens must agree exactly
        assert out == ref


def _loaded(runner) -> list[str]:
    return sorted(runner.loaded_tensors)


def test_stage_reads_only_its_tensors(ckpt, engines):
    """small (untied) at pp 2 x tp 2, partition 3,1: stage 0 reads the embedding and layers 0-2, stage 1 layer 3, the
    final norm and the LM head; each stage caches its own layers only."""
    llm = engines.get(ckpt("small"), 2, pp=2, pp_partition="3,1")
    per_rank = llm.call(_loaded)
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    first, last = set(per_rank[0]), set(per_rank[2])
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1", "2"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"3"}
    assert not first & last
    assert [len(s) for s in llm.kv_cache_shapes()] == [3, 3, 1, 1]


def test_tied_last_stage_reads_embedding(ckpt, engines):
    """tiny (tied) at pp 2: the last stage's LM head is read from model.embed_tokens.weight (as vLLM)."""
    per_rank = engines.get(ckpt("tiny"), 1, pp=2).call(_loaded)
    assert "model.embed_tokens.weight" in per_rank[0] and "model.embed_tokens.weight" in per_rank[1]
    assert "model.norm.weight" not in per_rank[0] and "model.norm.weight" in per_rank[1]
