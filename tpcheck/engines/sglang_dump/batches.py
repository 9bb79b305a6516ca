"""A continuously batched step's requests, from the auxiliary values SGLang's dumper writes every step.

SGLang's non-intrusive dumper (``DUMPER_NON_INTRUSIVE_MODE=core``, the default, or ``all``) dumps the model's
``ForwardBatch`` each step: ``input_ids`` and ``positions`` (one per token, the requests' tokens concatenated in
batch order), ``seq_lens`` (one per request: its length once the step has run, cached prefix included),
``req_pool_indices`` (its slot in the request pool) and ``rids`` (the request ids, where the batch has them).
A request's tokens in the step are therefore the next ``seq_lens[i] - positions[first]`` tokens, at consecutive
positions ending at ``seq_lens[i] - 1``: that is checked, not assumed. Requests are followed over the steps by
``rids``; without them by ``req_pool_indices`` (a slot keeps its request until it finishes; a slot whose request
starts again at position 0 holds a new one); without either, by their positions (``RequestIds.by_position``).
The result is tpcheck's ``StepBatch`` per step
(``tpcheck.capture.batches``): requests joining and leaving at any step, chunked prefill and recompute are then
replayed by the golden as for tpcheck's own dumps."""
from __future__ import annotations

import torch

from tpcheck.capture.batches import StepBatch
from tpcheck.capture.dump_format import DumpError

AUX_NAMES = ("input_ids", "positions", "seq_lens", "req_pool_indices", "rids")
REQUIRED = ("input_ids", "positions", "seq_lens")


class RequestIds:
    """Request ids over the steps: ``rids`` where dumped, else one id per request-pool slot and generation, else
    (SGLang's older forward-hook dumps record neither) by position: see ``by_position``."""

    def __init__(self):
        self.slot_ids: dict[int, str] = {}
        self.generation = 0
        self.length: dict[str, int] = {}  # by position: each request's tokens so far
        self.seen: dict[str, tuple[int, int]] = {}  # by position: (-last step it ran in, its row in that step)

    def ids(self, rids, slots: list[int] | None, starts: list[int], ends: list[int], step: int,
            where: str) -> list[str]:
        n = len(starts)
        if rids is not None:
            if len(rids) != n:
                raise DumpError(f"{where}: {len(rids)} rids for {n} requests (seq_lens)")
            return [str(r) for r in rids]
        if slots is None:
            return self.by_position(starts, ends, step, where)
        if len(slots) != n:
            raise DumpError(f"{where}: {len(slots)} req_pool_indices for {n} requests (seq_lens)")
        out = []
        for slot, start in zip(slots, starts):
            if slot not in self.slot_ids or start == 0:  # a new request in this slot (or one recomputed from 0)
                self.generation += 1
                self.slot_ids[slot] = f"slot{slot}.{self.generation}"
            out.append(self.slot_ids[slot])
        return out

    def by_position(self, starts: list[int], ends: list[int], step: int, where: str) -> list[str]:
        """Requests followed by their positions alone: one starting at 0 is new; one continuing at position p is
        one of the earlier requests with p tokens so far, the most recently run first (a finished request stops
        running), those of one step in their batch order (SGLang keeps a running batch's order). Where that
        does not decide (a request that finished and one that goes on, both last run in the same step with the
        same length), and where no earlier request has p tokens (a prefix-cache hit, or passes missing), a
        DumpError: guessing would give the golden another request's tokens."""
        out: list[str | None] = [None] * len(starts)
        claimed: set[str] = set()
        for p in sorted({s for s in starts if s > 0}):
            group = [i for i, s in enumerate(starts) if s == p]
            cands = sorted((r for r, n in self.length.items() if n == p and r not in claimed), key=self.seen.get)
            if len(cands) < len(group):
                raise DumpError(f"{where}: {len(group)} request(s) continue at position {p}, but {len(cands)} earlier "
                                f"request(s) have {p} tokens: a prefix-cache hit (run SGLang with "
                                "--disable-radix-cache), or passes are missing")
            if len(cands) > len(group) and self.seen[cands[len(group) - 1]][0] == self.seen[cands[len(group)]][0]:
                raise DumpError(f"{where}: requests at position {p} cannot be told apart by their positions (of "
                                f"{len(cands)} with {p} tokens, last run in one step, {len(group)} go on): dump "
                                "with SGLang's dumper (DUMPER_ENABLE=1), which records request ids")
            for i, r in zip(group, cands):
                out[i] = r
                claimed.add(r)
        for i, s in enumerate(starts):
            if s == 0:
                self.generation += 1
                out[i] = f"req{self.generation}"
        for i, r in enumerate(out):
            self.length[r], self.seen[r] = ends[i], (-step, i)
        return out


def _ints(v, name: str, where: str) -> list[int]:
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.is_floating_point() or v.is_complex():
        shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise DumpError(f"{where}: {name} must be a 1-D integer tensor, got {shape}")
    return [int(x) for x in v.tolist()]


def step_batch(aux: dict[str, tuple[object, str]], ids: RequestIds, step: int) -> StepBatch:
    """The ``StepBatch`` of one step from its auxiliary values ``{name: (value, file)}``; a missing value, or
    tokens, positions and lengths that do not fit together, is a DumpError naming the file."""
    missing = [n for n in REQUIRED if n not in aux]
    if missing:
        raise DumpError(f"step {step}: no {missing} dumped (files {sorted(w for _, w in aux.values())[:3]}): the "
                        "requests of a step come from SGLang's auxiliary dumps (non-intrusive mode core or all)")
    where = aux["seq_lens"][1]
    toks = _ints(aux["input_ids"][0], "input_ids", aux["input_ids"][1])
    pos = _ints(aux["positions"][0], "positions", aux["positions"][1])
    lens = _ints(aux["seq_lens"][0], "seq_lens", where)
    if len(toks) != len(pos):
        raise DumpError(f"{aux['positions'][1]}: {len(pos)} positions for {len(toks)} input_ids")
    tokens, starts, off = [], [], 0
    for i, end in enumerate(lens):
        if off >= len(pos):
            raise DumpError(f"{where}: request {i} (seq_len {end}) has no tokens left in input_ids ({len(toks)})")
        start = pos[off]
        n = end - start
        if n < 1 or pos[off:off + n] != list(range(start, end)):
            raise DumpError(f"{where}: request {i}: positions {pos[off:off + max(n, 1)][:8]} do not run from "
                            f"{start} to its seq_len {end} - 1")
        tokens.append(toks[off:off + n])
        starts.append(start)
        off += n
    if off != len(toks):
        raise DumpError(f"{where}: the requests' seq_lens cover {off} of the step's {len(toks)} tokens")
    rids = aux["rids"][0] if "rids" in aux else None
    slots = _ints(aux["req_pool_indices"][0], "req_pool_indices", aux["req_pool_indices"][1]) \
        if "req_pool_indices" in aux else None
    return StepBatch(ids.ids(rids, slots, starts, lens, step, where), tokens, starts)


def last_rows(batch: StepBatch) -> list[int]:
    """The flat row index of each request's last token in the step: the rows SGLang samples (its logits)."""
    ends, total = [], 0
    for t in batch.tokens:
        total += len(t)
        ends.append(total - 1)
    return ends
