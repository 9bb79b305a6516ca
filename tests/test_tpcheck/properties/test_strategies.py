"""tpcheck.properties.strategies draws only valid cases and covers the layouts it promises; the drawn configs' checkpoints
(tpcheck.inputs.models.config_checkpoints) and a case's reproduction command (tpcheck.properties.case) are deterministic;
tpcheck.properties.profiles selects profiles from the environment."""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from tpcheck.inputs import tp_layout
from tpcheck.inputs.models import config_checkpoints
from tpcheck.properties import case as property_runner
from tpcheck.properties import profiles as hp
from tpcheck.properties import strategies as tst
from tpcheck.inputs.models.config_checkpoints import checkpoint_key, config_checkpoint, recreate_command
from tpcheck.properties.case import Case
from tpcheck.inputs.tp_layout import kv_layout, tp_compatible

FAST = settings(max_examples=200, deadline=None, database=None)


def _head_dim(c: dict) -> int:
    return c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])


def _assert_valid(c: dict, tp: int) -> None:
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    assert h % tp == 0 and h % kv == 0 and c["intermediate_size"] % tp == 0
    assert (kv % tp == 0) if tp <= kv else (tp % kv == 0)
    assert tp_compatible(c, tp)
    assert _head_dim(c) % 2 == 0 and c["hidden_size"] <= 128 and 1 <= c["num_hidden_layers"] <= 3
    assert 32 <= c["vocab_size"] <= 600 and c["vocab_size"] > max(c["bos_token_id"], c["eos_token_id"])
    if "head_dim" not in c:
        assert c["hidden_size"] % h == 0


@FAST
@given(tst.config_and_tp())
def test_config_and_tp_is_valid(pair):
    config, tp = pair
    assert tp in (1, 2, 4)
    _assert_valid(config, tp)


@FAST
@given(tst.configs(tps=(1, 2, 4)))
def test_configs_split_at_every_tp(config):
    for tp in (1, 2, 4):
        _assert_valid(config, tp)


@pytest.mark.parametrize("what,cond", [
    ("partition at tp 4", lambda p: p[1] == 4 and p[0]["num_key_value_heads"] >= 4),
    ("replication, 2 KV heads at tp 4", lambda p: p[1] == 4 and p[0]["num_key_value_heads"] == 2),
    ("MQA replication at tp 2", lambda p: p[1] == 2 and p[0]["num_key_value_heads"] == 1),
    ("MHA", lambda p: p[0]["num_key_value_heads"] == p[0]["num_attention_heads"] > 1),
    ("vocab padded, uneven over tp", lambda p: p[1] > 1 and p[0]["vocab_size"] % 64 != 0),
    ("vocab an exact multiple of 64", lambda p: p[0]["vocab_size"] % 64 == 0),
    ("explicit head_dim", lambda p: "head_dim" in p[0]),
    ("tied, 3 layers", lambda p: p[0]["tie_word_embeddings"] and p[0]["num_hidden_layers"] == 3),
])
def test_layouts_are_reachable(what, cond):
    find(tst.config_and_tp(), cond, settings=settings(max_examples=500, database=None))


def test_layouts_are_drawn_often():
    seen = []

    @settings(max_examples=150, database=None, derandomize=True)
    @given(tst.config_and_tp())
    def draw(pair):
        seen.append((pair[1], kv_layout(pair[0]["num_key_value_heads"], pair[1])))

    draw()
    assert {tp for tp, _ in seen} == {1, 2, 4}
    replication = sum(lay == "replication" for _, lay in seen)
    assert 0.15 * len(seen) <= replication <= 0.6 * len(seen), (replication, len(seen))


def test_restricted_layouts():
    @FAST
    @given(tst.config_and_tp(tps=(2, 4), layouts=("replication",)))
    def only_replication(pair):
        assert pair[1] > pair[0]["num_key_value_heads"]

    only_replication()
    with pytest.raises(ValueError):
        tst.config_and_tp(tps=(1,), layouts=("replication",))


