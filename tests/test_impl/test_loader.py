"""impl.loader against real synthetic checkpoints (tpcheck.inputs.models.checkpoints.make_checkpoint).

Models are built in-process: at tp 1 directly, at tp 2/4 as simulated ranks (``fake_tp.fake_rank``,
construction and loading only)."""
from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file, save_file

import impl.loader
from fake_tp import combine, fake_rank
from impl.config import load_config
from impl.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from impl.loader import LoadError, load_weights
from impl.models.qwen2 import Qwen2ForCausalLM
from impl.placements import Replicate
from tpcheck.inputs.models.checkpoints import make_checkpoint

PRESETS = ("tiny", "tiny-untied", "tiny-mqa")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``(preset, dtype, shards) -> dir``, each written once per module (and per xdist worker)."""
    root = tmp_path_factory.mktemp("loader_ckpts")
    made = {}

    def get(preset, dtype="float32", shards=1):
        key = (preset, dtype, shards)
        if key not in made:
            made[key] = make_checkpoint(preset, root / f"{preset}-{dtype}-{shards}", seed=7, dtype=dtype,
                                        shards=shards)
        return made[key]

    return get


def build(model_dir, dtype=torch.float32, rank=0, tp=1, load=True):
    cfg = load_config(model_dir)
    with fake_rank(rank, tp):
        model = Qwen2ForCausalLM(cfg, dtype)
        if load:
            load_weights(model, model_dir, dtype)
    return model


def checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_names(name: str) -> list[str]:
    """The HF tensor names an impl parameter is built from, in fused order."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


