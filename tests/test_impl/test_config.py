"""impl.config.load_config / ModelConfig.check_tp on config.json files written per test."""
from __future__ import annotations

import json
import time

import pytest
import torch

import impl.llm
from impl.config import TRANSFORMERS_5, ConfigError, hf_rope_theta, load_config, parse_dtype
from tpcheck.inputs.models.checkpoints import preset_config


def write_config(d, preset="tiny", edit=None):
    """``preset``'s config.json (in the running transformers' layout) in directory ``d``, then ``edit(raw_dict)``."""
    preset_config(preset).save_pretrained(d)
    if edit is not None:
        path = d / "config.json"
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
    return d


def layout(theta=None, v5: bool = TRANSFORMERS_5, **extra):
    """An edit that puts ``theta`` (None: no theta at all) in the transformers 5 layout (``rope_parameters``)
    or the 4.x one (top level), whichever layout the preset was written in."""
    def edit(raw):
        raw.pop("rope_theta", None)
        raw.pop("rope_parameters", None)
        if theta is not None:
            if v5:
                raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
            else:
                raw["rope_theta"] = theta
        raw.update(extra)
    return edit


def test_fields_from_preset(tmp_path):
    cfg = load_config(write_config(tmp_path, "tiny-untied"))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 2, 8)
    assert (cfg.intermediate_size, cfg.num_layers, cfg.vocab_size) == (96, 3, 301)
    assert cfg.tie_word_embeddings is False
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position == 1024
    assert cfg.eos_token_ids == (2,)
    assert load_config(write_config(tmp_path / "t", "tiny")).tie_word_embeddings is True


@pytest.mark.parametrize("preset,theta", [("tiny", 10000.0), ("tiny-untied", 1e6), ("tiny-mqa", 500000.0)])
def test_rope_theta_of_each_preset(preset, theta, tmp_path):
    d = write_config(tmp_path, preset)
    raw = json.loads((d / "config.json").read_text())
    if TRANSFORMERS_5:
        assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == theta
    else:
        assert raw["rope_theta"] == theta
    cfg = load_config(d)
    assert cfg.rope_theta == theta == hf_rope_theta(cfg.hf) and isinstance(cfg.rope_theta, float)


def test_rope_theta_top_level_4x_layout(tmp_path):
    cfg = load_config(write_config(tmp_path, "tiny", layout(12345.0, v5=False)))
    assert cfg.rope_theta == 12345.0  # not the preset's 10000, not a default
    assert hf_rope_theta(cfg.hf) == 12345.0  # impl and HF agree


def test_rope_theta_only_in_rope_parameters(tmp_path):
    """transformers 5 reads it; 4.x would not (it would use 10000): an error there, naming the layout."""
    d = write_config(tmp_path, "tiny", layout(23456.0, v5=True))
    if TRANSFORMERS_5:
        cfg = load_config(d)
        assert cfg.rope_theta == 23456.0 == hf_rope_theta(cfg.hf)
    else:
        with pytest.raises(ConfigError, match="rope_parameters.*transformers 5 layout"):
            load_config(d)


def test_missing_rope_theta_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="rope_theta"):
        load_config(write_config(tmp_path, "tiny", layout(None)))
    if TRANSFORMERS_5:  # a rope_parameters without its theta
        d2 = tmp_path / "no-theta"
        with pytest.raises(ConfigError, match="rope_theta"):
            load_config(write_config(d2, "tiny", lambda raw: raw["rope_parameters"].pop("rope_theta")))