@FAST
@given(st.data(), st.integers(32, 600), tst.block_sizes())
def test_prompts_are_valid(data, vocab, bs):
    ps = data.draw(tst.prompts(vocab, bs, max_batch=8, max_len=300))
    assert 1 <= len(ps) <= 8
    assert all(1 <= len(p) <= 300 and all(0 <= t < vocab for t in p) for p in ps)


def test_prompt_lengths_hit_block_boundaries_often():
    lens = []

    @settings(max_examples=300, database=None, derandomize=True)
    @given(tst.prompt_lengths(16, 300), st.integers(0, 10**6))  # (a second draw, as in a real case: alone,
    def draw(n, _):                                             # the few boundary lengths would run out)
        lens.append(n)

    draw()
    near = sum(min(n % 16, 16 - n % 16) <= 1 and n >= 15 for n in lens)
    assert near >= 0.4 * len(lens), (near, len(lens))
    assert max(lens) > 100 and min(lens) == 1


@settings(max_examples=60, deadline=None, database=None)
@given(tst.cases())
def test_cases_are_consistent(case):
    _assert_valid(case.config, case.tp)
    assert case.dtype in ("float32", "bfloat16") and 0 <= case.decode_steps <= 8
    assert all(0 <= t < case.config["vocab_size"] for p in case.prompts for t in p)
    assert case.layout == kv_layout(case.config["num_key_value_heads"], case.tp)


@settings(max_examples=60, deadline=None, database=None)
@given(tst.cases(pps=(1, 2, 4), families=("qwen2", "qwen2_moe")))
def test_cases_draw_pp_the_layers_allow(case):
    """pp drawn with tp (and ep for MoE): never more stages than layers, and the case's diff options carry it."""
    assert case.pp in (1, 2, 4) and case.pp <= case.config["num_hidden_layers"]
    assert case.options("/ckpt").pp == case.pp and (case.pp == 1) == ("pp=" not in case.describe())


def test_pp_draws_are_reachable_and_refused_with_the_numbers():
    assert find(tst.cases(pps=(1, 2), families=("qwen2_moe",)), lambda c: c.pp == 2 and c.ep == 2).pp == 2
    assert find(tst.cases(), lambda c: True).pp == 1  # the default space draws no pp
    with pytest.raises(ValueError, match=r"pps \(4,\): none fits a model of num_hidden_layers=[123]"):
        find(tst.cases(pps=(4,), max_layers=3), lambda c: True)


def test_drawn_checkpoints_load_in_hf_and_impl(tmp_path):
    """A handful of drawn configs (explicit head_dim, MQA, padded vocab, every family...) load with no missing
    keys in HF's class of their family and pass impl's own TP check; checkpoints are cached by content and
    written atomically."""
    from transformers import AutoModelForCausalLM

    from impl.config import load_config
    pairs = []

    @settings(max_examples=8, database=None, derandomize=True)
    @given(tst.config_and_tp())
    def draw(pair):
        pairs.append(pair)

    draw()
    pairs.append((dict(find(tst.configs(), lambda c: "head_dim" in c, settings=settings(database=None))), 2))
    for config, tp in pairs:
        d = config_checkpoint(config, tmp_path)
        assert config_checkpoint(dict(config), tmp_path) == d  # cached: same content, same path
        model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        cfg = load_config(d)
        cfg.check_tp(tp)
        assert cfg.head_dim == _head_dim(config)
        assert cfg.model_type == config.get("model_type", "qwen2") and type(model).__name__ == cfg.family.hf_model_class
    assert config_checkpoint(pairs[0][0], tmp_path, seed=1) != config_checkpoint(pairs[0][0], tmp_path)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_repro_recreates_the_checkpoint(tmp_path):
    """The recreate command of a failure report rebuilds the same checkpoint bit for bit."""
    # (max_examples: the profile's few examples may all be 1- or 3-layer models)
    config = find(tst.configs(), lambda c: c["num_hidden_layers"] == 2,
                  settings=settings(database=None, max_examples=200))
    case = Case(config, 2, "bfloat16", [[1, 2, 3]], 2, 4, bias_std=4.0)
    original = case.checkpoint(tmp_path / "a")
    cmd = recreate_command(config, tmp_path / "b", case.weight_seed, case.bias_std)
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith(str(tmp_path / "b"))
    for f in ("config.json", "model.safetensors"):
        assert (original / f).read_bytes() == (tmp_path / "b" / os.path.basename(out) / f).read_bytes()
    line = case.repro(tmp_path / "a")
    assert line.startswith("tpcheck diff --layer-by-layer --model \"$(") and "\n" not in line
    assert "--tp 2 --dtype bfloat16 --prompt-ids 1,2,3 --decode-steps 2 --block-size 4" in line
    assert "--exact-ops" not in line
    assert "--block-size 4 --exact-ops" in dataclasses.replace(case, exact_ops=True).repro(tmp_path / "a")


