"""``tpcheck invariance``: one probe request through the same engine under several schedules
(``tpcheck.pipeline.schedules``), every point of the probe captured as ``tpcheck diff`` captures it (the plan
resolved by ``RunPlan``, the adapter started from the engine registry on the pool, its ``step`` points unsharded by
``tpcheck.measure.unshard``), then each schedule compared with the first bit for bit
(``tpcheck.result.invariance``).

    from tpcheck.pipeline.invariance import InvarianceOptions, run
    r = run(InvarianceOptions(DiffOptions(preset="tiny", dtype="float32"), batches=(1, 8), decode_steps=4))
    print(r.summary())
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tpcheck.capture.points import kind_of
from tpcheck.engines.pool import EnginePool
from tpcheck.measure.unshard import unshard
from tpcheck.options import DiffOptions
from tpcheck.pipeline.plan import RunPlan
from tpcheck.pipeline.schedules import Schedule, alone, batched, chunked, draw_requests, prefix_hit
from tpcheck.result.invariance import Capture, InvarianceResult, compare_captures

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr


@dataclass(frozen=True)
class InvarianceOptions:
    """One ``tpcheck invariance`` run. ``engine``: the engine's side as a diff has it (``model`` / ``preset``,
    ``dtype``, ``inject``, ``inject_layer``, ``block_size``, ``points``, ``layers``; its ``tp`` is ignored:
    ``tps``). The schedules: the probe alone or beside ``b - 1`` companions for each ``b`` of ``batches`` (at
    ``slot``, None: the middle), at each TP size of ``tps``; ``prefix_cache``: also a prefix-cache hit; ``chunks``:
    also chunked prefills of these sizes (both at the first TP size). The first schedule is the reference.
    ``ulps``: the declared invariance (0 bitwise, N ulps; None reports only). ``batch_invariant``: impl's mode."""

    engine: DiffOptions
    tps: tuple[int, ...] = (1,)
    batches: tuple[int, ...] = (1,)
    slot: int | None = None
    prefix_cache: bool = False
    chunks: tuple[int, ...] = ()
    prompt_len: int = 20
    decode_steps: int = 4
    seed: int = 0
    batch_invariant: bool = False
    ulps: float | None = None

    def check(self) -> None:
        """Refuse (ValueError naming the flag) what cannot run, before any engine starts."""
        for flag, vals in (("--tp", self.tps), ("--batch", self.batches), ("--chunk", self.chunks)):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{flag} takes sizes >= 1, got {list(vals)}")
        if self.prompt_len < 1 or self.decode_steps < 0:
            raise ValueError(f"--prompt-len must be >= 1 and --decode-steps >= 0, got {self.prompt_len}, "
                             f"{self.decode_steps}")
        if self.ulps is not None and not self.ulps >= 0:
            raise ValueError(f"--ulps must be >= 0, got {self.ulps}")
        if self.slot is not None and not 0 <= self.slot < max(self.batches):
            raise ValueError(f"--slot {self.slot} is outside the largest batch ({max(self.batches)})")
        if self.engine.engine != "impl":
            raise ValueError(f"tpcheck invariance drives impl's scheduler-free steps; --engine {self.engine.engine} "
                             "is compared through its dumps (tpcheck invariance --dumps A B)")
        if len(self.schedule_names()) < 2:
            raise ValueError("one schedule only: give two or more (--batch 1,8, --tp 1,2, --prefix-cache, --chunk N)")

    def schedule_names(self) -> list[str]:
        names = [f"tp{t}-batch{b}" for t in self.tps for b in self.batches]
        return names + (["prefix-hit"] if self.prefix_cache else []) + [f"chunk{c}" for c in self.chunks]


def schedules(o: InvarianceOptions, vocab: int) -> list[Schedule]:
    """The run's schedules, the reference first: each TP size x batch size, then the prefix hit and the chunks."""
    biggest = max(o.batches)
    probe, companions = draw_requests(vocab, o.prompt_len, o.decode_steps, biggest - 1, o.seed)
    out = []
    for t in o.tps:
        for b in o.batches:
            slot = (b - 1) // 2 if o.slot is None else min(o.slot, b - 1)
            out.append(alone(t, probe) if b == 1 else batched(f"tp{t}-batch{b}", t, probe, companions[:b - 1], slot))
    if o.prefix_cache:
        out.append(prefix_hit("prefix-hit", o.tps[0], probe, o.engine.block_size, o.seed, vocab))
    out += [chunked(f"chunk{c}", o.tps[0], probe, c) for c in o.chunks]
    return out


