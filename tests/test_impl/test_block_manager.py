"""Block manager: slot mapping, ref counts, block-boundary appends, prefix caching."""
import pytest
from hypothesis import given, settings, strategies as st

from impl.block_manager import BlockManager, block_hash, slots
from impl.sampling_params import SamplingParams
from impl.sequence import Sequence


def mkseq(tokens, bs):
    return Sequence(list(tokens), SamplingParams(), bs)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    used = {b for s in live for b in s.block_table}
    assert len(set(bm.free)) == len(bm.free), "block freed twice"
    assert used.isdisjoint(bm.free)
    assert len(bm.free) + len(used) == bm.num_blocks, "leaked blocks"
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == sum(s.block_table.count(b) for s in live)
    for h, b in bm.hash_to_block.items():
        assert bm.hashes[b] == h
    for s in live:  # a hashed (possibly shared) block holds exactly this sequence's tokens
        for i, b in enumerate(s.block_table):
            assert bm.contents[b] is None or bm.contents[b] == tuple(s.block(i))


def test_slots_formula():
    assert slots([7, 2, 5], 4, 0, 12) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert slots([7, 2, 5], 4, 5, 9) == [9, 10, 11, 20]
    assert slots([3], 1, 0, 1) == [3]
    bm = BlockManager(8, 4)
    s = mkseq(range(6), 4)
    bm.allocate(s)
    assert bm.slot_mapping(s, 0, 6) == slots(s.block_table, 4, 0, 6)


def test_allocate_deallocate_refcounts():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    s = mkseq(range(9), 4)  # 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    assert all(bm.ref_count[b] == 1 for b in s.block_table)
    t = mkseq(range(100, 105), 4)  # 2 blocks, only 1 free
    assert not bm.can_allocate(t)
    with pytest.raises(RuntimeError):
        bm.allocate(t)
    assert bm.num_free_blocks == 1 and t.block_table == []
    with pytest.raises(RuntimeError):
        bm.allocate(s)  # already allocated
    bm.deallocate(s)
    assert s.block_table == [] and s.num_cached_tokens == 0
    assert bm.num_free_blocks == 4 and bm.ref_count == [0] * 4
    check_invariants(bm, [])


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_append_at_block_boundaries(bs):
    n = 3
    bm = BlockManager(n, bs)
    s = mkseq([1] * bs, bs)  # exactly one full block
    bm.allocate(s)
    for step in range(1, 2 * bs + 1):
        s.append_token(step)
        starts_block = (s.num_tokens - 1) % bs == 0
        free_before = bm.num_free_blocks
        assert bm.can_append(s)
        bm.may_append(s)
        assert bm.num_free_blocks == free_before - starts_block
        assert len(s.block_table) == s.num_blocks
        check_invariants(bm, [s])
    assert bm.num_free_blocks == 0
    s.append_token(0)  # starts block 4 of 3
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError):
        bm.may_append(s)


def test_prefix_cache_hit_shares_blocks():
    bs = 4
    bm = BlockManager(16, bs)
    prefix = list(range(2 * bs))
    a = mkseq(prefix + [100, 101], bs)
    b = mkseq(prefix + [200], bs)
    bm.allocate(a)
    bm.allocate(b)
    assert a.num_cached_tokens == 0
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert all(bm.ref_count[x] == 2 for x in a.block_table[:2])
    assert b.num_cached_tokens == 2 * bs
    check_invariants(bm, [a, b])
    bm.deallocate(a)
    assert all(bm.ref_count[x] == 1 for x in b.block_table[:2])
    check_invariants(bm, [b])
    # a different second block breaks the chain from that block on
    c = mkseq(prefix[:bs] + [9] * bs + [1], bs)
    bm.allocate(c)
    assert c.block_table[0] == b.block_table[0] and c.block_table[1] != b.block_table[1]
    assert c.num_cached_tokens == bs
    check_invariants(bm, [b, c])


