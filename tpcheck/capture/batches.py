"""What one engine step ran: its requests in row order, each with the tokens it consumed and their positions.

A serving engine batches continuously: a request joins at any step, leaves when done, has its prompt prefilled
over several steps (chunked prefill) or is preempted and recomputed from an earlier position. A step's rows are
its requests' rows concatenated in the batch's order, and that order is all a point's rows need: the golden runs
each request as a batch of one with its own cache (``tpcheck.reference.hf.HFCapture.step``), at the positions the
engine ran it, whatever step that was. ``StepBatch`` is one step; ``RequestLog`` follows the requests over the
steps and says, per step, where each request's golden cache must be cut (``advance``). A point may hold only some
of the step's rows (vLLM's ``logits``: the rows it samples): ``StepBatch.rows`` names them by flat row index.

Pure Python (no torch): the dump (``tpcheck.capture.dump``, format 2) and the step loop
(``tpcheck.pipeline.steps``) share it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBatch:
    """One step: ``ids[i]`` consumed ``tokens[i]`` at positions ``starts[i]..``; rows in that order. ``rows``:
    ``{point: the step's flat row indices it holds}`` for the points that hold only some rows."""

    ids: list[str]
    tokens: list[list[int]]
    starts: list[int]
    rows: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        if not (len(self.ids) == len(self.tokens) == len(self.starts)):
            raise ValueError(f"a step of {len(self.ids)} request ids, {len(self.tokens)} token lists and "
                             f"{len(self.starts)} starts")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"a request appears twice in one step: {self.ids}")

    @classmethod
    def of_prompts(cls, prompts: list[list[int]]) -> "StepBatch":
        """The first step of a fixed batch: prompt ``i`` is request ``"i"``, from position 0."""
        return cls([str(i) for i in range(len(prompts))], [list(p) for p in prompts], [0] * len(prompts))

    def then(self, tokens: list[list[int]]) -> "StepBatch":
        """The next step of the same requests, each consuming ``tokens[i]`` after this step's."""
        return StepBatch(list(self.ids), tokens, self.kv_lens)

    @property
    def row_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def kv_lens(self) -> list[int]:
        """Each request's cached positions after this step."""
        return [s + len(t) for s, t in zip(self.starts, self.tokens)]

    def last_rows(self) -> list[int]:
        """The flat index of each request's last row."""
        out, n = [], 0
        for t in self.tokens:
            n += len(t)
            out.append(n - 1)
        return out


class RequestLog:
    """Every request's tokens so far, over the steps: checks a step continues each request where it was (or
    restarts it at an earlier position: a preemption's recompute) with the same tokens at positions seen."""

    def __init__(self):
        self.seen: dict[str, list[int]] = {}
        self.order: dict[str, int] = {}  # request id -> the order it first appeared in (a row's "prompt")

    def advance(self, batch: StepBatch) -> list[int | None]:
        """Record ``batch``; per request, None when it continues where it was, else the position its caches
        must be cut back to (0: a new request, or recomputed from the start). A request that skips positions
        it never ran, or that runs a position again with another token, is a ValueError naming it."""
        cuts: list[int | None] = []
        for rid, toks, start in zip(batch.ids, batch.tokens, batch.starts):
            have = self.seen.get(rid)
            if have is None:
                self.order[rid] = len(self.order)
                have = self.seen[rid] = []
            if start > len(have):
                raise ValueError(f"request {rid!r} runs positions {start}..{start + len(toks) - 1} but only "
                                 f"{len(have)} before them were run (a prefix cache hit? run the engine without "
                                 "prefix caching)")
            again = have[start:start + len(toks)]
            if again != toks[:len(again)]:
                raise ValueError(f"request {rid!r} runs positions {start}.. again with tokens {toks[:len(again)]}, "
                                 f"earlier {again}")
            cuts.append(None if start == len(have) else start)
            self.seen[rid] = have[:start] + list(toks)
        return cuts
