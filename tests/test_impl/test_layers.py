"""Each tensor-parallel layer against a plain torch / transformers reference, at simulated tp 1, 2, 4.

Ranks are simulated in one process (``fake_tp.fake_rank``): rank r's module is built and loaded through
the public ``weight_loader(param, full_tensor, shard_id)`` contract, run with identity collectives, and the
ranks' outputs are reassembled by the test according to the module's declared ``output_placement``."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, Qwen2RotaryEmbedding, apply_rotary_pos_emb

from fake_tp import build_ranks, combine, fake_rank
from impl.config import hf_rope_theta
from impl.context import Context, set_context
from impl.layers.attention import Attention, block_slots, causal_mask
from impl.layers.embedding import ParallelLMHead, VocabParallelEmbedding, padded_vocab_size
from impl.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                RowParallelLinear, ShapeMismatch)
from impl.layers.norm import RMSNorm
from impl.layers.rotary import RotaryEmbedding
from impl.placements import Fused, Partial, Replicate, Shard

DT = torch.float64  # layer math in float64: any structural error is far above rounding
TPS = (1, 2, 4)
ATOL = 1e-10


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_linear(in_f: int, out_f: int, bias: bool, seed: int) -> nn.Linear:
    lin = nn.Linear(in_f, out_f, bias=bias, dtype=DT)
    g = gen(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g, dtype=DT))
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g, dtype=DT) * 3)
    return lin


def poison(module: nn.Module) -> None:
    """Fill every parameter with NaN so a slice the loader forgets to fill shows up in the output."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))


