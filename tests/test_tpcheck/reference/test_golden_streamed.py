"""The layer-streamed golden (tpcheck.reference.streamed) equals the in-memory one bit for bit, holds one weight
matrix (or LM-head chunk) at a time, and names the tensor at fault in a checkpoint that does not fit."""
from __future__ import annotations

import json
import math
import random

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

import tpcheck
from impl.loader import LoadError
from tpcheck.measure import exact_ops
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache
from tpcheck.inputs.models.checkpoints import PRESETS, make_checkpoint, make_config_checkpoint
from tpcheck.reference.streamed import HEAD_ROW_ALIGN, streamed_hf_capture
from tpcheck.reference.reductions import Reductions

STEPS = 2
# the other families load_hf_model builds: llama3 RoPE scaling, attention biases, a sliding window, q/k norms, Gemma 3
FAMILIES = ("tiny-llama", "tiny-llama-bias", "tiny-mistral", "tiny-qwen3", "tiny-gemma3")


@pytest.fixture(scope="module")
def checkpoints(ckpt, tmp_path_factory):
    """name -> checkpoint dir: three presets, a tied model whose vocab spans 4 LM-head chunks, and a checkpoint
    in 3 shards behind model.safetensors.index.json."""
    root = tmp_path_factory.mktemp("streamed")
    big = make_config_checkpoint(dict(PRESETS["tiny"], vocab_size=3 * HEAD_ROW_ALIGN + 101, num_hidden_layers=1),
                                 root / "tied-bigvocab")
    sharded = make_checkpoint("tiny-untied", root / "tiny-untied-3shards", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) == 3
    out = {name: ckpt(name) for name in ("tiny", "small", "small-outliers") + FAMILIES}
    return {**out, "tied-bigvocab": big, "tiny-untied-3shards": sharded}


def _prompts(model_dir) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(str(model_dir.name))
    return [[rng.randrange(vocab) for _ in range(n)] for n in (9, 14)]  # two prompts, ragged


def _run(cap: HFCapture, prompts, golden=None, reductions=None) -> list[dict[str, torch.Tensor]]:
    """Prefill + STEPS greedy decode steps, with_kv; ``golden``: a run whose layer inputs teacher-force this one
    (and whose tokens it decodes)."""
    caches = [new_cache(cap.model) for _ in prompts]
    tokens, starts, out = [list(p) for p in prompts], [0] * len(prompts), []
    L = cap.num_layers
    for step in range(STEPS + 1):
        teacher = None
        if golden is not None:
            g = golden[step]
            teacher = {i: g["embed" if i == 0 else f"layers.{i - 1}.out"] for i in range(L)}
            teacher[L] = g[f"layers.{L - 1}.out"]
        points = cap.step(tokens, caches, starts, teacher, with_kv=True, reductions=reductions)
        out.append(points)
        lens = [len(t) for t in tokens]
        logits = (golden[step] if golden is not None else points)["logits"]
        nxt = logits[torch.tensor(lens).cumsum(0) - 1].argmax(-1).tolist()
        starts, tokens = [s + n for s, n in zip(starts, lens)], [[t] for t in nxt]
    return out


def _assert_equal(want: list[dict], got: list[dict], what: str, head_ulps: float | None = None) -> None:
    """Every point of every step equal, bit for bit; with ``head_ulps``, ``logits`` (a chunked head's) may differ
    by that many of its dtype's epsilon times its largest magnitude (``_blas_chunks_exact`` said why)."""
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        assert w.keys() == g.keys(), (what, step, w.keys() ^ g.keys())
        bad = [n for n in w if w[n].dtype != g[n].dtype or not torch.equal(w[n], g[n])]
        if head_ulps is not None and bad[:1] == ["logits"] and len(bad) == 1:
            wl, gl = w["logits"].double(), g["logits"].double()
            if (wl - gl).abs().max() <= head_ulps * torch.finfo(w["logits"].dtype).eps * wl.abs().max():
                bad = []
        assert not bad, f"{what}: step {step}: {len(bad)} point(s) differ, first {bad[:4]}"


