"""FP8 KV cache (``impl.quant_kv``): the ``kv_cache_scheme`` parser and its refusals, the cache's rounding rule
against e4m3 computed here, per-head k / v scales landing with the KV head each rank's k / v rows hold (tp 1 / 2 / 4,
replicated heads at tp 4), a missing, unexpected or non-positive scale refused naming the tensor, and impl's logits
against the float64 golden of the same checkpoint."""
from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from fake_tp import fake_rank
from impl.config import load_config
from impl.loader import LoadError, load_weights
from impl.models.qwen2 import Qwen2ForCausalLM
from impl.quant import QuantConfigError, parse_quant_config
from impl.quant_kv import KvCacheScheme, dequantize_kv, quantize_kv
from test_loader import rewrite  # the loader tests: a checkpoint copy with its tensors edited
from tpcheck.inputs.models.quantize import quantization_config
from tpcheck.reference.hf import load_hf_model


def test_parse_kv_cache_schemes():
    assert parse_quant_config(quantization_config("fp8-kv")) == KvCacheScheme("tensor")
    assert parse_quant_config(quantization_config("fp8-kv-head")) == KvCacheScheme("attn_head")
    s = parse_quant_config(quantization_config("w8a8-fp8-kv"))  # FP8 linears and an FP8 cache
    assert (s.num_type, s.weight_strategy, s.kv_cache) == ("float", "channel", "tensor")
    assert parse_quant_config(quantization_config("w8a8-fp8")).kv_cache is None


@pytest.mark.parametrize("field,value,match", [
    ("type", "int", r"kv_cache_scheme\.type = 'int', impl supports 'float'"),
    ("num_bits", 4, r"kv_cache_scheme\.num_bits = 4"),
    ("symmetric", False, r"kv_cache_scheme\.symmetric = False"),
    ("strategy", "channel", r"kv_cache_scheme\.strategy = 'channel', impl supports 'tensor' or 'attn_head'"),
    ("dynamic", True, r"kv_cache_scheme\.dynamic = True"),
])
def test_parse_kv_cache_scheme_refuses_with_the_field(field, value, match):
    raw = copy.deepcopy(quantization_config("fp8-kv"))
    raw["kv_cache_scheme"][field] = value
    with pytest.raises(QuantConfigError, match=match):
        parse_quant_config(raw)


def test_cache_rounding_rule():
    """``e4m3(clamp(x / s))`` per head, dequantized exactly: an e4m3 number times the scale, the clamp at 448 s."""
    s = torch.tensor([0.5, 2.0**-8]).view(-1, 1)  # [kv_heads, 1] against [tokens, kv_heads, d]
    x = torch.tensor([[[1.0, 300.0, 0.3], [1.0, 5.0, -1e-5]]])
    q = quantize_kv(x, s)
    assert q.dtype == torch.float8_e4m3fn
    # 0.6 -> 0.625 (e4m3 steps by 2^-4 there); -0.00256 -> -2^-9, the smallest subnormal (the value lost 24%)
    want = torch.tensor([[[2.0, 448.0, 0.625], [256.0, 448.0, -2.0**-9]]])
    assert torch.equal(q.float(), want)
    assert torch.equal(dequantize_kv(q, s, torch.float64), want.double() * s.double())


@pytest.fixture(scope="module")
def kv_head(ckpt):
    return ckpt("small-fp8-kv-head")


def _build(model_dir, rank: int, tp: int):
    with fake_rank(rank, tp):
        model = Qwen2ForCausalLM(load_config(model_dir), torch.float32)
        load_weights(model, model_dir, torch.float32)
    return model


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_head_scales_follow_the_ranks_kv_rows(tp, kv_head):
    """Each rank's per-head k / v scale is the one of the KV head whose k rows its qkv_proj holds (found by
    matching the rows against the checkpoint, not by the sharding rule); tp 4 replicates the 2 KV heads."""
    t = load_file(str(kv_head / "model.safetensors"))
    d = load_config(kv_head).head_dim
    for rank in range(tp):
        model = _build(kv_head, rank, tp)
        for i, layer in enumerate(model.model.layers):
            sa = layer.self_attn
            k_rows = sa.qkv_proj.weight[sa.q_size:sa.q_size + sa.kv_size]
            full = t[f"model.layers.{i}.self_attn.k_proj.weight"]
            heads = [h for h in range(full.shape[0] // d) if torch.equal(full[h * d:(h + 1) * d], k_rows[:d])]
            assert len(heads) == 1 and sa.attn.k_scale.shape == (sa.num_kv_heads,)
            for w in "kv":
                want = t[f"model.layers.{i}.self_attn.{w}_scale"].reshape(-1)[heads[0]:heads[0] + sa.num_kv_heads]
                assert torch.equal(getattr(sa.attn, f"{w}_scale").data, want), (tp, rank, i, w)


def test_missing_scale_is_a_load_error_naming_it(kv_head, tmp_path):
    d = rewrite(kv_head, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.v_scale"))
    with pytest.raises(LoadError, match=r"model\.layers\.1\.self_attn\.v_scale"):  # never a default of 1.0
        _build(d, 0, 2)


def test_non_positive_scale_refused_naming_it(kv_head, tmp_path):
    d = rewrite(kv_head, tmp_path / "z", lambda t: t["model.layers.0.self_attn.k_scale"].zero_())
    with pytest.raises(LoadError, match=r"model\.layers\.0\.self_attn\.k_scale.*not positive"):
        _build(d, 0, 1)


def test_scales_without_a_kv_cache_scheme_named(kv_head, tmp_path):
    d = rewrite(kv_head, tmp_path / "n", lambda t: None)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]  # a float config over a checkpoint that has KV-cache scales
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"self_attn\.k_scale.*kv_cache_scheme"):
        _build(d, 0, 1)


@pytest.mark.parametrize("preset,tp", [("small-fp8-kv", 1), ("small-fp8-kv-head", 4)])
def test_logits_match_float64_golden(preset, tp, ckpt, engines):
    """impl in float32 against the golden in float64 (keys and values rounded through e4m3 with the checkpoint's
    scales): the same grid, apart only where a key or value sits within float32 noise of a rounding boundary, far
    below what the FP8 cache itself moves the logits (``kv_err``: the golden without the cache's rounding)."""
    d = ckpt(preset)
    llm = engines.get(d, tp)
    golden = load_hf_model(d, "float64")
    ids = [random.Random(preset).randrange(llm.cfg.vocab_size) for _ in range(24)]
    with torch.no_grad():
        ref = golden(torch.tensor([ids])).logits[0]
        for layer in golden.model.layers:
            del layer.self_attn.kv_cache_scales
        plain = golden(torch.tensor([ids])).logits[0]
    got = llm.logits(ids).double()
    err = ((got - ref).norm() / ref.norm()).item()
    kv_err = ((plain - ref).norm() / ref.norm()).item()
    # the preset's values are small (tpcheck.inputs.models.kv_recipe), so attention moves the logits little: kv_err is
    # ~5e-5 at tp 1; impl's own error measured ~3e-7
    assert kv_err > 1e-5 and kv_err > 30 * err, (err, kv_err)
