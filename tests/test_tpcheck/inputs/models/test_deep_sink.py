"""The ``deep-sink`` preset (``tpcheck.inputs.models.sink_recipe``): trained-model magnitudes at depth. It loads in HF
and impl, impl's float32 logits are HF's at tp 1/2/4, the magnitudes hold on random prompts (a sink of ~2e4
at token 0 in the middle layers that decays by the last, ~1e3 in a second channel, median |x| of 1-10, small
elsewhere), it runs finite in float16 and bfloat16, and the property strategies draw it."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import find, settings
from hypothesis.errors import NoSuchExample

from impl.config import load_config
from tpcheck.inputs.models import checkpoints as ck
from tpcheck.properties import strategies as tst
from tpcheck.inputs.models.sink_recipe import check_sink_config, sink_channels
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache

PRESET = "deep-sink"


def _prompt(vocab: int, n: int, seed) -> list[int]:
    """Random ids whose first two differ (equal ones make position 1 position 0's twin: see the recipe)."""
    rng = random.Random(f"deep-sink-{seed}")
    p = [rng.randrange(vocab) for _ in range(n)]
    if n > 1 and p[1] == p[0]:
        p[1] = (p[0] + 1) % vocab
    return p


def _out(model, prompt: list[int], decode: int = 0) -> list[dict]:
    """Every step's points of ``prompt`` and ``decode`` greedy steps."""
    cap, cache = HFCapture(model), new_cache(model)
    steps = [cap.step([prompt], [cache], [0])]
    for i in range(decode):
        nxt = int(steps[-1]["logits"][-1].argmax())
        steps.append(cap.step([[nxt]], [cache], [len(prompt) + i]))
    return steps


def test_deep_sink_loads_in_hf_and_impl(ckpt):
    from transformers import AutoModelForCausalLM
    d = ckpt(PRESET)
    cfg = load_config(d)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == ("llama", 24, 128, 32)
    for tp in (1, 2, 4):
        cfg.check_tp(tp)
    assert cfg.num_kv_heads == 2 and cfg.qkv_bias and cfg.o_proj_bias and cfg.mlp_bias  # KV replicated at tp 4
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM" and not any(info.values()), info
    assert "deep-sink" in ck.describe_preset(PRESET) and "layers 24" in ck.describe_preset(PRESET)


def test_recipe_refuses_a_config_without_its_biases(tmp_path):
    with pytest.raises(ValueError, match="q/k/v and o_proj biases, MLP biases"):
        check_sink_config(ck.preset_config("llama-hd32"))
    with pytest.raises(ValueError, match="attention-sink recipe"):
        ck.make_config_checkpoint(ck.PRESETS["small-hd32"], tmp_path / "m", sink=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_impl_float32_logits_match_hf(tp, ckpt, engines, hf_model):
    d = ckpt(PRESET)
    llm, hf = engines.get(d, tp), hf_model(d)
    for n in (1, 17, 64):
        ids = _prompt(llm.cfg.vocab_size, n, f"logits-{tp}-{n}")
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        assert got.shape == ref.shape and torch.isfinite(got).all()
        diff = (got.double() - ref.double()).abs().max().item()
        assert diff <= 1e-4, f"tp {tp} length {n}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("n", [3, 64])
def test_magnitudes_hold_on_random_prompts(n, ckpt):
    """A sink of order 1e4 at token 0 in the middle layers, lower at the last; ~1e3 in the second channel;
    the sink channel small at every other token (decode steps too); median |x| of order 1-10."""
    model = load_hf_model(ckpt(PRESET), "float64")
    ch = sink_channels(model.config.hidden_size)
    s, s2, layers = ch["S"], ch["S2"], model.config.num_hidden_layers
    steps = _out(model, _prompt(model.config.vocab_size, n, n), decode=2)
    x = [steps[0][f"layers.{i}.out"] for i in range(layers)]
    mid, last = float(x[layers // 2][0, s]), float(x[-1][0, s])
    assert mid > 5e3 and 0 < last < mid / 2, (mid, last)
    assert max(abs(float(t[0, s])) for t in x[layers // 4 + 1:-3]) < 3e4
    assert 1e3 < abs(float(x[layers // 2][0, s2])) < 3e3
    for i in range(layers):
        rest = torch.cat([x[i][1:, s]] + [st[f"layers.{i}.out"][:, s] for st in steps[1:]])
        assert rest.abs().max() < 1e2, (i, float(rest.abs().max()))
        assert 0.5 <= float(x[i].abs().median()) <= 20, (i, float(x[i].abs().median()))


def test_the_sink_comes_from_position_zero(ckpt, hf_model):
    """Any token at position 0 carries the sink; a repeated first token makes position 1 position 0's twin
    (a RoPE model cannot tell them apart), a different one does not."""
    model = hf_model(ckpt(PRESET))
    s = sink_channels(model.config.hidden_size)["S"]
    for first in (0, 7, 200, 383):
        x = _out(model, [first, (first + 5) % 384, 11])[0]["layers.12.out"]
        assert x[0, s] > 5e3 and x[1:, s].abs().max() < 1e2
    twin = _out(model, [42, 42, 9])[0]["layers.12.out"]
    assert twin[1, s] > 5e3 and abs(twin[2, s]) < 1e2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_finite_in_low_precision(dtype, ckpt):
    model = load_hf_model(ckpt(PRESET), dtype)
    s = sink_channels(model.config.hidden_size)["S"]
    steps = _out(model, _prompt(model.config.vocab_size, 40, dtype), decode=2)
    for st in steps:
        bad = [n for n, t in st.items() if not torch.isfinite(t).all()]
        assert not bad, bad
    assert float(steps[0]["layers.12.out"][0, s]) > 5e3


def test_strategies_draw_the_preset():
    """``cases(presets=DEPTH_PRESETS)`` draws deep-sink (its own config and recipe, every TP size of the space,
    KV replicated at tp 4, at most 2 prompts of at most 64 tokens); a space without presets never does."""
    prop = settings(max_examples=400, database=None)
    case = find(tst.cases(presets=tst.DEPTH_PRESETS, tps=(4,)), lambda c: c.preset == PRESET, settings=prop)
    assert case.config == ck.PRESETS[PRESET] and case.tp == 4 and case.layout == "replication"
    assert (case.weight_seed, case.outliers) == (0, 0.0) and case.describe().startswith("preset deep-sink: tp=4")
    assert len(case.prompts) <= 2 and max(map(len, case.prompts)) <= 64
    assert "--preset deep-sink --tp 4" in case.repro()
    find(tst.cases(presets=tst.DEPTH_PRESETS), lambda c: c.preset is None, settings=prop)
    with pytest.raises(NoSuchExample):  # preset_share 1: every example is the preset
        find(tst.cases(presets=tst.DEPTH_PRESETS, preset_share=1), lambda c: c.preset is None,
             settings=settings(max_examples=30, database=None))
    with pytest.raises(NoSuchExample):
        find(tst.cases(), lambda c: c.preset is not None, settings=settings(max_examples=50, database=None))