def test_checkpoint_key_is_stable(monkeypatch):
    """The cache key of a drawn config's checkpoint is its directory name: a changed key orphans every cached
    checkpoint and every printed reproduction path. It changes with the recipe version, and only then."""
    import tpcheck.inputs.models.checkpoints
    config = dict(tst._FIXED, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=16,
                  num_hidden_layers=1, vocab_size=32, tie_word_embeddings=False, rope_theta=10000.0,
                  rms_norm_eps=1e-6)
    monkeypatch.setattr(tpcheck.inputs.models.checkpoints, "RECIPE_VERSION", 1)
    assert checkpoint_key(config) == "cd16df317ea62b3d"
    assert checkpoint_key(config, outliers=0.0) == checkpoint_key(config)  # no outliers: the key of before them
    assert len({checkpoint_key(config, seed=1), checkpoint_key(config, bias_std=4.0), checkpoint_key(config),
                checkpoint_key(config, dtype="bfloat16"), checkpoint_key(config, outliers=1.0)}) == 5
    monkeypatch.setattr(tpcheck.inputs.models.checkpoints, "RECIPE_VERSION", 2)
    assert checkpoint_key(config) != "cd16df317ea62b3d"


def test_tp_rules_are_impls(tmp_path):
    """tp_compatible / kv_layout say what impl's ModelConfig.check_tp and shard_plan say, on a loaded config."""
    from impl.config import ConfigError, load_config
    from impl.shard_plan import shard_plan
    config = dict(tst._FIXED, hidden_size=96, num_attention_heads=12, num_key_value_heads=3, intermediate_size=48,
                  num_hidden_layers=1, vocab_size=40, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6)
    cfg = load_config(config_checkpoint(config, tmp_path))
    for tp in range(0, 14):
        try:
            plan = shard_plan(cfg, tp)
        except ConfigError:
            assert not tp_compatible(config, tp), tp
            continue
        assert tp_compatible(config, tp), tp
        assert kv_layout(3, tp) == ("replication" if plan.kv_replicas > 1 else "partition")
    assert [tp for tp in range(1, 14) if tp_compatible(config, tp)] == [1, 3, 6, 12]


def test_strategies_reexports():
    """``tpcheck.properties.strategies`` still names what moved out of it (sweep, user tests, printed repro lines)."""
    assert tst.Case is property_runner.Case
    assert tst.config_checkpoint is config_checkpoints.config_checkpoint
    assert tst.recreate_command is config_checkpoints.recreate_command
    assert tst.checkpoint_key is config_checkpoints.checkpoint_key
    assert tst.default_root is config_checkpoints.default_root
    assert tst.tp_compatible is tp_layout.tp_compatible and tst.kv_layout is tp_layout.kv_layout


def test_profiles(monkeypatch):
    assert set(hp.PROFILES) == {"dev", "ci", "thorough"}
    assert hp.PROFILES["ci"]["derandomize"] and hp.PROFILES["ci"]["deadline"] is None
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    monkeypatch.setenv("TPCHECK_PROFILE", "thorough")
    assert hp.selected_profile() == "thorough"
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    assert hp.selected_profile() == "ci"
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "nope")
    with pytest.raises(ValueError, match="dev, ci, thorough"):
        hp.load()
    monkeypatch.setenv("HYPOTHESIS_PROFILE", hp.PROFILE)
    assert hp.load() == hp.PROFILE  # back to the profile this run uses
    assert hp.examples(1.0) == settings.default.max_examples and hp.examples(0.0) == 1
