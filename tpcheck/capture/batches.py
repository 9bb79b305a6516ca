"""What one engine step ran: its requests in row order, each with the tokens it consumed and their positions.

A serving engine batches continuously: a request joins at any step, leaves when done, has its prompt prefilled
over several steps (chunked prefill) or is preempted and recomputed from an earlier position. A step's rows are
its requests' rows concatenated in the batch's order, and that order is all a point's rows need: the golden runs
each request as a batch of one with its own cache (``tpcheck.reference.hf.HFCapture.step``), at the positions the
engine ran it, whatever step that was. ``StepBatch`` is one step; ``RequestLog`` follows the requests over the
steps and says, per step, where each request's golden cache must be cut (``advance``). A point may hold only some
of the step's rows (vLLM's ``logits``: the rows it samples): ``StepBatch.rows`` names them by flat row index.

A prefix-cache hit: a request's first step starts past position 0, its first blocks computed by another request
(or by a parallel-sampling sibling in the same step). The engine produced no rows for those positions, but the
golden's cache of the request needs them: ``StepBatch.prompts`` records the token ids the engine knew of each
request when it first scheduled it (its prompt), and ``RequestLog.advance`` names the positions to run first
without comparing them (``RequestLog.gaps``). A skip whose tokens are unknown is refused (``UnknownPrefix``).

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
    prompts: dict[str, list[int]] = field(default_factory=dict)  # request id -> its tokens from position 0

    def __post_init__(self):
        if not (len(self.ids) == len(self.tokens) == len(self.starts)):
            raise ValueError(f"a step of {len(self.ids)} request ids, {len(self.tokens)} token lists and "
                             f"{len(self.starts)} starts")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"a request appears twice in one step: {self.ids}")
        if not set(self.prompts) <= set(self.ids):
            raise ValueError(f"prompts recorded for requests not in the step: {sorted(set(self.prompts) - set(self.ids))}")

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


class UnknownPrefix(ValueError):
    """A request runs past positions it never ran and whose tokens nothing records: a prefix-cache hit the dump
    cannot rebuild."""


class RequestLog:
    """Every request's tokens so far, over the steps: checks a step continues each request where it was (or
    restarts it at an earlier position: a preemption's recompute) with the same tokens at positions seen, or
    starts it past positions another request computed (a prefix-cache hit) whose tokens the step records."""

    def __init__(self):
        self.seen: dict[str, list[int]] = {}
        self.order: dict[str, int] = {}  # request id -> the order it first appeared in (a row's "prompt")
        self.gaps: dict[str, tuple[int, list[int]]] = {}  # the last step's: request id -> (position, tokens) to run first

    def advance(self, batch: StepBatch) -> list[int | None]:
        """Record ``batch``; per request, None when it continues where it was, else the position its caches
        must be cut back to (0: a new request, or recomputed from the start). A request that starts past the
        positions it ran, on tokens ``batch.prompts`` records (a prefix-cache hit), gets those positions in
        ``gaps`` (its caches must run them first; the engine produced no rows for them). One that skips
        positions whose tokens are unknown is an ``UnknownPrefix``, one that runs a position again with
        another token a ValueError, each naming the request."""
        cuts: list[int | None] = []
        self.gaps = {}
        for rid, toks, start in zip(batch.ids, batch.tokens, batch.starts):
            have = self.seen.get(rid)
            if have is None:
                self.order[rid] = len(self.order)
                have = self.seen[rid] = []
            if start > len(have):
                have = self._gap(rid, have, start, toks, batch.prompts.get(rid))
            again = have[start:start + len(toks)]
            if again != toks[:len(again)]:
                raise ValueError(f"request {rid!r} runs positions {start}.. again with tokens {toks[:len(again)]}, "
                                 f"earlier {again}")
            cuts.append(None if start == len(have) else start)
            self.seen[rid] = have[:start] + list(toks)
        return cuts

    def _gap(self, rid: str, have: list[int], start: int, toks: list[int], prompt: list[int] | None) -> list[int]:
        """Positions ``len(have)..start-1`` of ``rid`` from its recorded ``prompt``: the request's tokens with the
        gap filled (recorded in ``gaps``), or an ``UnknownPrefix``."""
        where = f"request {rid!r} runs positions {start}..{start + len(toks) - 1} but only {len(have)} before them " \
                "were run"
        if prompt is None or len(prompt) < start:
            known = "no prompt tokens" if prompt is None else f"only {len(prompt)} prompt tokens"
            raise UnknownPrefix(f"{where}, and the step records {known} for them: a prefix-cache hit the dump "
                                "cannot rebuild (dump with a tpcheck that records the prompts, or run the engine "
                                "without prefix caching)")
        if prompt[:len(have)] != have:
            raise ValueError(f"{where}; its recorded prompt {prompt[:len(have)]} differs from the tokens it ran {have}")
        if prompt[start:start + len(toks)] != toks[:len(prompt) - start]:
            raise ValueError(f"{where}; it runs {toks} there, its recorded prompt has {prompt[start:start + len(toks)]}")
        self.gaps[rid] = (len(have), list(prompt[len(have):start]))
        return list(prompt[:start])
