"""The schedules of ``tpcheck invariance``: one probe request, the same tokens every time, run through an engine
beside other requests or alone, whole or in chunks, on its own KV blocks or on another request's (a prefix-cache
hit), at one TP size or another. A schedule is data: the requests, and for every engine step which of them run and
how many new tokens each feeds; ``tpcheck.pipeline.invariance`` drives an adapter through it.

Every request carries all its tokens: the prompt, then the tokens its decode steps feed. They are fixed (drawn
from the seed, never the engine's own samples), so two schedules feed the probe the same inputs at every step even
after their bits part, and the comparison goes on past the first difference to say how it grows."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """``tokens``: the prompt (its first ``prompt_len``), then one token per decode step."""

    tokens: tuple[int, ...]
    prompt_len: int

    @property
    def decode_steps(self) -> int:
        return len(self.tokens) - self.prompt_len

    def step_of(self, position: int) -> int:
        """The probe's step that computes ``position``: 0 (the prefill) for a prompt position, ``k`` for the
        position decode step ``k`` feeds (``prompt_len + k - 1``)."""
        return 0 if position < self.prompt_len else position - self.prompt_len + 1


@dataclass(frozen=True)
class Schedule:
    """``steps[s]``: engine step ``s`` as ``(request, new tokens)`` pairs in batch order (slot order);
    ``shares``: ``(before step, request, donor, tokens)``: before that step the request's first ``tokens``
    positions become the donor's KV blocks (a prefix-cache hit, ``ImplAdapter.share_prefix``)."""

    name: str
    tp: int
    requests: tuple[Request, ...]
    probe: int
    steps: tuple[tuple[tuple[int, int], ...], ...]
    shares: tuple[tuple[int, int, int, int], ...] = ()

    def describe(self) -> str:
        sizes = [len(s) for s in self.steps]
        slot = next((i for i, (r, _) in enumerate(self.steps[0]) if r == self.probe), None) if self.steps else None
        return (f"{self.name}: tp {self.tp}, {len(self.requests)} request(s), {len(self.steps)} engine steps of "
                f"{min(sizes)}-{max(sizes)} sequences" + (f", probe at slot {slot}" if slot is not None else ""))


def draw_requests(vocab: int, prompt_len: int, decode_steps: int, companions: int, seed: int
                  ) -> tuple[Request, list[Request]]:
    """The probe (``prompt_len`` tokens, ``decode_steps`` decodes) and ``companions`` other requests from
    ``random.Random(seed)``: prompts of other lengths (1 to twice the probe's), each decoding 0 to ``decode_steps``
    steps (so the decode batch shrinks as they finish). The same seed gives the same probe whatever ``companions``."""
    rng = random.Random(seed)
    probe = Request(tuple(rng.randrange(vocab) for _ in range(prompt_len + decode_steps)), prompt_len)
    others = []
    crng = random.Random(seed + 1)
    for _ in range(companions):
        n = crng.randint(1, 2 * prompt_len)
        d = crng.randint(0, decode_steps)
        others.append(Request(tuple(crng.randrange(vocab) for _ in range(n + d)), n))
    return probe, others


def batched(name: str, tp: int, probe: Request, companions: list[Request], slot: int) -> Schedule:
    """Every request prefilled in one step, the probe at batch slot ``slot``, then decode steps of every request
    with decodes left (the probe's slot moves down as companions before it finish)."""
    if not 0 <= slot <= len(companions):
        raise ValueError(f"probe slot {slot} is outside a batch of {len(companions) + 1}")
    reqs = tuple(companions[:slot]) + (probe,) + tuple(companions[slot:])
    steps = [tuple((i, r.prompt_len) for i, r in enumerate(reqs))]
    for k in range(1, probe.decode_steps + 1):
        steps.append(tuple((i, 1) for i, r in enumerate(reqs) if r.decode_steps >= k))
    return Schedule(name, tp, reqs, slot, tuple(steps))


def chunked(name: str, tp: int, probe: Request, chunk: int) -> Schedule:
    """The probe alone, its prompt fed ``chunk`` tokens a step (chunked prefill), then its decode steps."""
    if chunk < 1:
        raise ValueError(f"--chunk must be >= 1 tokens, got {chunk}")
    steps = [((0, min(chunk, probe.prompt_len - s)),) for s in range(0, probe.prompt_len, chunk)]
    steps += [((0, 1),)] * probe.decode_steps
    return Schedule(name, tp, (probe,), 0, tuple(steps))


def prefix_hit(name: str, tp: int, probe: Request, block_size: int, seed: int, vocab: int) -> Schedule:
    """A prefix-cache hit: a donor request (the probe's first whole KV blocks, then other tokens) is prefilled
    first; the probe then starts on the donor's blocks and prefills only the rest of its prompt (at least one
    token, as impl's scheduler leaves it), then decodes."""
    shared = (probe.prompt_len - 1) // block_size * block_size
    if shared == 0:
        raise ValueError(f"--prefix-cache: the probe's prompt ({probe.prompt_len} tokens) must be longer than one KV "
                         f"block ({block_size}) to share one")
    rng = random.Random(seed + 2)
    tokens = probe.tokens[:shared] + tuple(rng.randrange(vocab) for _ in range(rng.randint(1, block_size)))
    donor = Request(tokens, len(tokens))
    steps = [((0, donor.prompt_len),), ((1, probe.prompt_len - shared),)] + [((1, 1),)] * probe.decode_steps
    return Schedule(name, tp, (donor, probe), 1, tuple(steps), shares=((1, 1, 0, shared),))


def alone(tp: int, probe: Request) -> Schedule:
    """The probe alone at ``tp``: the reference every other schedule is compared with."""
    return batched(f"tp{tp}-batch1", tp, probe, [], 0)