def _blas_chunks_exact(vocab: int, hidden: int, chunk: int, dtype: torch.dtype, rows=range(1, 9)) -> bool:
    """Whether this machine's BLAS gives ``F.linear(x, W)`` bit for bit in chunks of ``chunk`` rows of ``W``, for
    ``x`` of each of ``rows`` rows (random data). MKL on a CPU with AMX and AVX512-FP16 picks the kernel of a
    few-row GEMM by the matrix's width, so chunks round differently there (``tpcheck.reference.streamed``)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    for m in rows:
        x = torch.randn(m, hidden, generator=g).to(dtype)
        whole = torch.nn.functional.linear(x, w)
        parts = torch.cat([torch.nn.functional.linear(x, w[a:a + chunk]) for a in range(0, vocab, chunk)], -1)
        if not torch.equal(whole, parts):
            return False
    return True


def _assert_streamed(cap: HFCapture, forwards: int) -> None:
    """Only vectors stay resident; every matrix was read once per forward and dropped; at most one matrix or
    one LM-head chunk was held at a time."""
    s = cap.model.tpcheck_streamer
    for mod, params in s.streamed.items():
        for pname, name in params:
            assert getattr(mod, pname).is_meta, f"{name} still resident after the step"
    assert cap.model.model.embed_tokens.weight.is_meta and cap.model.lm_head.weight.is_meta
    assert s.loads == len(s.streamed) * forwards
    assert s.resident_bytes == 0
    largest = max(math.prod(getattr(m, p).shape) for m, ps in s.streamed.items() for p, _ in ps)
    chunk = min(s.head_chunk_rows, s.vocab) * s.hidden
    assert s.peak_bytes == max(largest, chunk) * s.itemsize
    assert 0 <= s.arena_bytes - s.peak_bytes < 64  # one reused buffer of that size (64-byte aligned slots)


@pytest.mark.parametrize("name", ["tiny", "small", "small-outliers", "tied-bigvocab", "tiny-untied-3shards", *FAMILIES])
def test_streamed_steps_bit_identical(name, checkpoints):
    d = checkpoints[name]
    prompts = _prompts(d)
    mem, streamed = HFCapture(load_hf_model(d, "float64")), streamed_hf_capture(d, "float64")
    s, held = streamed.model.tpcheck_streamer, []
    for mod, params in s.streamed.items():  # hooks after the streamer's: what is resident while a matrix runs
        size = sum(math.prod(getattr(mod, p).shape) for p, _ in params) * s.itemsize
        mod.register_forward_pre_hook(lambda m, args, size=size: held.append((s.resident_bytes, size)))
    gold = _run(mem, prompts)
    _assert_equal(gold, _run(streamed, prompts), f"{name} float64")
    _assert_equal(_run(mem, prompts, golden=gold), _run(streamed, prompts, golden=gold), f"{name} float64 teacher")
    _assert_streamed(streamed, forwards=2 * len(prompts) * (STEPS + 1))
    assert held and all(resident == size for resident, size in held)  # only the running module's own weights
    # the noise floor's TP reference: bfloat16 with two-way row-parallel rounding
    red = Reductions(2)
    mem16, streamed16 = HFCapture(load_hf_model(d, "bfloat16")), streamed_hf_capture(d, "bfloat16")
    _assert_equal(_run(mem16, prompts, reductions=red), _run(streamed16, prompts, reductions=red),
                  f"{name} bfloat16 tp-2 reductions")
    if name == "tied-bigvocab":  # the head really ran in chunks: 3 full ones and the remainder
        assert s.tied and s.head_chunk_rows == HEAD_ROW_ALIGN and s.vocab > 3 * s.head_chunk_rows


def test_streamed_same_dtype_and_whole_head(checkpoints, ckpt):
    """Same-dtype weights are the file's zero-copy views, as from_pretrained's (float32 BLAS kernels round by
    address): float32 on a float32 checkpoint, bfloat16 and float64 on a bfloat16 one; a head read whole
    (head_chunk_rows >= vocab) is the same too."""
    d = checkpoints["tied-bigvocab"]
    prompts = _prompts(d)
    gold = _run(HFCapture(load_hf_model(d, "float32")), prompts)
    streamed = streamed_hf_capture(d, "float32")
    s = streamed.model.tpcheck_streamer
    exact = _blas_chunks_exact(s.vocab, s.hidden, s.head_chunk_rows, torch.float32)
    _assert_equal(gold, _run(streamed, prompts), "float32", None if exact else 8)
    bf = ckpt("tiny", dtype="bfloat16")
    for dtype in ("bfloat16", "float64"):
        _assert_equal(_run(HFCapture(load_hf_model(bf, dtype)), _prompts(bf)),
                      _run(streamed_hf_capture(bf, dtype), _prompts(bf)), f"bfloat16 checkpoint, {dtype}")
    whole = streamed_hf_capture(d, "float64", head_chunk_rows=10**9)
    _assert_equal(_run(HFCapture(load_hf_model(d, "float64")), prompts), _run(whole, prompts), "float64 whole head")
    assert whole.model.tpcheck_streamer.peak_bytes == 8 * whole.model.tpcheck_streamer.vocab * 64


def test_interrupted_forward_leaves_nothing_resident(checkpoints):
    """A forward that fails inside a matrix's module frees it (the hook runs on errors too); the next step
    is still bit-identical."""
    d = checkpoints["small"]
    prompts = _prompts(d)
    streamed = streamed_hf_capture(d, "float64")
    s = streamed.model.tpcheck_streamer
    up = streamed.model.model.layers[1].mlp.up_proj

    def boom(mod, args):  # after the streamer's pre-hook has loaded the weight, before the forward
        raise RuntimeError("boom")
    handle = up.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        streamed.step(prompts, [new_cache(streamed.model) for _ in prompts], [0] * len(prompts))
    handle.remove()
    assert s.resident_bytes == 0 and up.weight.is_meta
    _assert_equal(_run(HFCapture(load_hf_model(d, "float64")), prompts), _run(streamed, prompts), "after an error")


def test_rotary_and_exact_ops_norms(checkpoints):
    """The rotary buffers are HF's own; the norms exact_ops calls outside any forward are resident."""
    d = checkpoints["small"]
    mem, streamed = load_hf_model(d, "bfloat16"), streamed_hf_capture(d, "bfloat16").model
    for attr in ("inv_freq", "original_inv_freq"):
        a, b = getattr(mem.model.rotary_emb, attr), getattr(streamed.model.rotary_emb, attr)
        assert a.dtype == b.dtype and torch.equal(a, b), attr
    assert mem.model.rotary_emb.attention_scaling == streamed.model.rotary_emb.attention_scaling
    assert streamed.device == torch.device("cpu") and streamed.dtype == torch.bfloat16
    x = {"layers.1.attn.residual": torch.randn(5, 128).bfloat16(), "layers.1.out": torch.randn(5, 128).bfloat16()}
    for point in ("layers.1.input_norm", "layers.1.post_attn_norm", "final_norm"):
        want = exact_ops.expected(mem, point, x.__getitem__, lambda i: x["layers.1.out"])
        got = exact_ops.expected(streamed, point, x.__getitem__, lambda i: x["layers.1.out"])
        assert want is not None and torch.equal(want, got), point


