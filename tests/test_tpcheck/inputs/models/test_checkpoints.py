"""Tests for tpcheck.inputs.models.checkpoints: synthetic HF checkpoints (Qwen2, and the other families' tiny presets)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from impl.config import HF_DTYPE_KEY, hf_rope_theta
from tpcheck.inputs.models import checkpoints as ck

TINY = [n for n in ck.preset_names() if n.startswith("tiny") and ck.preset_available(n)] + ["small"]
PROMPT = torch.tensor([[1, 5, 17, 42, 99, 7, 3]])


def _load(d, **kw) -> tuple[torch.nn.Module, dict]:
    """HF's causal LM of the class the checkpoint's config names (Qwen2ForCausalLM, LlamaForCausalLM, ...)."""
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, **kw)
    return model.eval(), info


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def test_presets_present():
    names = ck.preset_names()
    assert {"tiny", "tiny-untied", "tiny-mha", "tiny-mqa", "small", "qwen2.5-0.5b"} <= set(names)
    for name in filter(ck.preset_available, names):  # a family the installed transformers lacks: not readable
        cfg = ck.preset_config(name)
        assert cfg.hidden_size % cfg.num_attention_heads == 0
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
        assert 0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size
        assert hf_rope_theta(cfg) == ck.PRESETS[name]["rope_theta"]


@pytest.mark.parametrize("preset", TINY)
def test_loads_cleanly_and_sharded_matches(preset, tmp_path):
    single = ck.make_checkpoint(preset, tmp_path / "one", seed=3)
    sharded = ck.make_checkpoint(preset, tmp_path / "three", seed=3, shards=3)
    assert sorted(os.listdir(single)) == ["config.json", "model.safetensors"]
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _tensors(sharded).values())

    m1, info1 = _load(single)
    m3, info3 = _load(sharded)
    for info in (info1, info3):
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert not info["mismatched_keys"]
    cfg = ck.preset_config(preset)
    assert hf_rope_theta(m1.config) == hf_rope_theta(cfg) == ck.PRESETS[preset]["rope_theta"]
    assert m1.config.tie_word_embeddings == cfg.tie_word_embeddings
    l1, l3 = _logits(m1), _logits(m3)
    assert l1.shape == (1, PROMPT.shape[1], cfg.vocab_size)
    assert torch.isfinite(l1).all()
    assert torch.equal(l1, l3)
    # Loaded parameters are exactly the stored ones (nothing left at an init value); transformers 5 fuses a MoE
    # layer's per-expert tensors into 3-D ones on load (gate | up, down), and names Mixtral's block ``mlp``
    stored = _tensors(single)
    for name, p in m1.state_dict().items():
        assert torch.equal(p, _stored_as_hf(stored, name)), name


def _stored_as_hf(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The checkpoint tensor(s) behind HF's parameter ``name``: itself, the tied embedding, or the experts of a
    fused ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` stacked in expert order."""
    if name in stored:
        return stored[name]
    if name == "lm_head.weight":
        return stored["model.embed_tokens.weight"]
    base = name.rsplit(".experts.", 1)[0] if ".experts." in name else name.rsplit(".", 2)[0]
    mixtral = any(".block_sparse_moe." in k for k in stored)
    ckpt = base.replace(".mlp", ".block_sparse_moe") if mixtral else base
    if name.endswith(".gate.weight"):
        return stored[f"{ckpt}.gate.weight"]
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    n = sum(1 for k in stored if k.startswith(f"{ckpt}.experts.") and k.endswith(f".{down}.weight"))
    if name.endswith("experts.gate_up_proj"):
        return torch.stack([torch.cat([stored[f"{ckpt}.experts.{e}.{gate}.weight"],
                                       stored[f"{ckpt}.experts.{e}.{up}.weight"]]) for e in range(n)])
    assert name.endswith("experts.down_proj"), name
    return torch.stack([stored[f"{ckpt}.experts.{e}.{down}.weight"] for e in range(n)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_load_and_are_finite(dtype, tmp_path):
    d = ck.make_checkpoint("tiny-untied", tmp_path / "c", dtype=dtype)
    assert json.loads((d / "config.json").read_text())[HF_DTYPE_KEY] == dtype  # torch_dtype before transformers 4.56
    stored = _tensors(d)
    assert all(t.dtype == ck.DTYPES[dtype] for t in stored.values())
    f32 = _tensors(ck.make_checkpoint("tiny-untied", tmp_path / "f", dtype="float32"))
    for name, t in stored.items():  # a cast of the same float32 draw
        assert torch.equal(t, f32[name].to(t.dtype)), name
    model, info = _load(d, **{HF_DTYPE_KEY: ck.DTYPES[dtype]})
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.isfinite(_logits(model)).all()


def test_determinism(tmp_path):
    a = ck.make_checkpoint("tiny", tmp_path / "a", seed=7)
    b = ck.make_checkpoint("tiny", tmp_path / "b", seed=7)
    c = ck.make_checkpoint("tiny", tmp_path / "c", seed=8)
    blob = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert blob(a) == blob(b)
    assert blob(a) != blob(c)
    ta, tc = _tensors(a), _tensors(c)
    assert all(not torch.equal(ta[k], tc[k]) for k in ta)


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied"])
def test_distinguishable(preset, tmp_path):
    t = _tensors(ck.make_checkpoint(preset, tmp_path / "c"))
    cfg = ck.preset_config(preset)
    names = [n for n, _, _ in ck._tensor_specs(cfg)]
    assert sorted(t) == sorted(names)
    for name, w in t.items():
        if name.endswith("_proj.bias"):
            assert w.abs().mean() > 0.2 and (w != 0).all(), name
        if "norm" in name:
            assert ((w.double() - 1).abs() >= 0.2 - 1e-6).all(), name
            assert (w > 0).any() and (w < 1).any(), name  # both signs of the offset
    # No two tensors of the same shape are equal (catches swaps: gate/up, k/v, q/o...).
    items = list(t.items())
    for i, (n1, w1) in enumerate(items):
        for n2, w2 in items[i + 1:]:
            assert w1.shape != w2.shape or not torch.equal(w1, w2), (n1, n2)
    for i in range(cfg.num_hidden_layers):
        m = f"model.layers.{i}.mlp."
        assert not torch.equal(t[m + "gate_proj.weight"], t[m + "up_proj.weight"])
    # Weights are not symmetric, so a transpose is visible.
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(q, q.T)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in t
    else:
        assert not torch.equal(t["lm_head.weight"], t["model.embed_tokens.weight"])


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="tiny-mqa"):  # lists the valid names
        ck.preset_config("nope")
    with pytest.raises(ValueError, match="nope"):
        ck.make_checkpoint("nope", tmp_path / "x")
    with pytest.raises(ValueError, match="float64"):
        ck.make_checkpoint("tiny", tmp_path / "x", dtype="float64")
    with pytest.raises(ValueError, match="float8"):
        ck.cached_checkpoint("tiny", dtype="float8", root=tmp_path)
    with pytest.raises(ValueError, match="shards"):
        ck.make_checkpoint("tiny", tmp_path / "x", shards=0)
    full = tmp_path / "full"
    full.mkdir()
    (full / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="full"):
        ck.make_checkpoint("tiny", full)
    assert os.listdir(tmp_path) == ["full"]  # no temporary directories left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (ck.make_checkpoint("tiny", empty) / "model.safetensors").is_file()


def test_cached_checkpoint(tmp_path, monkeypatch):
    v = ck.RECIPE_VERSION
    p1 = ck.cached_checkpoint("tiny-mqa", seed=2, root=tmp_path)
    assert p1 == tmp_path / f"tiny-mqa-s2-float32-r{v}"
    st = p1 / "model.safetensors"
    mtime = st.stat().st_mtime_ns
    p2 = ck.cached_checkpoint("tiny-mqa", seed=2, root=tmp_path)
    assert p2 == p1 and st.stat().st_mtime_ns == mtime
    assert sorted(os.listdir(tmp_path)) == [f"tiny-mqa-s2-float32-r{v}"]
    monkeypatch.setenv("TPCHECK_CACHE", str(tmp_path / "env"))
    assert ck.default_cache_root() == tmp_path / "env"
    assert ck.cached_checkpoint("tiny", dtype="bfloat16") == tmp_path / "env" / f"tiny-s0-bfloat16-r{v}"


def test_recipe_version_is_in_the_cache_key(tmp_path, monkeypatch):
    """A changed recipe (a bumped RECIPE_VERSION) never reuses a checkpoint cached under the old one."""
    old = ck.cached_checkpoint("tiny", root=tmp_path)
    assert old.name == ck.cache_key("tiny") == f"tiny-s0-float32-r{ck.RECIPE_VERSION}"
    (old / "model.safetensors").write_bytes(b"stale")  # what the old recipe left behind
    monkeypatch.setattr(ck, "RECIPE_VERSION", ck.RECIPE_VERSION + 1)
    new = ck.cached_checkpoint("tiny", root=tmp_path)
    assert new != old and new.name == f"tiny-s0-float32-r{ck.RECIPE_VERSION}"
    fresh = ck.make_checkpoint("tiny", tmp_path / "fresh")
    assert (new / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    assert (old / "model.safetensors").read_bytes() == b"stale"  # left alone, never handed out again


def test_lost_race_keeps_existing(tmp_path, monkeypatch):
    """If the destination appears while we write, the existing checkpoint wins."""
    out = tmp_path / "c"
    winner = ck.make_checkpoint("tiny", tmp_path / "w", seed=1)
    real_save = ck.save_file

    def racing_save(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if not out.exists():
            os.rename(winner, out)

    monkeypatch.setattr(ck, "save_file", racing_save)
    assert ck.make_checkpoint("tiny", out, seed=0) == out
    assert (out / "model.safetensors").read_bytes() != b""
    assert _tensors(out)["model.norm.weight"].equal(
        _tensors(ck.make_checkpoint("tiny", tmp_path / "s1", seed=1))["model.norm.weight"])
    assert sorted(os.listdir(tmp_path)) == ["c", "s1"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied"])
def test_every_tensor_matters(preset, tmp_path):
    """Resetting any tensor to a default, or reversing its rows, changes the logits."""
    model, _ = _load(ck.make_checkpoint(preset, tmp_path / "c"))
    base = _logits(model)
    for name, p in model.named_parameters():
        saved = p.detach().clone()
        default = torch.ones_like(saved) if "norm" in name else torch.zeros_like(saved)
        for changed in (default, saved.flip(0)):
            with torch.no_grad():
                p.copy_(changed)
            assert (_logits(model) - base).abs().max() > 1e-2, name
        with torch.no_grad():
            p.copy_(saved)