def test_never_fully_cached():
    bs = 4
    bm = BlockManager(16, bs)
    a = mkseq(range(2 * bs), bs)
    bm.allocate(a)
    b = mkseq(range(2 * bs), bs)  # identical, block-aligned
    bm.allocate(b)
    assert b.num_cached_tokens == bs < b.num_tokens
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = mkseq(range(2 * bs + 1), bs)  # last token alone in block 2: both full blocks hit
    bm.allocate(c)
    assert c.num_cached_tokens == 2 * bs
    d = mkseq([5], bs)
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    check_invariants(bm, [a, b, c, d])


def test_freed_cached_block_is_reused():
    bs = 4
    bm = BlockManager(8, bs)
    a = mkseq(range(2 * bs + 2), bs)
    bm.allocate(a)
    old = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 8
    b = mkseq(list(range(2 * bs)) + [77], bs)
    assert bm.cached_prefix_len(b) == 2 * bs
    bm.allocate(b)
    assert b.block_table[:2] == old[:2] and b.num_cached_tokens == 2 * bs
    check_invariants(bm, [b])


def test_evicted_block_no_longer_hits():
    bs = 2
    bm = BlockManager(3, bs)
    a = mkseq([1, 2, 3], bs)
    bm.allocate(a)
    bm.deallocate(a)
    filler = mkseq([9] * 6, bs)  # takes all 3 blocks, overwriting a's
    bm.allocate(filler)
    bm.deallocate(filler)
    b = mkseq([1, 2, 3], bs)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    check_invariants(bm, [b])


def test_decode_filled_block_is_registered():
    bs = 4
    bm = BlockManager(8, bs)
    a = mkseq([1, 2, 3], bs)
    bm.allocate(a)
    a.append_token(4)
    bm.may_append(a)  # block 0 now full -> hashed
    assert bm.hash_to_block[block_hash(None, [1, 2, 3, 4])] == a.block_table[0]
    b = mkseq([1, 2, 3, 4, 5], bs)
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == bs


def test_block_hash_is_chained():
    h0 = block_hash(None, [1, 2])
    assert block_hash(h0, [3, 4]) != block_hash(None, [3, 4])
    assert block_hash(h0, [3, 4]) == block_hash(block_hash(None, [1, 2]), [3, 4])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.booleans(),
       st.lists(st.tuples(st.sampled_from(["alloc", "append", "append", "free"]),
                          st.integers(0, 10**6)), max_size=60))
def test_random_ops_never_leak(bs, num_blocks, caching, ops):
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for op, r in ops:
        if op == "alloc" or (op == "append" and not live):
            n = 1 + r % (2 * bs + 3)
            s = mkseq([(r >> k) % 2 for k in range(n)], bs)  # small alphabet -> many hits
            if bm.can_allocate(s):
                bm.allocate(s)
                assert len(s.block_table) == s.num_blocks and s.num_cached_tokens < s.num_tokens
                live.append(s)
            else:
                with pytest.raises(RuntimeError):
                    bm.allocate(s)
        elif op == "append":
            s = live[r % len(live)]
            s.append_token(r % 2)
            if bm.can_append(s):
                bm.may_append(s)
            else:
                bm.deallocate(s)
                live.remove(s)
        elif live:
            s = live.pop(r % len(live))
            bm.deallocate(s)
        check_invariants(bm, live)
    for s in live:
        bm.deallocate(s)
    check_invariants(bm, [])


def test_sequence_properties_and_pickle():
    import pickle
    s = mkseq([5, 6, 7, 8, 9], 4)
    assert (s.num_tokens, s.num_blocks, s.last_block_num_tokens) == (5, 2, 1)
    assert s.block(0) == [5, 6, 7, 8] and s.block(1) == [9]
    s.append_token(1)
    s.append_token(2)
    s.append_token(3)
    assert (s.num_blocks, s.last_block_num_tokens, s.last_token) == (2, 4, 3)
    assert s.prompt_token_ids == [5, 6, 7, 8, 9] and s.completion_token_ids == [1, 2, 3]
    assert s.num_completion_tokens == 3 and len(s) == 8
    assert mkseq([1], 4).seq_id != s.seq_id
    t = pickle.loads(pickle.dumps(s))
    assert t.token_ids == s.token_ids and t.seq_id == s.seq_id and t.params == s.params
    assert len(pickle.dumps(s)) < 600