def hf_tensor(name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The full tensor an impl parameter should hold (qkv = cat(q, k, v), gate_up = cat(gate, up))."""
    return torch.cat([hf[n] for n in hf_names(name)])


def owner(model, pname):
    return model.get_submodule(pname.rsplit(".", 1)[0])


def params(model) -> dict[str, torch.Tensor]:
    """The model's parameters with the vocab padding rows stripped (after checking they are zero)."""
    out = {}
    vocab = model.cfg.vocab_size
    for name, p in model.named_parameters():
        if isinstance(owner(model, name), VocabParallelEmbedding):
            assert p.shape[0] == padded_vocab_size(vocab, 1) and torch.count_nonzero(p[vocab:]) == 0, name
            p = p[:vocab]
        out[name] = p.detach()
    return out


# --------------------------------------------------------------------------------------------- tp 1
@pytest.mark.parametrize("preset", PRESETS + ("tiny-mha",))
def test_tp1_params_equal_hf(preset, ckpts):
    from tpcheck.reference.hf import load_hf_model

    d = ckpts(preset)
    model = build(d)
    hf_model = load_hf_model(d, "float32")
    hf = {k: v.detach() for k, v in hf_model.state_dict().items()}
    covered = set()
    for name, p in params(model).items():
        want = hf_tensor(name, hf)
        assert p.dtype == torch.float32
        assert torch.equal(p, want), name
        covered |= set(hf_names(name))
    tied = load_config(d).tie_word_embeddings
    assert covered | ({"lm_head.weight"} if tied else set()) == set(hf), set(hf) ^ covered
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in checkpoint_tensors(d)
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied"])
def test_sharded_checkpoint_loads_identically(preset, ckpts):
    one, three = ckpts(preset), ckpts(preset, shards=3)
    assert (three / "model.safetensors.index.json").is_file()
    assert len(list(three.glob("*.safetensors"))) == 3
    a, b = params(build(one)), params(build(three))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
def test_dtype_cast_at_load(target, ckpts):
    d = ckpts("tiny-untied")
    hf = checkpoint_tensors(d)
    model = build(d, dtype=target)
    for name, p in params(model).items():
        assert p.dtype == target, name
        assert torch.equal(p, hf_tensor(name, hf).to(target)), name


def test_bf16_checkpoint_loaded_as_float32(ckpts):
    d = ckpts("tiny", dtype="bfloat16")
    hf = checkpoint_tensors(d)
    model = build(d, dtype=torch.float32)
    for name, p in params(model).items():
        assert p.dtype == torch.float32
        assert torch.equal(p, hf_tensor(name, hf).float()), name


# ---------------------------------------------------------------------------------- simulated tp 2/4
def unshard_param(models, pname, vocab):
    """Reassemble the full parameter from the ranks' local ones, from the owning module's layout."""
    locals_ = [dict(m.named_parameters())[pname].data for m in models]
    mod = owner(models[0], pname)
    kind = type(mod).__name__
    if kind in ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear"):
        return combine(locals_, mod.output_placement, dim=0)  # output features are weight rows
    if kind == "RowParallelLinear":
        return torch.cat(locals_, dim=1) if locals_[0].dim() == 2 else combine(locals_, Replicate())
    if kind in ("VocabParallelEmbedding", "ParallelLMHead"):
        full = torch.cat(locals_, dim=0)
        assert full.shape[0] == padded_vocab_size(vocab, len(models))
        assert torch.count_nonzero(full[vocab:]) == 0, "padding rows must be zero"
        return full[:vocab]
    if kind == "RMSNorm":
        return combine(locals_, Replicate())
    raise AssertionError(f"unexpected module {kind} for {pname}")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_simulated_tp_shards_reassemble(preset, tp, ckpts):
    d = ckpts(preset)
    cfg = load_config(d)
    full = params(build(d))
    ranks = [build(d, rank=r, tp=tp) for r in range(tp)]
    for r, m in enumerate(ranks):
        attn = m.model.layers[0].self_attn
        assert attn.qkv_proj.tp_rank == r and attn.qkv_proj.tp_size == tp
        assert attn.num_heads == cfg.num_heads // tp
        assert attn.num_kv_heads == max(cfg.num_kv_heads // tp, 1)
        if cfg.tie_word_embeddings:
            assert m.lm_head.weight is m.model.embed_tokens.weight
    for pname in full:
        got = unshard_param(ranks, pname, cfg.vocab_size)
        assert torch.equal(got, full[pname]), pname


class ReadRecorder:
    """Records every lazy read: (rank, tensor name, tensor shape, dim, start, length)."""

    def __init__(self, monkeypatch):
        self.reads = []
        self.rank = None
        self._current = None
        real_safe_open, real_narrow = impl.loader.safe_open, impl.loader.LazySlice.narrow
        rec = self

        class Handle:  # exposes only lazy access: a loader calling get_tensor() fails the test
            def __init__(self, *a, **kw):
                self._cm = real_safe_open(*a, **kw)

            def __enter__(self):
                self._f = self._cm.__enter__()
                return self

            def __exit__(self, *exc):
                return self._cm.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_slice(self, name):
                rec._current = name
                return self._f.get_slice(name)

        def narrow(self_, dim, start, length):
            rec.reads.append((rec.rank, rec._current, tuple(self_.shape), dim, start, length))
            return real_narrow(self_, dim, start, length)

        monkeypatch.setattr(impl.loader, "safe_open", Handle)
        monkeypatch.setattr(impl.loader.LazySlice, "narrow", narrow)


def read_bytes(shape, dim, length, itemsize=4):
    return math.prod(shape) // shape[dim] * length * itemsize


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", ["tiny", "tiny-untied", "tiny-mqa"])
def test_each_rank_reads_only_its_slices(preset, tp, ckpts, monkeypatch):
    d = ckpts(preset)
    cfg = load_config(d)
    hf = checkpoint_tensors(d)
    total = sum(t.nbytes for t in hf.values())
    rec = ReadRecorder(monkeypatch)
    for r in range(tp):
        rec.rank = r
        build(d, rank=r, tp=tp)
    by_tensor = defaultdict(list)
    for rank, name, shape, dim, start, length in rec.reads:
        assert shape == tuple(hf[name].shape), name
        by_tensor[name].append((rank, dim, start, length))
    assert set(by_tensor) == set(hf) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())

    replicas = max(tp // cfg.num_kv_heads, 1)
    for name, reads in by_tensor.items():
        n = hf[name].shape
        assert sorted(r for r, *_ in reads) == list(range(tp)), f"{name}: each rank reads it exactly once"
        if "norm" in name:  # replicated: every rank reads the whole tensor
            assert all((dim, start, length) == (0, 0, n[0]) for _, dim, start, length in reads), name
            continue
        dims = {dim for _, dim, _, _ in reads}
        sharded_dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        assert dims == {sharded_dim}, (name, dims)
        size = n[sharded_dim]
        if "embed_tokens" in name or name == "lm_head.weight":
            rows = padded_vocab_size(cfg.vocab_size, tp) // tp
            for rank, _, start, length in reads:
                assert start == rank * rows and length == max(0, min(rows, size - start)), (name, rank)
            continue
        rep = replicas if any(f"{p}_proj" in name for p in "kv") else 1
        for rank, _, start, length in reads:
            assert length * tp == size * rep, f"{name}: rank {rank} read {length} of {size}"
            assert start == rank // rep * length, (name, rank, start)

    itemsize = 4
    norm_bytes = sum(t.nbytes for k, t in hf.items() if "norm" in k)
    per_rank = defaultdict(int)
    for rank, _name, shape, dim, _, length in rec.reads:
        per_rank[rank] += read_bytes(shape, dim, length, itemsize)
    vocab_slack = (padded_vocab_size(cfg.vocab_size, tp) // tp) * cfg.hidden_size * itemsize * 2
    for rank, nbytes in per_rank.items():
        assert nbytes <= (total - norm_bytes) / tp * max(1, replicas) + norm_bytes + vocab_slack, rank
        assert nbytes < 0.75 * total if tp == 2 else nbytes < 0.5 * total, (rank, nbytes, total)
    if replicas == 1:  # no KV replication: every byte is read once overall, norms once per rank
        assert sum(per_rank.values()) == total + (tp - 1) * norm_bytes


def test_tp2_rank_reads_about_half(ckpts, monkeypatch):
    d = ckpts("tiny-untied")
    hf = checkpoint_tensors(d)
    total = sum(t.nbytes for t in hf.values())
    norm_bytes = sum(t.nbytes for k, t in hf.items() if "norm" in k)
    rec = ReadRecorder(monkeypatch)
    rec.rank = 1
    build(d, rank=1, tp=2)
    nbytes = sum(read_bytes(s, dim, n) for _, _, s, dim, _, n in rec.reads)
    # rank 1 of vocab 301 -> padded 320: owns rows 160..300 (141 real), fewer than half
    assert nbytes <= (total - norm_bytes) / 2 + norm_bytes
    assert nbytes >= (total - norm_bytes) / 2 * 0.9


# ------------------------------------------------------------------------------------------- errors
def rewrite(src, dst, edit):
    """Copy checkpoint dir ``src`` to ``dst`` with ``edit(tensors)`` applied to its single safetensors file."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tp", [1, 2])
def test_missing_tensor(tp, ckpts, tmp_path):
    d = rewrite(ckpts("tiny"), tmp_path / "m", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(LoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        build(d, rank=tp - 1, tp=tp)


def test_missing_lm_head_untied(ckpts, tmp_path):
    d = rewrite(ckpts("tiny-untied"), tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(LoadError, match=r"lm_head\.weight"):
        build(d)


def test_unexpected_tensor(ckpts, tmp_path):
    def add(t):
        t["model.layers.0.foo.weight"] = torch.zeros(3)

    d = rewrite(ckpts("tiny"), tmp_path / "u", add)
    with pytest.raises(LoadError, match=r"model\.layers\.0\.foo\.weight"):
        build(d)


def test_tied_checkpoint_with_lm_head_and_inv_freq_accepted(ckpts, tmp_path):
    """Some tied checkpoints also store lm_head.weight and rotary inv_freq buffers: tolerated."""
    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    d = rewrite(ckpts("tiny"), tmp_path / "t", add)
    model = build(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    want = checkpoint_tensors(ckpts("tiny"))["model.embed_tokens.weight"]
    assert torch.equal(params(model)["model.embed_tokens.weight"], want)


MISSHAPED = [
    ("model.layers.1.self_attn.k_proj.weight", (32, 64), (16, 64)),  # qkv part
    ("model.layers.0.self_attn.q_proj.bias", (63,), (64,)),
    ("model.layers.0.mlp.down_proj.weight", (96, 64), (64, 96)),  # transposed row-parallel
    ("model.layers.0.mlp.gate_proj.weight", (96, 63), (96, 64)),
    ("model.norm.weight", (65,), (64,)),  # replicated (default loader)
    ("model.embed_tokens.weight", (249, 64), (250, 64)),
]


@pytest.mark.parametrize("name,bad,good", MISSHAPED, ids=[m[0].split(".", 3)[-1] for m in MISSHAPED])
def test_misshaped_tensor(name, bad, good, ckpts, tmp_path):
    def edit(t):
        assert tuple(t[name].shape) == good
        t[name] = torch.zeros(bad)

    d = rewrite(ckpts("tiny"), tmp_path / "s", edit)
    with pytest.raises(LoadError) as ei:
        build(d)
    msg = str(ei.value)
    assert name in msg
    assert str(list(bad)) in msg and str(list(good)) in msg, msg


def test_pickle_only_refused(ckpts, tmp_path):
    src = ckpts("tiny")
    d = tmp_path / "pickle"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    torch.save(checkpoint_tensors(src), d / "pytorch_model.bin")
    with pytest.raises(LoadError, match="pickle") as ei:
        build(d)
    assert "pytorch_model.bin" in str(ei.value)


def test_no_weights_at_all(ckpts, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text((ckpts("tiny") / "config.json").read_text())
    with pytest.raises(LoadError, match="safetensors"):
        build(d)


def test_index_lists_missing_file(ckpts, tmp_path):
    import shutil

    src = ckpts("tiny", shards=3)
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (d / gone).unlink()
    with pytest.raises(LoadError, match=gone.replace(".", r"\.")):
        build(d)