def capture(adapter, s: Schedule, batch_invariant: bool = False) -> Capture:
    """Run schedule ``s`` through ``adapter`` (an ``ImplAdapter``: sequences given no tokens sit a step out,
    ``share_prefix`` makes the prefix hits) and keep the probe's rows of every point: ``{(probe step, point):
    tensor}``, a prefill run in chunks joined into step 0, a cache point as read back after its step's last chunk."""
    reqs, probe = s.requests, s.requests[s.probe]
    adapter.begin([list(r.tokens[:r.prompt_len]) for r in reqs], max(r.decode_steps for r in reqs))
    try:
        if batch_invariant:
            adapter.set_batch_invariant(True)
        fed = [0] * len(reqs)
        rows: dict[tuple[int, str], list] = {}
        for i, step in enumerate(s.steps):
            for before, seq, donor, n in s.shares:
                if before == i:
                    adapter.share_prefix(seq, donor, n)
                    fed[seq] = n
            new = [[] for _ in reqs]
            for r, n in step:
                new[r] = list(reqs[r].tokens[fed[r]:fed[r] + n])
            pos = fed[s.probe]
            for r, n in step:
                fed[r] += n
            points = adapter.step(new, None, True)
            if s.probe not in [r for r, _ in step]:
                continue
            _keep_probe(points, step, s.probe, adapter.lens, probe.step_of(pos), rows)
    finally:
        adapter.close()
    return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in rows.items()}


def _keep_probe(points, step, probe: int, lens: list[int], probe_step: int, rows: dict) -> None:
    """The probe's rows of each point of one engine step (``step``: its ``(request, tokens)`` in batch order;
    ``lens``: each request's cached length after it), appended to ``rows[(probe_step, point)]``."""
    order = [r for r, _ in step]
    at = order.index(probe)
    tok0, ntok = sum(n for _, n in step[:at]), step[at][1]
    kv0, nkv = sum(lens[r] for r in order[:at]), lens[probe]
    for name, (placement, per_rank) in points.items():
        for u in unshard(name, placement, per_rank):
            cache = kind_of(u.name).rows == "cache"
            t = u.tensor[kv0:kv0 + nkv] if cache else u.tensor[tok0:tok0 + ntok]
            key = (probe_step, u.name)
            if cache:
                rows[key] = [t.clone()]  # the cache as read back after this step: the last one counts
            else:
                rows.setdefault(key, []).append(t.clone())


def run(o: InvarianceOptions, pool: EnginePool | None = None) -> InvarianceResult:
    """Every schedule of ``o`` captured and compared with the first (see the module docstring)."""
    o.check()
    cfg = _plan(o, o.tps[0], [[0] * o.prompt_len]).cfg  # the checkpoint resolved (and written, for a preset)
    todo = schedules(o, cfg.vocab_size)
    prompts = [list(r.tokens) for s in todo for r in s.requests]  # every request at its longest: validated once
    own = pool is None
    pool = pool or EnginePool()
    try:
        plans, caps, described = {}, {}, []
        for s in todo:
            if s.tp not in plans:
                plans[s.tp] = _plan(o, s.tp, prompts)
            plan = plans[s.tp]
            logger.info(f"tpcheck invariance: {s.describe()}")
            caps[s.name] = capture(plan.entry.start(pool, plan), s, o.batch_invariant)
            described.append(s.describe())
    finally:
        if own:
            pool.close()
    names = list(caps)
    rows = [r for n in names[1:] for r in compare_captures(caps[names[0]], caps[n], n, o.prompt_len)]
    e = plans[o.tps[0]].opts
    meta = {"model": e.model, "dtype": e.dtype, "engine": e.engine, "tps": list(o.tps), "batch_invariant":
            o.batch_invariant, "prompt_len": o.prompt_len, "decode_steps": o.decode_steps, "seed": o.seed,
            "inject": list(e.inject), "block_size": e.block_size}
    return InvarianceResult(names, described, rows, o.ulps, meta)


def _plan(o: InvarianceOptions, tp: int, prompts: list[list[int]]) -> RunPlan:
    """The diff plan of the engine at ``tp`` (validated as a diff's) over ``prompts`` (each request's tokens)."""
    e = o.engine.replace(tp=tp, decode_steps=0, prompts=tuple(tuple(p) for p in prompts), isolate=False)
    quiet = logging.getLogger("tpcheck.pipeline.diff")  # its lines speak of a diff (and of faults a diff misses)
    was, quiet.disabled = quiet.disabled, True
    try:
        return RunPlan.resolve(e)
    finally:
        quiet.disabled = was