@pytest.mark.parametrize("edit,word", [
    (layout(10000.0, rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (layout(1e6, v5=False, rope_scaling={"type": "yarn", "factor": 4.0}), "yarn"),  # the 4.x layout with YaRN
    (lambda raw: raw.update(use_sliding_window=True), "sliding"),
])
def test_unsupported_features_refused(edit, word, tmp_path):
    with pytest.raises(ConfigError, match=word):
        load_config(write_config(tmp_path, "tiny", edit))


@pytest.mark.skipif(not TRANSFORMERS_5, reason="rope_parameters is transformers 5's layout")
def test_linear_rope_parameters_refused(tmp_path):
    with pytest.raises(ConfigError, match="linear"):
        load_config(write_config(tmp_path, "tiny", lambda raw: raw["rope_parameters"].update(rope_type="linear",
                                                                                              factor=2.0)))


def test_rope_scaling_added_to_config_refused(tmp_path):
    """Qwen's long-context recipe adds ``rope_scaling`` to config.json; HF's Qwen2Config then uses yarn, even
    beside a transformers 5 ``rope_parameters`` (default)."""
    d = write_config(tmp_path, "tiny", lambda raw: raw.update(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}))
    from transformers import Qwen2Config
    hf = Qwen2Config.from_pretrained(d)
    kind = hf.rope_parameters["rope_type"] if TRANSFORMERS_5 else hf.rope_scaling.get("rope_type", hf.rope_scaling.get("type"))
    assert kind == "yarn"
    with pytest.raises(ConfigError, match="yarn"):
        load_config(d)


def test_rope_theta_both_layouts_agrees_with_hf(tmp_path):
    def edit(raw):  # both layouts in one file, with different thetas
        layout(10000.0, v5=True)(raw)
        raw["rope_theta"] = 55555.0
    cfg = load_config(write_config(tmp_path, "tiny", edit))
    assert cfg.rope_theta == hf_rope_theta(cfg.hf) == (10000.0 if TRANSFORMERS_5 else 55555.0)


@pytest.mark.parametrize("model_type", ["gpt2", "deepseek_v2", None])
def test_unsupported_model_type_refused(model_type, tmp_path):
    """Anything outside impl.config.FAMILIES (gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe) is
    refused, listing those."""
    def edit(raw):
        if model_type is None:
            del raw["model_type"]
        else:
            raw["model_type"] = model_type

    with pytest.raises(ConfigError, match="supported: gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe") as ei:
        load_config(write_config(tmp_path, "tiny", edit))
    assert f"model_type is {model_type!r}" in str(ei.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path / "does-not-exist")


def test_eos_token_list(tmp_path):
    cfg = load_config(write_config(tmp_path, "tiny", lambda raw: raw.update(eos_token_id=[2, 5])))
    assert cfg.eos_token_ids == (2, 5)


# -------------------------------------------------------------------------------------------- check_tp
def test_check_tp_qwen25_05b_shape(tmp_path):
    cfg = load_config(write_config(tmp_path, "qwen2.5-0.5b"))
    assert (cfg.num_heads, cfg.num_kv_heads) == (14, 2)
    cfg.check_tp(1)
    cfg.check_tp(2)
    for tp in (4, 8):
        with pytest.raises(ConfigError) as ei:
            cfg.check_tp(tp)
        assert "14" in str(ei.value) and str(tp) in str(ei.value)


def test_check_tp_kv_replication_ok(tmp_path):
    cfg = load_config(write_config(tmp_path, "tiny"))  # 8 heads / 2 kv
    for tp in (1, 2, 4, 8):  # 4 and 8: each KV head replicated on 2 / 4 ranks
        cfg.check_tp(tp)
    with pytest.raises(ConfigError, match="8"):
        cfg.check_tp(3)
    with pytest.raises(ConfigError):
        cfg.check_tp(0)
    mqa = load_config(write_config(tmp_path / "mqa", "tiny-mqa"))  # 4 heads / 1 kv
    for tp in (1, 2, 4):
        mqa.check_tp(tp)


def test_check_tp_12_heads_3_kv(tmp_path):
    def edit(raw):
        raw.update(num_attention_heads=12, num_key_value_heads=3, hidden_size=96)

    cfg = load_config(write_config(tmp_path, "tiny", edit))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (12, 3, 8)
    for tp in (1, 3, 6, 12):  # 6, 12: replication (tp % kv == 0)
        cfg.check_tp(tp)
    with pytest.raises(ConfigError) as ei:  # 3 KV heads cannot be split over 2 ranks
        cfg.check_tp(2)
    assert "num_key_value_heads=3" in str(ei.value) and "2" in str(ei.value)
    with pytest.raises(ConfigError) as ei:  # 4 > 3 and 4 % 3 != 0: no whole replication
        cfg.check_tp(4)
    assert "3" in str(ei.value) and "4" in str(ei.value)


def test_parse_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ConfigError, match="float8"):
        parse_dtype("float8")


def test_llm_refuses_bad_tp_before_starting_workers(tmp_path, monkeypatch):
    d = write_config(tmp_path, "qwen2.5-0.5b")  # config only: nothing to load, no worker may start
    started = []

    class NoExecutor:
        def __init__(self, *a, **kw):
            started.append(a)
            raise AssertionError("a worker executor was started for a config that check_tp refuses")

    monkeypatch.setattr(impl.llm, "Executor", NoExecutor)
    monkeypatch.setattr(impl.llm, "LocalExecutor", NoExecutor)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="14"):
        impl.LLM(d, tp_size=4)
    assert time.monotonic() - t0 < 2.0
    assert not started


def test_llm_refuses_bad_config_real_executor(tmp_path):
    """Unpatched: the error comes back quickly, so no process group was formed."""
    d = write_config(tmp_path, "tiny", lambda raw: raw.update(model_type="gpt2"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="gpt2"):
        impl.LLM(d, tp_size=2)
    assert time.monotonic() - t0 < 2.0


def test_intermediate_size_not_divisible_refused(tmp_path):
    d = write_config(tmp_path, "tiny", lambda raw: raw.update(intermediate_size=90))
    load_config(d).check_tp(2)
    with pytest.raises(ConfigError, match="intermediate_size=90 is not divisible by tp_size=4"):
        load_config(d).check_tp(4)
