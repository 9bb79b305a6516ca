"""tpcheck.inputs.models.quantize's FP8 KV-cache schemes (``fp8-kv``, ``fp8-kv-head``, ``w8a8-fp8-kv``): the k / v scales
against the float model's own cache (keys after RoPE, values) on the calibration prompts, their shapes, the
compressed-tensors ``kv_cache_scheme``, and the other tensors as the scheme says (float linears untouched)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from tpcheck.inputs.models.calibrate import PROMPTS, TOKENS
from tpcheck.inputs.models.quantize import KV_CACHE, KV_ONLY, quantization_config, quantize_checkpoint
from tpcheck.reference.hf import cache_keyword, cache_kv, load_hf_model, new_cache


@pytest.fixture(scope="module", params=list(KV_CACHE))
def quantized(request, ckpt, tmp_path_factory):
    src = ckpt("small-hd32")  # 2 KV heads of head_dim 32
    return request.param, src, quantize_checkpoint(src, tmp_path_factory.mktemp("kv") / "out", request.param)


def _absmax_of_the_cache(src) -> dict[str, torch.Tensor]:
    """max |k| and |v| per layer and KV head over the calibration prompts, read from HF's own KV cache."""
    model = load_hf_model(src, "float32")
    rng, out = random.Random(0), {}
    with torch.no_grad():
        for _ in range(PROMPTS):
            cache = new_cache(model)
            model(torch.tensor([[rng.randrange(model.config.vocab_size) for _ in range(TOKENS)]]),
                  use_cache=True, **{cache_keyword(model): cache})
            for i in range(model.config.num_hidden_layers):
                for w, t in zip("kv", cache_kv(cache, i)):  # [positions, kv_heads * head_dim]
                    a = t.abs().reshape(t.shape[0], model.config.num_key_value_heads, -1).amax(dim=(0, 2)).double()
                    name = f"model.layers.{i}.self_attn.{w}_scale"
                    out[name] = torch.maximum(out.get(name, a), a)
    return out


def test_kv_scales_are_the_caches_absmax_over_448(quantized):
    scheme, src, dst = quantized
    got, want = load_file(str(dst / "model.safetensors")), _absmax_of_the_cache(src)
    assert set(n for n in got if n.endswith(("k_scale", "v_scale"))) == set(want)
    for name, a in want.items():
        s = got[name]
        assert s.dtype == torch.float32
        if KV_CACHE[scheme] == "tensor":
            assert s.shape == (1,) and torch.allclose(s.double(), a.max().reshape(1) / 448, rtol=1e-6), name
        else:
            assert s.shape == (2, 1, 1) and torch.allclose(s.double().reshape(-1), a / 448, rtol=1e-6), name


def test_config_and_linears(quantized):
    scheme, src, dst = quantized
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc == quantization_config(scheme)
    kv = qc["kv_cache_scheme"]
    assert (kv["type"], kv["num_bits"], kv["symmetric"], kv["dynamic"], kv["strategy"]) == \
        ("float", 8, True, False, KV_CACHE[scheme])
    a, b = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    if scheme in KV_ONLY:  # float linears: every source tensor as it was, plus the scales
        assert qc["config_groups"] == {} and set(b) - set(a) == {n for n in b if n.endswith(("k_scale", "v_scale"))}
        assert all(torch.equal(a[n], b[n]) for n in a)
    else:
        assert b["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
        assert "model.layers.0.self_attn.k_proj.weight_scale" in b
