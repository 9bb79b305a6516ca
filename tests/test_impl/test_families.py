"""The families beyond Qwen2 (Llama, Llama 3 RoPE scaling, Llama biases, Mistral sliding window, Qwen3 q/k norm
and sliding layers): config reading, the llama3 RoPE remap bit-for-bit, load-time sharding and its errors,
logits = HF's at tp 1/2/4 (float32, max |diff| <= 1e-4) and greedy generate = HF's at tp 2.

Checkpoints come from ``tests/family_checkpoints.py`` (HF's own config classes and ``save_pretrained``, every
tensor redrawn to be distinguishable); the HF reference is the class the config names."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from family_checkpoints import FAMILY_PRESETS, family_checkpoint, family_config, load_hf_family_model
from hf_compare import check_logits, edit_config, edit_tensors, hf_greedy, hf_logits, max_diff
from fake_tp import fake_rank
from impl import SamplingParams
from impl.config import TRANSFORMERS_5, ConfigError, load_config
from impl.layers.attention import causal_mask
from impl.layers.rotary import Llama3RopeScaling, RotaryEmbedding, default_inv_freq
from impl.loader import LoadError, load_weights
from impl.models import model_class
from impl.sequence import Sequence
from impl.shard_plan import shard_plan

PRESETS = tuple(FAMILY_PRESETS)
LENGTHS = (1, 2, 17, 40, 130)  # 40 and 130 run past the sliding windows (12, 10) and llama3's 32 positions
ATOL = 1e-4


@pytest.fixture(scope="session")
def fam(tmp_path_factory):
    """``fam(preset) -> Path``: a family checkpoint, written once per (xdist) worker."""
    root = tmp_path_factory.mktemp("family_checkpoints")
    return lambda preset: family_checkpoint(preset, root)


_HF: dict = {}


def hf_ref(d):
    if str(d) not in _HF:
        _HF[str(d)] = load_hf_family_model(d)
    return _HF[str(d)]


# ------------------------------------------------------------------------------------------------ config
EXPECTED = {  # preset: (model_type, head_dim, qkv_bias, o_proj_bias, mlp_bias, qk_norm, sliding windows, tied)
    "llama": ("llama", 8, False, False, False, False, (), False),
    "llama3-rope": ("llama", 16, False, False, False, False, (), True),
    "llama-bias": ("llama", 16, True, True, True, False, (), False),
    "mistral": ("mistral", 8, False, False, False, False, (12, 12), True),
    "qwen3": ("qwen3", 16, False, False, False, True, (), True),
    "qwen3-swa": ("qwen3", 16, True, True, False, True, (None, 10, 10), False),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_config_fields(preset, fam):
    cfg = load_config(fam(preset))
    assert (cfg.model_type, cfg.head_dim, cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.qk_norm,
            cfg.sliding_windows, cfg.tie_word_embeddings) == EXPECTED[preset]
    assert cfg.rope_scaling == (Llama3RopeScaling(8.0, 1.0, 4.0, 32) if preset == "llama3-rope" else None)
    assert cfg.rope_theta == FAMILY_PRESETS[preset]["rope_theta"]
    assert type(cfg.hf).__name__ == family_config(preset).__class__.__name__
    assert model_class(cfg).__name__ == cfg.hf.architectures[0]


@pytest.mark.parametrize("model_type", ["gpt2", "deepseek_v2", "Llama", None])
def test_unsupported_model_type_refused(model_type, fam, tmp_path):
    def edit(raw):
        raw.pop("model_type") if model_type is None else raw.update(model_type=model_type)
    d = edit_config(fam("llama"), tmp_path / "x", edit)
    with pytest.raises(ConfigError) as ei:
        load_config(d)
    assert str(ei.value) == f"{d / 'config.json'}: model_type is {model_type!r}; supported: gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"


@pytest.mark.parametrize("preset", ["llama", "mistral", "qwen3"])
def test_missing_rope_theta_refused(preset, fam, tmp_path):
    def edit(raw):
        raw.pop("rope_theta", None)
        (raw.get("rope_parameters") or {}).pop("rope_theta", None)
    with pytest.raises(ConfigError, match="no rope_theta"):
        load_config(edit_config(fam(preset), tmp_path / "x", edit))


def _set_rope(raw, **params):
    """Put rope parameters in the layout the running transformers reads."""
    if TRANSFORMERS_5:
        raw["rope_parameters"] = {**raw["rope_parameters"], **params}
    else:
        raw["rope_scaling"] = params


@pytest.mark.parametrize("kind", ["yarn", "linear", "dynamic", "longrope"])
def test_unknown_rope_type_refused(kind, fam, tmp_path):
    d = edit_config(fam("llama"), tmp_path / "x", lambda raw: _set_rope(
        raw, rope_type=kind, factor=4.0, original_max_position_embeddings=64, short_factor=[1.0] * 4,
        long_factor=[1.0] * 4, beta_fast=32.0, beta_slow=1.0))
    with pytest.raises(ConfigError, match=rf"rope type '{kind}' is not supported \(supported: default, llama3\)"):
        load_config(d)


def test_llama3_rope_missing_parameter_refused(fam, tmp_path):
    def edit(raw):
        if TRANSFORMERS_5:
            raw["rope_parameters"].pop("low_freq_factor")
        else:
            raw["rope_scaling"].pop("low_freq_factor")
    with pytest.raises(ConfigError, match="low_freq_factor"):
        load_config(edit_config(fam("llama3-rope"), tmp_path / "x", edit))


@pytest.mark.parametrize("window,expect", [(None, ()), (512, ()), (4096, ()), (511, (511, 511)), (1, (1, 1))])
def test_mistral_sliding_window(window, expect, fam, tmp_path):
    """None or >= max_position_embeddings (512) can never hide a key: accepted as full attention."""
    cfg = load_config(edit_config(fam("mistral"), tmp_path / "x", lambda raw: raw.update(sliding_window=window)))
    assert cfg.sliding_windows == expect
    assert [cfg.sliding_window(i) for i in range(2)] == list(expect or (None, None))


def test_qwen3_sliding_layers_follow_hf(fam, tmp_path):
    cfg = load_config(edit_config(fam("qwen3-swa"), tmp_path / "off", lambda raw: raw.update(
        use_sliding_window=False, layer_types=None)))
    assert cfg.sliding_windows == ()
    cfg = load_config(edit_config(fam("qwen3-swa"), tmp_path / "mixed", lambda raw: raw.update(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])))
    assert cfg.sliding_windows == (10, None, 10)
    with pytest.raises(ConfigError, match="layer_types"):
        load_config(edit_config(fam("qwen3-swa"), tmp_path / "bad", lambda raw: raw.update(
            layer_types=["chunked_attention", "full_attention", "full_attention"])))


def test_other_activation_refused(fam, tmp_path):
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        load_config(edit_config(fam("llama"), tmp_path / "x", lambda raw: raw.update(hidden_act="gelu")))


def test_bad_tp_refused_for_families(fam):
    cfg = load_config(fam("qwen3"))  # 4 heads, 1 KV head
    cfg.check_tp(4)
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tp_size=8"):
        cfg.check_tp(8)


# ------------------------------------------------------------------------------------------------ layers
LLAMA3_CASES = [  # (theta, head_dim, factor, low, high, original max positions)
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (500000.0, 16, 8.0, 1.0, 4.0, 32),     # the llama3-rope preset
    (10000.0, 8, 4.0, 2.0, 8.0, 64),
]


@pytest.mark.parametrize("theta,d,factor,low,high,orig", LLAMA3_CASES)
def test_llama3_inv_freq_is_hf_bit_for_bit(theta, d, factor, low, high, orig):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                  original_max_position_embeddings=orig)
    if TRANSFORMERS_5:
        hf_cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, max_position_embeddings=4 * orig,
                             rope_parameters={**params, "rope_theta": theta})
    else:
        hf_cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, max_position_embeddings=4 * orig,
                             rope_theta=theta, rope_scaling=params)
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, None)
    got = RotaryEmbedding(d, theta, Llama3RopeScaling(factor, low, high, orig)).inv_freq
    assert attention_factor == 1.0
    assert got.dtype == ref.dtype == torch.float32
    assert torch.equal(got, ref)
    changed = (got != default_inv_freq(d, theta)).sum().item()
    assert changed >= d // 4, f"the remap changed only {changed} of {d // 2} frequencies: a weak case"


@pytest.mark.parametrize("window", [None, 1, 3, 10])
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 12), (5, 5), (4, 13), (12, 12)])
def test_causal_mask_with_window(lq, lk, window):
    mask = causal_mask(lq, lk, window=window)
    for i in range(lq):
        p = i + lk - lq
        for j in range(lk):
            assert bool(mask[i, j]) == (j <= p and (window is None or j > p - window)), (i, j)


# ------------------------------------------------------------------------------------------------ loader
def build(d, rank=0, tp=1, load=True):
    cfg = load_config(d)
    with fake_rank(rank, tp):
        model = model_class(cfg)(cfg, torch.float32)
        if load:
            load_weights(model, d, torch.float32)
    return model


@pytest.mark.parametrize("preset", ["qwen3-swa", "llama-bias"])
def test_replicated_parameters_whole_on_every_rank(preset, fam):
    """q_norm / k_norm (one head_dim weight for all heads) and the row-parallel o_proj / down_proj biases are
    held whole by every rank; the column-parallel biases are split like their weights."""
    d = fam(preset)
    hf = load_file(str(d / "model.safetensors"))
    tp = 4
    for r in range(tp):
        layer = build(d, rank=r, tp=tp).model.layers[1]
        attn = layer.self_attn
        if preset == "qwen3-swa":
            for n in ("q_norm", "k_norm"):
                assert torch.equal(getattr(attn, n).weight, hf[f"model.layers.1.self_attn.{n}.weight"]), (n, r)
        assert torch.equal(attn.o_proj.bias, hf["model.layers.1.self_attn.o_proj.bias"])
        q = hf["model.layers.1.self_attn.q_proj.bias"]
        assert torch.equal(attn.qkv_proj.bias[:attn.q_size], q.chunk(tp)[r])
        if preset == "llama-bias":
            assert torch.equal(layer.mlp.down_proj.bias, hf["model.layers.1.mlp.down_proj.bias"])
            gate = hf["model.layers.1.mlp.gate_proj.bias"]
            assert torch.equal(layer.mlp.gate_up_proj.bias[:gate.shape[0] // tp], gate.chunk(tp)[r])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", ["llama-bias", "qwen3-swa", "llama3-rope"])
def test_shard_plan_counts_what_each_rank_holds(preset, tp, fam):
    """``ShardPlan.tensor_elements`` (the memory estimate) = the elements each rank's parameters hold: row-
    parallel biases and q/k norms whole, everything else split."""
    d = fam(preset)
    cfg = load_config(d)
    plan = shard_plan(cfg, tp)
    tensors = load_file(str(d / "model.safetensors"))
    want = sum(plan.tensor_elements(n, list(t.shape), cfg.tie_word_embeddings) for n, t in tensors.items())
    for r in range(tp):
        model = build(d, rank=r, tp=tp, load=False)
        assert sum(p.numel() for p in model.parameters()) == want, r


@pytest.mark.parametrize("preset,flag,tensor", [
    ("llama", "attention_bias", "model.layers.0.self_attn.o_proj.bias"),
    ("llama", "mlp_bias", "model.layers.0.mlp.down_proj.bias"),
    ("qwen3", "attention_bias", "model.layers.0.self_attn.k_proj.bias"),
])
def test_bias_the_config_asks_for_but_checkpoint_lacks(preset, flag, tensor, fam, tmp_path):
    d = edit_config(fam(preset), tmp_path / "x", lambda raw: raw.update({flag: True}))
    with pytest.raises(LoadError, match="checkpoint lacks") as ei:
        build(d)
    assert repr(tensor) in str(ei.value)


@pytest.mark.parametrize("preset,flag,tensor", [
    ("llama-bias", "attention_bias", "model.layers.0.self_attn.o_proj.bias"),
    ("llama-bias", "mlp_bias", "model.layers.0.mlp.down_proj.bias"),
    ("qwen3-swa", "attention_bias", "model.layers.0.self_attn.q_proj.bias"),
])
def test_bias_in_checkpoint_the_config_turns_off(preset, flag, tensor, fam, tmp_path):
    d = edit_config(fam(preset), tmp_path / "x", lambda raw: raw.update({flag: False}))
    edit_tensors(d, lambda t: {tensor: t[tensor]})  # just the one tensor: its error
    with pytest.raises(LoadError, match=f"unexpected tensor {tensor!r}.*no parameter for it.*{flag}"):
        build(d)


def test_qwen3_checkpoint_without_q_norm_refused(fam, tmp_path):
    d = tmp_path / "x"
    shutil.copytree(fam("qwen3"), d)
    edit_tensors(d, lambda t: {n: x for n, x in t.items() if n != "model.layers.1.self_attn.q_norm.weight"})
    with pytest.raises(LoadError, match=r"lacks 1 tensor\(s\): \['model\.layers\.1\.self_attn\.q_norm\.weight'\]"):
        build(d)


def test_llama_checkpoint_with_q_norm_refused(fam, tmp_path):
    """A tensor no parameter takes stays an error (here, a Qwen3 q_norm in a Llama checkpoint)."""
    d = tmp_path / "x"
    shutil.copytree(fam("llama"), d)
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}))
    with pytest.raises(LoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'.*"
                                        r"LlamaForCausalLM model has no parameter"):
        build(d)


# ------------------------------------------------------------------------------------ the options matter
def test_each_family_option_changes_hf_output(fam, tmp_path):
    """The options the engine tests below exercise change HF's own logits at the test lengths, so an engine
    that ignored one (no window, no llama3 remap, no q/k norm, no bias) could not pass them."""
    rng = random.Random(1)
    ids = [rng.randrange(200) for _ in range(40)]

    def gap(preset, edit, tensors_edit=None):
        d = edit_config(fam(preset), tmp_path / f"{preset}-{len(list(tmp_path.iterdir()))}", edit)
        if tensors_edit is not None:
            edit_tensors(d, tensors_edit)
        g = max_diff(hf_logits(load_hf_family_model(d), ids), hf_logits(hf_ref(fam(preset)), ids))
        return g

    def no_rope_scaling(raw):
        if TRANSFORMERS_5:
            raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"]}
        raw.pop("rope_scaling", None)

    def unit_qk_norms(t):
        for k in t:
            if k.endswith(("q_norm.weight", "k_norm.weight")):
                t[k] = torch.ones_like(t[k])

    assert gap("mistral", lambda raw: raw.update(sliding_window=None)) > 1e-2
    assert gap("qwen3-swa", lambda raw: raw.update(use_sliding_window=False, layer_types=None)) > 1e-2
    assert gap("llama3-rope", no_rope_scaling) > 1e-2
    assert gap("qwen3", lambda raw: None, unit_qk_norms) > 1e-2
    assert gap("llama-bias", lambda raw: None, lambda t: t.update(
        {k: torch.zeros_like(v) for k, v in t.items() if k.endswith("o_proj.bias")})) > 1e-2


# ------------------------------------------------------------------------------------------- vs HF, TP
CASES = [(p, tp) for p in PRESETS for tp in (1, 2, 4)]


@pytest.mark.parametrize("preset,tp", CASES, ids=[f"{p}-tp{t}" for p, t in CASES])
def test_logits_match_hf(preset, tp, fam, engines):
    d = fam(preset)
    llm = engines.get(d, tp)
    cfg = llm.cfg
    if tp == 4:
        assert tp > cfg.num_kv_heads  # every preset replicates its KV heads at tp 4
    hf = hf_ref(d)
    rng = random.Random(f"{preset}-{tp}")
    worst = 0.0
    for n in LENGTHS:
        ids = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        worst = max(worst, check_logits(llm, hf, ids, ATOL, f"{preset} tp {tp}"))
    print(f"\nmax |diff| {preset} tp{tp}: {worst:.3g}")


NEW = 24


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generate_matches_hf_tp2(preset, fam, engines):
    """Paged decode (blocks of 4), prefix caching (two prompts share 24 tokens: the second prefill reads
    them from the cache) and continuous batching, through decode steps past the sliding windows."""
    d = fam(preset)
    llm = engines.get(d, 2, block_size=4)
    rng = random.Random(preset)
    v = llm.cfg.vocab_size
    shared = [rng.randrange(v) for _ in range(24)]
    prompts = [[rng.randrange(v) for _ in range(n)] for n in (1, 7, 40)]
    prompts += [shared + [rng.randrange(v) for _ in range(5)], shared + [rng.randrange(v) for _ in range(9)]]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    got = llm.generate(prompts[:4], sp)
    # the last prompt's prefill starts at position 24, its keys before that read from the paged cache
    assert llm.scheduler.block_manager.cached_prefix_len(Sequence(prompts[4], sp, 4)) == 24
    got += llm.generate(prompts[4:], sp)
    hf = hf_ref(d)
    for i, (g, p) in enumerate(zip(got, prompts)):
        ref, gaps = hf_greedy(hf, p, NEW)
        for k, (a, b) in enumerate(zip(g, ref)):
            if gaps[k] < ATOL:  # a near-tie: the two may legitimately part from here
                break
            assert a == b, f"{preset} prompt {i} token {k}: impl {a} != HF {b}\nimpl {g}\nHF   {ref}"
        assert len(g) == NEW