def test_diff_streamed_table_equals_in_memory(engines):
    """End to end: tpcheck.diff with the streamed references gives the very same table (isolate and exact_ops
    exercise the teacher hooks and the norms called outside a forward)."""
    kw = dict(preset="tiny", tp=2, decode_steps=2, isolate=True, exact_ops=True, seq_len=12, pool=engines)
    a, b = tpcheck.diff(**kw), tpcheck.diff(**kw, streamed=True)
    assert len(a.table) > 0 and a.passed == b.passed
    pd.testing.assert_frame_equal(a.table.reset_index(drop=True), b.table.reset_index(drop=True), check_exact=True)


def _rewrite(src, dst, edit) -> None:
    """A copy of checkpoint ``src`` with its tensors changed by ``edit(dict)`` (safetensors, no pickle)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))


def test_checkpoint_errors_name_the_tensor(checkpoints, tmp_path):
    src = checkpoints["tiny"]
    _rewrite(src, tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}))
    with pytest.raises(LoadError, match=r"unexpected tensor 'model.layers.0.mlp.extra.weight' in model.safetensors"):
        streamed_hf_capture(tmp_path / "extra")
    _rewrite(src, tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(LoadError, match=r"lacks 1 tensor\(s\): \['model.layers.1.self_attn.k_proj.bias'\]"):
        streamed_hf_capture(tmp_path / "missing")
    _rewrite(src, tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(LoadError, match=r"'model.norm.weight' in model.safetensors has shape \[63\], the model's "
                                        r"parameter \[64\]"):
        streamed_hf_capture(tmp_path / "shape")
    sharded = checkpoints["tiny-untied-3shards"]
    bad = tmp_path / "bad-index"
    bad.mkdir()
    for f in sharded.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    moved = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][moved] = second
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match=f"puts tensor '{moved}' in {second}, which does not hold it"):
        streamed_hf_capture(bad)
    cap = streamed_hf_capture(src)
    with pytest.raises(IndexError, match="token id 250 is outside the embedding's 250 rows"):
        cap.step([[1, 250]], [new_cache(cap.model)], [0])


def test_cli_golden_streamed_flag(monkeypatch):
    import tpcheck.pipeline.diff
    from tpcheck.cli.app import main
    seen = []

    def fake_run(opts, *args, **kw):
        seen.append(opts.streamed)
        raise ValueError("stop here")
    monkeypatch.setattr(tpcheck.pipeline.diff, "run", fake_run)
    assert main(["diff", "--preset", "tiny", "--golden-streamed"]) == 2
    assert main(["diff", "--preset", "tiny"]) == 2
    assert seen == [True, False]
