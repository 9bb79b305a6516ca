"""Continuous-batching scheduler: prefill-first admission, recompute preemption."""
from collections import deque

from impl.block_manager import BlockManager
from impl.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides which sequences run in the next model step.

    Each step is either a prefill batch (newly admitted sequences; new tokens
    per sequence = num_tokens - num_cached_tokens, summed <= max_num_batched_tokens)
    or a decode batch (one token for every running sequence). At most
    max_num_seqs sequences are running at once. When the cache runs out during
    decode, the newest running sequence is preempted: its blocks are freed and
    it goes to the front of the waiting queue with its generated tokens kept,
    to be re-prefilled over prompt + generated tokens later (recompute).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: set[int]) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if `seq` could never be scheduled to completion.

        Its longest in-engine length is num_prompt_tokens + max_tokens - 1 (the
        final token is never fed back). A recompute prefill may cover all of
        it, so it must fit both max_num_batched_tokens and the whole cache.
        """
        bs = self.block_manager.block_size
        max_len = seq.num_prompt_tokens + seq.params.max_tokens - 1
        what = f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) - 1 = {max_len}"
        if max_len > self.max_num_batched_tokens:
            raise ValueError(f"{what} tokens exceeds max_num_batched_tokens={self.max_num_batched_tokens}")
        need = (max_len + bs - 1) // bs
        if need > self.block_manager.num_blocks:
            raise ValueError(f"{what} tokens needs {need} KV blocks of {bs} but the cache has only "
                             f"{self.block_manager.num_blocks}")

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (FIFO) after `check(seq)`."""
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (batch, is_prefill). Prefill wins whenever anything can be admitted."""
        bm = self.block_manager
        batch: list[Sequence] = []
        num_batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - bm.cached_prefix_len(seq)
            if num_batched + new_tokens > self.max_num_batched_tokens or not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            num_batched += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        if batch:
            return batch, True

        kept: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                kept.append(seq)
        self.running.extend(kept)
        assert kept or not self.waiting, "nothing schedulable; add() should have prevented this"
        return kept, False

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append one sampled token per sequence; finish on EOS (unless
        ignore_eos) or at max_tokens; free finished sequences' blocks at once."""
        finished: list[Sequence] = []
        for seq, tok in zip(seqs, token_ids, strict=True):
            seq.append_token(tok)
            if ((not seq.params.ignore_eos and tok in self.eos_token_ids)
                    or seq.num_completion_tokens >= seq.params.max_tokens):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished
