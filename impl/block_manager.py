"""Paged KV-cache block allocation with hash-chained prefix caching."""
import hashlib
from collections import deque

from impl.sequence import Sequence


def slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """KV-cache slots of token positions [start, end).

    slot(pos) = block_table[pos // block_size] * block_size + pos % block_size
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def block_hash(prev: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of a full block: h_i = sha256(h_{i-1} || int64-LE(tokens of block i)).

    h_{-1} is the empty string, so h_i identifies the whole prefix up to block i
    and is stable across processes (unlike Python's salted hash()).
    """
    m = hashlib.sha256(prev or b"")
    for t in token_ids:
        m.update(t.to_bytes(8, "little", signed=True))
    return m.digest()


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens each.

    Each block has a ref count (number of sequences using it). A full block
    also remembers its chained hash and token ids; `hash_to_block` maps the
    hash to the block holding that prefix. Freed blocks keep hash and contents
    and go to the back of the free list, so an identical prefix can still hit
    them until they are popped from the front for reuse (LRU eviction).
    A hit may be on a block another sequence of the same prefill batch is
    filling in that very step: the runner must store a layer's KV before attending.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count: list[int] = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.contents: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        return slots(seq.block_table, self.block_size, start, end)

    def _match(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix of `seq`, without side effects.

        Only full blocks strictly before the block holding the last token may
        hit, so the model always recomputes at least the last token.
        """
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        h = None
        for i in range(seq.num_blocks - 1):
            tokens = seq.block(i)
            h = block_hash(h, tokens)
            b = self.hash_to_block.get(h)
            if b is None or self.contents[b] != tuple(tokens):
                break
            hits.append(b)
        return hits

    def _take(self, block_id: int | None = None) -> int:
        """Pop a free block (the oldest, or `block_id`), forgetting its old hash."""
        if block_id is None:
            block_id = self.free.popleft()
            h = self.hashes[block_id]
            if h is not None and self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.hashes[block_id] = self.contents[block_id] = None
        else:
            self.free.remove(block_id)
        self.ref_count[block_id] = 1
        return block_id

    def _register(self, block_id: int, prev: bytes | None, tokens: list[int]) -> bytes:
        h = block_hash(prev, tokens)
        self.hashes[block_id], self.contents[block_id] = h, tuple(tokens)
        self.hash_to_block[h] = block_id
        return h

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens `allocate(seq)` would find in the cache (a multiple of block_size)."""
        return len(self._match(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Hits on in-use blocks need no free block; every other block takes one."""
        shared = sum(1 for b in self._match(seq) if self.ref_count[b] > 0)
        return len(self.free) >= seq.num_blocks - shared

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise RuntimeError(f"{seq} already has blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free blocks for {seq}: {len(self.free)} free")
        hits = self._match(seq)
        h = None
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            if i < len(hits):
                b = hits[i]
                h = self.hashes[b]
                if self.ref_count[b] > 0:
                    self.ref_count[b] += 1
                else:
                    self._take(b)
            else:
                b = self._take()
                if self.enable_prefix_caching and len(tokens) == self.block_size:
                    h = self._register(b, h, tokens)
            seq.block_table.append(b)
        seq.num_cached_tokens = len(hits) * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        """Drop one reference per block; blocks reaching 0 are freed, tail first
        (so a sequence's later blocks are evicted before its shared prefix)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"double free of block {b}"
            if self.ref_count[b] == 0:
                self.free.append(b)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Call after appending a token: it needs a new block iff it starts one,
        i.e. (num_tokens - 1) % block_size == 0 (always for block_size 1)."""
        return len(self.free) >= (len(seq.block_table) < seq.num_blocks)

    def may_append(self, seq: Sequence) -> None:
        """Give `seq` a block for its last token if needed; register the last
        block's hash once it is full."""
        if len(seq.block_table) < seq.num_blocks:
            if not self.free:
                raise RuntimeError(f"no free block to append to {seq}")
            seq.block_table.append(self._take())
        assert len(seq.block_table) == seq.num_blocks
        if self.enable_prefix_caching and seq.num_tokens % self.block_size == 0:
            prev = self.hashes[seq.block_table[-2]] if seq.num_blocks > 1 else None
            self._register(seq.block_table[-1], prev, seq.block(seq.num_blocks - 1))
