"""Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral) through impl's engine, under tensor and expert parallelism:
logits = Hugging Face's (float32, max |diff| <= 1e-4) at every (tp, ep) of 1/2/4 the layout allows, greedy
``generate`` = HF's, each rank reading only its own experts' slices, layouts refused with their numbers.

The layer's own unit tests (routing vs HF's router, partial sums over simulated ranks, the loader's expert
slices, the config reading) are in ``test_moe_layer.py``."""
from __future__ import annotations

import random

import pytest

from hf_compare import check_logits, hf_greedy
from impl import LLM, SamplingParams
from impl.config import ConfigError, load_config

PRESETS = ("tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-moe-ties")
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]  # (tp, ep): every one with ep | tp, ep <= 4
LENGTHS = (1, 3, 17, 40)  # 40 runs past tiny-mixtral's sliding window (16)
ATOL = 1e-4
CASES = [(p, tp, ep) for p in PRESETS for tp, ep in LAYOUTS]


@pytest.mark.parametrize("preset,tp,ep", CASES, ids=[f"{p}-tp{t}-ep{e}" for p, t, e in CASES])
def test_logits_match_hf(preset, tp, ep, ckpt, engines, hf_model):
    d = ckpt(preset)
    llm = engines.get(d, tp, ep=ep)
    assert (llm.tp_size, llm.ep_size) == (tp, ep)
    hf = hf_model(d)
    rng = random.Random(f"{preset}-{tp}-{ep}")
    worst = 0.0
    for n in LENGTHS:
        ids = [rng.randrange(llm.cfg.vocab_size) for _ in range(n)]
        worst = max(worst, check_logits(llm, hf, ids, ATOL, f"{preset} tp {tp} ep {ep}"))
    print(f"\nmax |diff| {preset} tp{tp} ep{ep}: {worst:.3g}")


NEW = 16


@pytest.mark.parametrize("preset,tp,ep", [("tiny-qwen2-moe", 4, 2), ("tiny-qwen3-moe", 2, 2), ("tiny-mixtral", 4, 4),
                                          ("tiny-moe-ties", 2, 1)])
def test_greedy_generate_matches_hf(preset, tp, ep, ckpt, engines, hf_model):
    """Paged decode (blocks of 4) with continuous batching: every decode step routes one token per sequence."""
    d = ckpt(preset)
    llm = engines.get(d, tp, block_size=4, ep=ep)
    rng = random.Random(preset)
    prompts = [[rng.randrange(llm.cfg.vocab_size) for _ in range(n)] for n in (1, 7, 30)]
    got = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
    hf = hf_model(d)
    for i, (g, p) in enumerate(zip(got, prompts)):
        ref, gaps = hf_greedy(hf, p, NEW)
        for k, (a, b) in enumerate(zip(g, ref)):
            if gaps[k] < ATOL:  # a near-tie of the logits: the two may legitimately part from here
                break
            assert a == b, f"{preset} prompt {i} token {k}: impl {a} != HF {b}\nimpl {g}\nHF   {ref}"
        assert len(g) == NEW


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2), (4, 4)])
def test_each_rank_reads_only_its_experts(tp, ep, ckpt, engines):
    """Through the engine's ranks: rank r reads the experts of its group ``r // (tp/ep)`` and nothing of the
    others, and of each of its experts only its ``1 / (tp/ep)`` share; the router whole."""
    d = ckpt("tiny-qwen2-moe")
    llm = engines.get(d, tp, ep=ep)
    moe = llm.cfg.moe
    per_group, moe_tp = moe.num_experts // ep, tp // ep
    full = moe.intermediate_size * llm.cfg.hidden_size
    for rank, read in enumerate(llm.call("worker_fns:loaded_tensors")):
        for layer, sparse in enumerate(moe.sparse_layers):
            m = f"model.layers.{layer}.mlp."
            if not sparse:
                assert not any(k.startswith(m + "experts.") for k in read)
                continue
            assert read[m + "gate.weight"] == moe.num_experts * llm.cfg.hidden_size
            held = sorted({int(k.split(".")[5]) for k in read if k.startswith(m + "experts.")})
            group = rank // moe_tp
            assert held == list(range(group * per_group, (group + 1) * per_group)), (rank, layer, held)
            for e in held:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    assert read[f"{m}experts.{e}.{name}.weight"] == full // moe_tp
            assert read[m + "shared_expert.gate_proj.weight"] == 48 * llm.cfg.hidden_size // tp


def test_invalid_layouts_refused_before_workers_start(ckpt):
    d = ckpt("tiny-qwen2-moe")
    with pytest.raises(ConfigError, match=r"^tp_size=2 is not divisible by ep_size=4 "):
        LLM(d, tp_size=2, ep_size=4)
    with pytest.raises(ConfigError, match=r"^ep_size must be >= 1, got 0$"):
        LLM(d, tp_size=2, ep_size=0)
    with pytest.raises(ConfigError, match=r"^ep_size=2 needs a mixture-of-experts model; model_type 'qwen2' "):
        LLM(ckpt("tiny"), tp_size=2, ep_size=2)
    cfg = load_config(d)
    with pytest.raises(ConfigError, match=r"^num_attention_heads=4 is not divisible by tp_size=8$"):
        cfg.check_tp(8, 8)


def test_cli_ep(ckpt, engines, capsys):
    """``python -m impl logits --tp 2 --ep 2`` runs the experts in two groups (the top-5 of the pooled engine at tp 1);
    ``--ep 4`` at tp 2 is refused, exit 2, naming the numbers."""
    import json

    from impl.__main__ import main
    d = str(ckpt("tiny-qwen3-moe"))
    assert main(["logits", "--model", d, "--tp", "2", "--ep", "2", "--prompt-ids", "1,2,3"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["last_logits_top5"] == engines.get(d, 1).logits([1, 2, 3])[-1].topk(5).indices.tolist()
    assert main(["logits", "--model", d, "--tp", "2", "--ep", "4", "--prompt-ids", "1,2,3"]) == 2
    assert "impl: error: tp_size=2 is not divisible by ep_size=4" in capsys.readouterr().err
