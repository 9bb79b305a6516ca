"""Scheduler: admission, finishing, preemption, and a simulated engine with a fake model."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from impl.block_manager import BlockManager, slots
from impl.sampling_params import SamplingParams
from impl.scheduler import Scheduler
from impl.sequence import Sequence, SequenceStatus

V = 50
EOS = 0


def fake_next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % V


def reference(prompt: list[int], p: SamplingParams, eos: set[int]) -> list[int]:
    toks, out = list(prompt), []
    while True:
        t = fake_next(toks)
        toks.append(t)
        out.append(t)
        if (not p.ignore_eos and t in eos) or len(out) == p.max_tokens:
            return out


def make(num_blocks=64, bs=4, max_num_seqs=8, max_batched=256, eos=(EOS,), caching=True):
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, max_batched, set(eos))


def seq(n_or_tokens, sched, **kw):
    toks = list(range(1, n_or_tokens + 1)) if isinstance(n_or_tokens, int) else n_or_tokens
    return Sequence(toks, SamplingParams(**kw), sched.block_manager.block_size)


def simulate(sched: Scheduler, prompts, params) -> list[list[int]]:
    """Run to completion. The fake model reads its context back from a simulated
    KV cache (one token id per slot), so wrong block tables, slot mappings or
    prefix hits show up as wrong outputs."""
    bm = sched.block_manager
    bs = bm.block_size
    cache: list[int | None] = [None] * (bm.num_blocks * bs)
    seqs = [Sequence(p, sp, bs) for p, sp in zip(prompts, params)]
    for s in seqs:
        sched.add(s)
    for _ in range(10_000):
        if sched.is_finished():
            break
        batch, prefill = sched.schedule()
        assert batch and len(batch) <= sched.max_num_seqs and len({s.seq_id for s in batch}) == len(batch)
        if prefill:
            assert sum(s.num_tokens - s.num_cached_tokens for s in batch) <= sched.max_num_batched_tokens
        for s in batch:  # store this step's KV for every sequence first (like store-then-attend)
            assert s.status == SequenceStatus.RUNNING and len(s.block_table) == s.num_blocks
            start = s.num_cached_tokens if prefill else s.num_tokens - 1
            for pos, slot in zip(range(start, s.num_tokens), slots(s.block_table, bs, start, s.num_tokens)):
                cache[slot] = s.token_ids[pos]
        out = []
        for s in batch:
            ctx = [cache[x] for x in slots(s.block_table, bs, 0, s.num_tokens)]
            assert ctx == s.token_ids
            out.append(fake_next(ctx))
        sched.postprocess(batch, out)
    else:
        raise AssertionError("did not finish")
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_count)
    assert all(s.is_finished for s in seqs)
    return [s.completion_token_ids for s in seqs]


def test_fifo_admission_max_num_seqs():
    sched = make(max_num_seqs=2)
    seqs = [seq(3, sched, max_tokens=4, ignore_eos=True) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    batch, prefill = sched.schedule()
    assert prefill and batch == seqs[:2]
    sched.postprocess(batch, [1, 1])
    batch, prefill = sched.schedule()  # running is full: decode, nothing admitted
    assert not prefill and batch == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_fifo_admission_token_budget():
    sched = make(max_batched=16)
    a, b, c, d = (seq([k] * n, sched, max_tokens=1) for k, n in ((1, 6), (2, 6), (3, 6), (4, 1)))
    for s in (a, b, c, d):
        sched.add(s)
    batch, prefill = sched.schedule()
    assert prefill and batch == [a, b]  # c would make 18 > 16; d must not overtake it
    assert list(sched.waiting) == [c, d]


@pytest.mark.parametrize("caching", [True, False])
def test_token_budget_counts_only_uncached_tokens(caching):
    sched = make(bs=4, max_batched=12, caching=caching)
    prefix = list(range(1, 9))
    a = seq(prefix + [20, 21], sched, max_tokens=2)
    b = seq(prefix + [30], sched, max_tokens=2)
    sched.add(a)
    sched.add(b)
    batch, _ = sched.schedule()
    if caching:  # 10 + (9 - 8 cached) <= 12
        assert batch == [a, b] and b.num_cached_tokens == 8
        assert b.block_table[:2] == a.block_table[:2]
    else:  # 10 + 9 > 12
        assert batch == [a] and list(sched.waiting) == [b]


def test_finish_on_eos_max_tokens_ignore_eos():
    sched = make()
    a = seq(3, sched, max_tokens=5)
    b = seq(3, sched, max_tokens=5, ignore_eos=True)
    c = seq(3, sched, max_tokens=2)
    for s in (a, b, c):
        sched.add(s)
    batch, _ = sched.schedule()
    assert sched.postprocess(batch, [7, EOS, 7]) == []
    assert a.num_completion_tokens == 1 and b.completion_token_ids == [EOS]
    batch, prefill = sched.schedule()
    assert not prefill and batch == [a, b, c]
    done = sched.postprocess(batch, [EOS, 5, 9])
    assert done == [a, c] and a.is_finished and c.is_finished and not b.is_finished
    assert a.block_table == [] and list(sched.running) == [b]
    for _ in range(3):
        batch, _ = sched.schedule()
        done = sched.postprocess(batch, [EOS])
    assert done == [b] and b.completion_token_ids == [EOS, 5, EOS, EOS, EOS] and sched.is_finished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_preempts_newest_and_resumes():
    sched = make(num_blocks=4, bs=2, caching=False)
    a = seq(4, sched, max_tokens=3, ignore_eos=True)
    b = seq([9, 8, 7, 6], sched, max_tokens=3, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    batch, prefill = sched.schedule()
    assert prefill and batch == [a, b] and sched.block_manager.num_free_blocks == 0
    sched.postprocess(batch, [11, 22])  # both now start a third block
    batch, prefill = sched.schedule()
    assert not prefill and batch == [a]
    assert sched.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and list(sched.waiting) == [b]
    assert b.completion_token_ids == [22]  # generated tokens are kept
    sched.postprocess(batch, [12])
    batch, _ = sched.schedule()
    sched.postprocess(batch, [13])
    assert a.is_finished
    batch, prefill = sched.schedule()  # b is recomputed over prompt + generated
    assert prefill and batch == [b] and b.num_tokens == 5
    sched.postprocess(batch, [23])
    batch, _ = sched.schedule()
    assert sched.postprocess(batch, [24]) == [b] and b.completion_token_ids == [22, 23, 24]


def test_preempted_go_to_front_oldest_first():
    sched = make(num_blocks=4, bs=2, caching=False)
    seqs = [seq([i + 1, i + 2], sched, max_tokens=5, ignore_eos=True) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.postprocess(sched.schedule()[0], [1, 1, 1])  # 3 blocks used, 3 tokens each
    batch, _ = sched.schedule()  # each needs a 2nd block, only 1 free
    assert batch == seqs[:2] and sched.num_preemptions == 1 and list(sched.waiting) == [seqs[2]]
    sched.postprocess(batch, [1, 1])
    batch, prefill = sched.schedule()  # seqs[2] cannot come back yet (needs 2 blocks, 0 free)
    assert not prefill and batch == seqs[:2]
    sched.postprocess(batch, [1, 1])  # 5 tokens: both need a 3rd block, 0 free
    batch, _ = sched.schedule()
    assert batch == seqs[:1] and sched.num_preemptions == 2
    assert list(sched.waiting) == [seqs[1], seqs[2]]  # front of the queue, older first


def test_add_rejects_impossible():
    sched = make(num_blocks=4, bs=4, max_batched=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(seq(33, sched, max_tokens=1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(seq(20, sched, max_tokens=14))  # 20 + 14 - 1 = 33
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(17, sched, max_tokens=1))  # 5 blocks > 4
    sched.check(seq(16, sched, max_tokens=1))  # check() alone does not queue
    assert not sched.waiting
    sched.add(seq(16, sched, max_tokens=1))  # exactly fits
    sched.add(seq(10, sched, max_tokens=7))  # 16 tokens at most in the engine
    assert len(sched.waiting) == 2


def workload(n, seed, shared_prefix=True):
    rng = random.Random(seed)
    base = [rng.randrange(1, V) for _ in range(12)]
    prompts, params = [], []
    for _ in range(n):
        pre = base[:rng.randrange(0, 12)] if shared_prefix else []
        prompts.append(pre + [rng.randrange(1, V) for _ in range(rng.randrange(1, 8))])
        params.append(SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=rng.random() < 0.5))
    return prompts, params


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_cache_matches_huge_cache(caching):
    prompts, params = workload(12, seed=1)
    expect = [reference(p, sp, {EOS}) for p, sp in zip(prompts, params)]
    big = make(num_blocks=1000, bs=4, max_num_seqs=16, caching=caching)
    assert simulate(big, prompts, params) == expect
    assert big.num_preemptions == 0
    need = max((len(p) + sp.max_tokens - 1 + 3) // 4 for p, sp in zip(prompts, params))
    tiny = make(num_blocks=need, bs=4, max_num_seqs=16, max_batched=32, caching=caching)
    assert simulate(tiny, prompts, params) == expect
    assert tiny.num_preemptions > 0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([1, 2, 4]), st.integers(0, 12),
       st.integers(1, 5), st.booleans())
def test_random_workloads_match_reference(seed, bs, extra_blocks, max_num_seqs, caching):
    prompts, params = workload(6, seed)
    need = max((len(p) + sp.max_tokens - 1 + bs - 1) // bs for p, sp in zip(prompts, params))
    sched = make(num_blocks=need + extra_blocks, bs=bs, max_num_seqs=max_num_seqs,
                 max_batched=32, caching=caching)
    expect = [reference(p, sp, {EOS}) for p, sp in zip(prompts, params)]
    assert simulate(sched, prompts, params) == expect