def load(param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
    param.weight_loader(param, full.detach().clone(), shard_id)


def run_ranks(mods, x, tp):
    outs = []
    for r, m in enumerate(mods):
        with fake_rank(r, tp) as calls, torch.no_grad():
            outs.append(m(x))
        outs[-1].calls = dict(calls)  # type: ignore[attr-defined]
    return outs


def x_input(in_f: int, seed: int = 100, tokens: int = 7) -> torch.Tensor:
    return torch.randn(tokens, in_f, generator=gen(seed), dtype=DT)


# ---------------------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("tp", TPS)
def test_column_parallel(tp):
    ref = ref_linear(16, 24, bias=True, seed=1)
    mods = build_ranks(tp, lambda: ColumnParallelLinear(16, 24, bias=True, dtype=DT))
    for r, m in enumerate(mods):
        assert m.tp_rank == r and m.tp_size == tp
        assert m.weight.shape == (24 // tp, 16) and m.bias.shape == (24 // tp,)
        assert m.output_placement == Shard(-1)
        poison(m)
        load(m.weight, ref.weight)
        load(m.bias, ref.bias)
        assert torch.equal(m.weight, ref.weight[r * 24 // tp:(r + 1) * 24 // tp])
    x = x_input(16)
    outs = run_ranks(mods, x, tp)
    assert all(o.calls.get("all_reduce", 0) == 0 for o in outs)  # column parallel needs no communication
    full = combine(outs, mods[0].output_placement)
    torch.testing.assert_close(full, ref(x).detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_bias_added_once(tp):
    ref = ref_linear(24, 16, bias=True, seed=2)
    mods = build_ranks(tp, lambda: RowParallelLinear(24, 16, bias=True, dtype=DT))
    for r, m in enumerate(mods):
        assert m.weight.shape == (16, 24 // tp) and m.bias.shape == (16,)
        assert m.output_placement == Replicate()
        poison(m)
        load(m.weight, ref.weight)
        load(m.bias, ref.bias)
        assert torch.equal(m.weight, ref.weight[:, r * 24 // tp:(r + 1) * 24 // tp])
    x = x_input(24)
    # rank r consumes its Shard(-1) slice of the input
    outs = []
    for r, m in enumerate(mods):
        xr = x[:, r * 24 // tp:(r + 1) * 24 // tp]
        with fake_rank(r, tp) as calls, torch.no_grad():
            outs.append(m(xr))
        assert calls["all_reduce"] == 1
    # the all-reduce was an identity: the true output is the sum of the partial outputs
    full = combine(outs, Partial())
    torch.testing.assert_close(full, ref(x).detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tp", TPS)
def test_merged_column_gate_up(tp):
    inter, hidden = 32, 16
    gate, up = ref_linear(hidden, inter, False, seed=3), ref_linear(hidden, inter, False, seed=4)
    mods = build_ranks(tp, lambda: MergedColumnParallelLinear(hidden, [inter, inter], bias=False, dtype=DT))
    for m in mods:
        assert m.weight.shape == (2 * inter // tp, hidden)
        assert m.output_placement == Fused((("gate", inter // tp, Shard(-1)), ("up", inter // tp, Shard(-1))))
        poison(m)
        load(m.weight, gate.weight, 0)
        load(m.weight, up.weight, 1)
    x = x_input(hidden)
    full = combine(run_ranks(mods, x, tp), mods[0].output_placement)
    torch.testing.assert_close(full, torch.cat([gate(x), up(x)], -1).detach(), atol=ATOL, rtol=0)
    # reassembling the weights the same way gives cat(gate, up)
    wfull = combine([m.weight.data for m in mods], mods[0].output_placement, dim=0)
    assert torch.equal(wfull, torch.cat([gate.weight, up.weight]))


@pytest.mark.parametrize("tp", TPS)
def test_merged_column_unequal_parts(tp):
    """Parts of different widths: the offset of part 1 inside the local weight is gate_local rows."""
    gate, up = ref_linear(8, 16, False, seed=5), ref_linear(8, 32, False, seed=6)
    mods = build_ranks(tp, lambda: MergedColumnParallelLinear(8, [16, 32], bias=False, dtype=DT))
    for m in mods:
        poison(m)
        load(m.weight, gate.weight, 0)
        load(m.weight, up.weight, 1)
    x = x_input(8)
    full = combine(run_ranks(mods, x, tp), mods[0].output_placement)
    torch.testing.assert_close(full, torch.cat([gate(x), up(x)], -1).detach(), atol=ATOL, rtol=0)


QKV_LAYOUTS = [(8, 2), (4, 4), (4, 1)]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("heads,kv", QKV_LAYOUTS, ids=[f"{h}h{k}kv" for h, k in QKV_LAYOUTS])
def test_qkv_parallel(heads, kv, tp):
    d, hidden = 4, 16
    q_ref = ref_linear(hidden, heads * d, True, seed=7)
    k_ref = ref_linear(hidden, kv * d, True, seed=8)
    v_ref = ref_linear(hidden, kv * d, True, seed=9)
    mods = build_ranks(tp, lambda: QKVParallelLinear(hidden, d, heads, kv, bias=True, dtype=DT))
    local_kv = max(kv // tp, 1)
    replicas = max(tp // kv, 1)
    for m in mods:
        assert m.weight.shape == ((heads // tp + 2 * local_kv) * d, hidden)
        assert m.bias.shape == ((heads // tp + 2 * local_kv) * d,)
        assert (m.num_heads, m.num_kv_heads, m.kv_replicas) == (heads // tp, local_kv, replicas)
        kvp = Shard(-1, replicas)
        assert m.output_placement == Fused((("q", heads // tp * d, Shard(-1)), ("k", local_kv * d, kvp),
                                            ("v", local_kv * d, kvp)))
        poison(m)
        for sid, ref in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
            load(m.weight, ref.weight, sid)
            load(m.bias, ref.bias, sid)
    # rank r holds KV head r // replicas (replication) or heads [r*K/tp, (r+1)*K/tp) (partition)
    for r, m in enumerate(mods):
        k_local = m.weight[heads // tp * d:heads // tp * d + local_kv * d]
        first = r // replicas * local_kv
        assert torch.equal(k_local, k_ref.weight[first * d:(first + local_kv) * d])
    x = x_input(hidden)
    outs = run_ranks(mods, x, tp)
    full = combine(outs, mods[0].output_placement)  # asserts KV replicas are identical
    expected = torch.cat([q_ref(x), k_ref(x), v_ref(x)], -1).detach()
    torch.testing.assert_close(full, expected, atol=ATOL, rtol=0)


def test_qkv_bad_tp_refused():
    with fake_rank(0, 4), pytest.raises(ValueError, match="num_key_value_heads|kv"):
        QKVParallelLinear(16, 4, 12, 3, dtype=DT)  # tp 4 > 3 KV heads, 4 % 3 != 0
    with fake_rank(0, 2), pytest.raises(ValueError, match="3"):
        QKVParallelLinear(16, 4, 12, 3, dtype=DT)  # 3 KV heads over 2 ranks


@pytest.mark.parametrize("make,shape,sid", [
    (lambda: ColumnParallelLinear(16, 24, dtype=DT), (24, 15), None),
    (lambda: RowParallelLinear(24, 16, dtype=DT), (24, 16), None),  # transposed
    (lambda: MergedColumnParallelLinear(16, [32, 32], dtype=DT), (64, 16), 0),  # already fused
    (lambda: QKVParallelLinear(16, 4, 8, 2, dtype=DT), (16, 16), "k"),  # q's shape handed as k
])
def test_weight_loader_shape_mismatch(make, shape, sid):
    with fake_rank(1, 2):
        m = make()
    with pytest.raises(ShapeMismatch, match=r"\[%d, %d\]" % shape):
        m.weight.weight_loader(m.weight, torch.zeros(shape, dtype=DT), sid)


# ------------------------------------------------------------------------------------ vocab embedding
def vocab_ids(vocab: int, tp: int) -> torch.Tensor:
    rows = padded_vocab_size(vocab, tp) // tp
    ids = {0, 1, vocab - 1, vocab - 2}
    for r in range(1, tp):  # both sides of every shard boundary
        ids |= {r * rows - 1, r * rows}
    ids = sorted(i for i in ids if 0 <= i < vocab)
    extra = torch.randint(0, vocab, (20,), generator=gen(11)).tolist()
    return torch.tensor(ids + extra + ids[::-1])


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("vocab", [250, 301, 256])
def test_vocab_parallel_embedding(vocab, tp):
    hidden = 8
    ref = nn.Embedding(vocab, hidden, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(vocab, hidden, generator=gen(10), dtype=DT) + 5.0)  # row 0 is nonzero
    vp = padded_vocab_size(vocab, tp)
    assert vp % 64 == 0 and vp % tp == 0 and vocab <= vp < vocab + 64 * tp
    mods = build_ranks(tp, lambda: VocabParallelEmbedding(vocab, hidden, dtype=DT))
    rows = vp // tp
    for r, m in enumerate(mods):
        assert m.weight.shape == (rows, hidden)
        assert m.output_placement == Replicate()
        with torch.no_grad():
            m.weight.fill_(7.0)  # stale values: the loader must zero the padding rows
        load(m.weight, ref.weight)
        real = max(0, min((r + 1) * rows, vocab) - r * rows)
        assert torch.equal(m.weight[:real], ref.weight[r * rows:r * rows + real])
        assert torch.count_nonzero(m.weight[real:]) == 0, "padding rows must be zero"
    ids = vocab_ids(vocab, tp)
    outs = []
    for r, m in enumerate(mods):
        with fake_rank(r, tp) as calls, torch.no_grad():
            outs.append(m(ids))
        assert calls["all_reduce"] == (1 if tp > 1 else 0)
        if tp > 1:  # each rank contributes exactly the ids it owns, zeros elsewhere
            mine = (ids >= r * rows) & (ids < (r + 1) * rows)
            assert torch.count_nonzero(outs[-1][~mine]) == 0
    # the all-reduce was patched out: the replicated output is the sum of the rank contributions
    full = combine(outs, Partial())
    assert torch.equal(full, ref(ids).detach())


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("vocab", [250, 301])
def test_parallel_lm_head(vocab, tp):
    hidden = 8
    w = torch.randn(vocab, hidden, generator=gen(12), dtype=DT)
    h = torch.randn(5, hidden, generator=gen(13), dtype=DT)
    mods = build_ranks(tp, lambda: ParallelLMHead(vocab, hidden, dtype=DT))
    for m in mods:
        assert m.output_placement == Shard(-1)
        poison(m)
        load(m.weight, w)
    local = [m.local_logits(h) for m in mods]
    vp = padded_vocab_size(vocab, tp)
    assert all(lg.shape == (5, vp // tp) for lg in local)
    full = combine(local, mods[0].output_placement)
    assert full.shape == (5, vp)
    torch.testing.assert_close(full[:, :vocab], h @ w.T, atol=ATOL, rtol=0)
    assert torch.count_nonzero(full[:, vocab:]) == 0  # padding columns come from zero rows
    # forward: gather on rank 0, padding stripped
    if tp == 1:
        with torch.no_grad():
            out = mods[0](h)
        assert out.shape == (5, vocab)
        torch.testing.assert_close(out, h @ w.T, atol=ATOL, rtol=0)
    else:
        with fake_rank(0, tp) as calls:
            mods[0](h)
        assert calls["gather"] == 1


# ----------------------------------------------------------------------------------------- norm / rope
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_bitwise(dtype):
    hidden, eps = 64, 1e-6
    w = (1 + 0.4 * torch.rand(hidden, generator=gen(14)) * torch.randn(hidden, generator=gen(15)).sign()).to(dtype)
    x = (torch.randn(9, hidden, generator=gen(16)) * 3).to(dtype)
    ours = RMSNorm(hidden, eps, dtype)
    ref = Qwen2RMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
        got, want = ours(x), ref(x)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("theta,d", [(10000.0, 8), (1e6, 16), (500000.0, 64)])
def test_rotary_matches_hf(theta, d, dtype):
    heads, kv = 4, 2
    cfg = Qwen2Config(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv, rope_theta=theta,
                      max_position_embeddings=4096)
    assert hf_rope_theta(cfg) == theta
    hf_rope = Qwen2RotaryEmbedding(cfg)
    ours = RotaryEmbedding(d, theta)
    positions = torch.cat([torch.arange(37, 37 + 6), torch.tensor([1000, 3, 2047, 0])])  # not starting at 0
    t = positions.numel()
    q = torch.randn(t, heads, d, generator=gen(17)).to(dtype)
    k = torch.randn(t, kv, d, generator=gen(18)).to(dtype)
    gq, gk = ours(positions, q, k)
    # transformers: q/k [batch, heads, seq, dim], cos/sin [batch, seq, dim]
    cos, sin = hf_rope(q[None].transpose(1, 2), positions[None])
    rq, rk = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    rq, rk = rq[0].transpose(0, 1), rk[0].transpose(0, 1)
    assert gq.dtype == dtype and gk.dtype == dtype
    torch.testing.assert_close(gq, rq, atol=0, rtol=0)
    torch.testing.assert_close(gk, rk, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ attention
def test_causal_mask():
    for q_len, k_len in [(1, 1), (1, 7), (3, 3), (3, 8), (5, 12)]:
        m = causal_mask(q_len, k_len)
        assert m.dtype == torch.bool and m.shape == (q_len, k_len)
        for i in range(q_len):
            for j in range(k_len):
                assert bool(m[i, j]) == (j <= i + k_len - q_len), (q_len, k_len, i, j)
        assert m[-1].all()  # the last query sees every key (bottom-right aligned)
        assert m.sum(-1).min() >= 1  # no fully masked row -> no NaN softmax
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def ref_attention(q, k, v, scale):
    """One sequence: q [Lq, H, d] over k/v [Lk, K, d], causal bottom-right, plain softmax."""
    lq, heads, _ = q.shape
    lk, kv, _ = k.shape
    grp = heads // kv
    kk, vv = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)  # head h -> KV head h // grp
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    allowed = torch.tensor([[j <= i + lk - lq for j in range(lk)] for i in range(lq)])
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


HEADS, KVH, D = 4, 2, 8
SCALE = D ** -0.5


def qkv(total: int, seed: int):
    g = gen(seed)
    return (torch.randn(total, HEADS, D, generator=g, dtype=DT), torch.randn(total, KVH, D, generator=g, dtype=DT),
            torch.randn(total, KVH, D, generator=g, dtype=DT))


@pytest.fixture
def clean_context():
    set_context(None)
    yield
    set_context(None)


def test_attention_ragged_prefill(clean_context):
    lens = [5, 1, 7, 3]
    q, k, v = qkv(sum(lens), 19)
    attn = Attention(HEADS, KVH, D, SCALE)
    set_context(Context(seq_lens_q=lens, seq_lens_k=lens))
    out = attn(q, k, v)
    assert out.shape == (sum(lens), HEADS * D)
    assert torch.isfinite(out).all()
    start = 0
    for n in lens:
        want = ref_attention(q[start:start + n], k[start:start + n], v[start:start + n], SCALE)
        torch.testing.assert_close(out[start:start + n], want.reshape(n, -1), atol=1e-12, rtol=0)
        start += n


def test_attention_mqa_head_mapping(clean_context):
    """4 query heads over 1 KV head and over 4 (no GQA): the same reference."""
    for kvh in (1, 4):
        g = gen(20 + kvh)
        q = torch.randn(6, 4, D, generator=g, dtype=DT)
        k, v = torch.randn(6, kvh, D, generator=g, dtype=DT), torch.randn(6, kvh, D, generator=g, dtype=DT)
        set_context(Context([6], [6]))
        out = Attention(4, kvh, D, SCALE)(q, k, v)
        torch.testing.assert_close(out, ref_attention(q, k, v, SCALE).reshape(6, -1), atol=1e-12, rtol=0)


def paged_setup(lens, block_size, seed):
    """A cache with shuffled, interleaved block tables; garbage in every slot (masking must hide it)."""
    max_blocks = math.ceil((max(lens) + 1) / block_size)  # room for the decode token
    num_blocks = max_blocks * len(lens) + 3
    perm = torch.randperm(num_blocks, generator=gen(seed))
    tables = perm[:max_blocks * len(lens)].view(max_blocks, len(lens)).T.contiguous()  # interleaved across seqs
    g = gen(seed + 1)
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=g, dtype=DT) * 50
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=g, dtype=DT) * 50
    return tables, k_cache, v_cache


def slots_of(tables, block_size, seq, positions):
    return torch.tensor([int(tables[seq, p // block_size]) * block_size + p % block_size for p in positions],
                        dtype=torch.long)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_paged_decode(block_size, clean_context):
    lens = [5, 1, 18, 9]  # prompt lengths; then one decode token each
    total = [n + 1 for n in lens]
    seqs = [qkv(n, 30 + i) for i, n in enumerate(total)]
    tables, k_cache, v_cache = paged_setup(lens, block_size, 40)
    attn = Attention(HEADS, KVH, D, SCALE)
    attn.k_cache, attn.v_cache = k_cache, v_cache

    # prefill: write each prompt's K/V into its slots
    q = torch.cat([s[0][:n] for s, n in zip(seqs, lens)])
    k = torch.cat([s[1][:n] for s, n in zip(seqs, lens)])
    v = torch.cat([s[2][:n] for s, n in zip(seqs, lens)])
    slots = torch.cat([slots_of(tables, block_size, i, range(n)) for i, n in enumerate(lens)])
    set_context(Context(lens, lens, slot_mapping=slots))
    out = attn(q, k, v)
    start = 0
    for (sq, sk, sv), n in zip(seqs, lens):
        want = ref_attention(sq[:n], sk[:n], sv[:n], SCALE).reshape(n, -1)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-12, rtol=0)
        start += n
    flat_k = k_cache.view(-1, KVH, D)
    assert torch.equal(flat_k[slots], k)  # written where the block table says
    assert torch.equal(block_slots(tables, block_size, max(lens))[2, :lens[2]], slots_of(tables, block_size, 2,
                                                                                          range(lens[2])))

    # decode: one token per sequence at position len
    q = torch.stack([s[0][n] for s, n in zip(seqs, lens)])
    k = torch.stack([s[1][n] for s, n in zip(seqs, lens)])
    v = torch.stack([s[2][n] for s, n in zip(seqs, lens)])
    slots = torch.cat([slots_of(tables, block_size, i, [n]) for i, n in enumerate(lens)])
    ctx = Context([1] * len(lens), total, slot_mapping=slots, block_tables=tables)
    assert ctx.is_decode
    set_context(ctx)
    out = attn(q, k, v)
    assert torch.isfinite(out).all()
    for i, ((sq, sk, sv), _n) in enumerate(zip(seqs, total)):
        want = ref_attention(sq, sk, sv, SCALE)[-1].reshape(-1)
        torch.testing.assert_close(out[i], want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_prefill_with_cached_prefix(block_size, clean_context):
    """Prefix caching / chunked prefill: the first ``cached`` tokens are in the cache, the rest are new."""
    lens, cached = [12, 7, 20], [4, 0, 16]
    seqs = [qkv(n, 50 + i) for i, n in enumerate(lens)]
    tables, k_cache, v_cache = paged_setup(lens, block_size, 60)
    attn = Attention(HEADS, KVH, D, SCALE)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    for i, ((_, sk, sv), c) in enumerate(zip(seqs, cached)):
        s = slots_of(tables, block_size, i, range(c))
        k_cache.view(-1, KVH, D)[s] = sk[:c]
        v_cache.view(-1, KVH, D)[s] = sv[:c]
    new = [n - c for n, c in zip(lens, cached)]
    q = torch.cat([s[0][c:] for s, c in zip(seqs, cached)])
    k = torch.cat([s[1][c:] for s, c in zip(seqs, cached)])
    v = torch.cat([s[2][c:] for s, c in zip(seqs, cached)])
    slots = torch.cat([slots_of(tables, block_size, i, range(c, n)) for i, (n, c) in enumerate(zip(lens, cached))])
    set_context(Context(new, lens, slot_mapping=slots, block_tables=tables))
    out = attn(q, k, v)
    start = 0
    for (sq, sk, sv), n, c in zip(seqs, lens, cached):
        want = ref_attention(sq, sk, sv, SCALE)[c:].reshape(n - c, -1)
        torch.testing.assert_close(out[start:start + n - c], want, atol=1e-12, rtol=0)
        start += n - c
