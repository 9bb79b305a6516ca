"""impl, this project's engine, as an engine under test (``tpcheck diff --engine impl``, the default): hooks live
in ``tpcheck.engines.impl.ranks`` inside each rank; faults (``tpcheck.engines.impl.faults``) can be injected."""
from __future__ import annotations

import os

import torch

from impl import LLM
from impl.errors import ConfigError
from impl.pipeline import parse_partition
from tpcheck.engines.impl import ranks as capture_impl
from tpcheck.capture.core import QUEUE_MB
from tpcheck.capture.points import point_stage, split_point
from tpcheck.engines.adapter import EngineAdapter, Points, by_point
from tpcheck.judge.coverage import CoverageError
from tpcheck.engines.impl import faults
from tpcheck.reference.reductions import Reductions

FAULTS = True  # --inject patches impl's modules in its ranks


def get_llm(pool, model_dir: str | os.PathLike, tp: int, dtype: str = "float32", block_size: int = 16,
            num_kv_blocks: int | None = None, ep: int = 1, pp: int = 1, pp_partition: str | None = None,
            device: str = "cpu") -> LLM:
    """``pool``'s ``impl.LLM`` of ``tp`` ranks (per pipeline stage, ``pp`` stages) on ``device`` (a resolved one:
    ``tpcheck.inputs.devices``; ``cuda``: one rank per GPU, ranks past the GPU count sharing them), started once and
    reloaded when the checkpoint, cache layout, expert-parallel size ``ep`` (MoE models) or layer partition
    changes; an engine on another device is another engine."""
    key = (str(model_dir), dtype, block_size, num_kv_blocks, ep, pp_partition)
    if pp_partition is not None and len(parse_partition(pp_partition)) != pp:
        raise ConfigError(f"pp_partition {pp_partition} names {len(parse_partition(pp_partition))} stages, pp is {pp}")

    def start() -> LLM:
        return LLM(model_dir, tp_size=tp, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                   ep_size=ep, pp_size=pp_partition or pp, **{**pool.llm_kwargs, "device": device})

    def reload(llm: LLM) -> None:
        llm.pp_partition = None if pp_partition is None else parse_partition(pp_partition)
        llm.load(model_dir, dtype, block_size, num_kv_blocks, ep)

    # a pipelined engine has another world size: a pool slot of its own per pp; and one per device
    kind = ("impl" if pp == 1 else f"impl-pp{pp}") + ("" if device == "cpu" else f"@{device}")
    return pool.acquire(kind, tp, key, start, reload, close=LLM.close)


def start(pool, plan) -> "ImplAdapter":
    """The adapter of one diff (``tpcheck.engines.registry``): the pool's engine, with the plan's faults, block size,
    dump (each rank writes its own points) and selection."""
    opts, model_dir = plan.opts, plan.model_dir
    budget = None if opts.dump_budget_mb is None else int(opts.dump_budget_mb * 2**20)  # the whole dump's bound
    # each rank writes its own points of every propagated step (--dump), its share of the budget
    dump = None if opts.dump is None else {"root": str(opts.dump), "dtype": opts.dtype, "points": opts.dump_points,
                                           "budget_bytes": None if budget is None else budget // opts.tp,
                                           "model": model_dir}
    llm = get_llm(pool, model_dir, opts.tp, opts.dtype, ep=opts.ep, pp=opts.pp, pp_partition=opts.pp_partition,
                  device=plan.device)
    adapter = ImplAdapter(llm, list(opts.inject), opts.inject_layer, opts.block_size, dump, plan.capture_points)
    adapter.expected = plan.expected
    return adapter


class ImplAdapter(EngineAdapter):
    """impl through ``impl.LLM.call``: hooks live in ``tpcheck.engines.impl.ranks`` inside each rank. Faults
    (``tpcheck.engines.impl.faults``) are applied at ``begin`` and undone at ``close`` by reloading the weights.
    ``dump``: ``tpcheck.capture.dump.DumpWriter`` keywords less rank/tp/engine; each rank writes its own points there
    (``tpcheck diff --dump``). ``points``: a regex; the ranks capture only those points (``--points``)."""

    def __init__(self, llm, inject: list[str] = (), inject_layer: int | None = None, block_size: int = 16,
                 dump: dict | None = None, points: str | None = None):
        self.llm, self.block_size, self.dump, self.points = llm, block_size, dump, points
        self.reductions = Reductions(llm.tp_size)  # impl all-reduces in the activations' dtype, in place
        self.teacher_forcing = True  # each decoder layer's input can be replaced (the local pass)
        # a prompt's first positions can be given as keys and values (the local pass on the last rows,
        # tpcheck.pipeline.local_rows): not across pipeline stages, nor into a quantized model's caches
        self.takes_prefix = llm.pp_size == 1 and llm.cfg.quant is None
        self.inject, self.inject_layer = list(inject), inject_layer
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        self.own_cache = False
        # pipeline stages' layers [start, end) (None: one stage); the points the run expects, by stage
        self.stages = None if llm.pp_size == 1 else tuple(
            (sum(llm.partition[:s]), sum(llm.partition[:s + 1])) for s in range(llm.pp_size))
        self.expected: tuple[str, ...] = ()
        # a step's findings about a point, for its row's note (the hand-off across a stage boundary)
        self.point_notes: dict[str, str] = {}

    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        if self.inject:
            self.llm.call(faults.apply, self.inject, self.inject_layer)
        bs, self.tables, nxt = self.block_size, [], 0
        for p in prompts:
            n = -(-(len(p) + decode_steps) // bs)
            self.tables.append(list(range(nxt, nxt + n)))
            nxt += n
        self.lens = [0] * len(prompts)
        # the engine's own cache serves when it is large enough (a fault may change how a cache is laid out:
        # then one is allocated after it is applied); reallocating costs ~0.7 s for a 0.5B model
        self.own_cache = not self.inject and bs == self.llm.block_size and nxt <= self.llm.num_kv_blocks
        self.llm.call(capture_impl.setup, None if self.own_cache else nxt, bs, self.dump, self.points)
        self.dump = None  # the dump records the first (propagated) pass; the local pass writes none

    def step(self, new_tokens, teacher, capture_kv) -> Points:
        """As ``EngineAdapter.step``; a sequence given no tokens sits the step out (``tpcheck invariance``: companions
        that finished, a request that has not arrived): the points' rows are those of the others, in order."""
        run = [i for i, t in enumerate(new_tokens) if len(t)]
        batch = [(new_tokens[i], self.lens[i], self.tables[i]) for i in run]
        self.lens = [n + len(t) for n, t in zip(self.lens, new_tokens)]
        kv_lens = [self.lens[i] for i in run] if capture_kv else None
        per_rank = self.llm.call(capture_impl.step, batch, teacher, kv_lens)
        if self.stages is None:
            return by_point(per_rank)
        self.point_notes = {}
        return stage_points(per_rank, self.llm.tp_size, self.stages, self.expected, self.point_notes)

    def take_prefix(self, lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before the first step: prompt ``b``'s positions ``0..lens[b]-1`` are in the cache as ``kv`` (per layer,
        keys after RoPE and values, ``[sum(lens), kv_heads * head_dim]``), so that step runs from ``lens[b]``."""
        if any(self.lens):
            raise RuntimeError("a prefix is given before a run's first step, not after it")
        self.llm.call(capture_impl.write_prefix, self.tables, lens, kv)
        self.lens = list(lens)

    def share_prefix(self, seq: int, donor: int, tokens: int) -> None:
        """A prefix-cache hit, as impl's ``BlockManager`` makes one: sequence ``seq``'s first ``tokens`` positions
        (whole KV blocks) are the blocks sequence ``donor`` already wrote, and its next step starts at ``tokens``."""
        bs = self.block_size
        if tokens % bs or not 0 < tokens <= self.lens[donor] or self.lens[seq]:
            raise ValueError(f"a shared prefix is whole KV blocks of {bs} tokens that sequence {donor} has written "
                             f"(it holds {self.lens[donor]}) before sequence {seq} starts; got {tokens} tokens")
        self.tables[seq][:tokens // bs] = self.tables[donor][:tokens // bs]
        self.lens[seq] = tokens

    def set_batch_invariant(self, on: bool) -> None:
        """impl's batch-invariant mode (``impl.batch_invariant``) for this run; ``close`` switches it off again."""
        self.llm.set_batch_invariant(on)

    def close(self) -> None:
        if self.llm.batch_invariant:  # a pooled engine goes back in its default mode
            self.llm.set_batch_invariant(False)
        if self.inject:
            self.llm.reload()  # undo the faults: fresh weights and module code
        elif not self.own_cache:  # give the engine back its own cache layout
            self.llm.executor.call("allocate_kv_cache", self.llm.num_kv_blocks, self.llm.block_size)
        self.llm.reset_scheduler()  # the diff wrote blocks the engine's prefix cache may name


def stage_points(per_rank: list[dict], tp: int, stages: tuple[tuple[int, int], ...],
                 expected: tuple[str, ...] = (), notes: dict[str, str] | None = None, owner=point_stage) -> Points:
    """The points of a pipelined step, each from the ``tp`` ranks of the stage that computes it (global ranks
    ``stage * tp ..``; ``owner(name, stages)``, impl's ``point_stage`` by default), so a point is unsharded within its
    own stage's TP group; a point reported by a stage that does not compute it is not taken. A stage that reported
    none of the ``expected`` points it computes is a ``CoverageError`` naming the stage (exit 3). A boundary's
    ``handoff`` is what the receiving stage got; what the sending stage sent, TP rank by TP rank, must equal it bit
    for bit (``handoff_mismatch``: a finding written to ``notes[name]``, which fails its row)."""
    points: Points = {}
    for s, (start, end) in enumerate(stages):
        got = by_point(per_rank[s * tp:(s + 1) * tp])
        own = {n: v for n, v in got.items() if owner(n, stages) == s}
        if not own and any(owner(n, stages) == s for n in expected):
            raise CoverageError(f"pipeline stage {s} (layers {start}-{end - 1}, ranks {s * tp}-{(s + 1) * tp - 1}) "
                                "reported no point")
        for name in [n for n in own if split_point(n)[1] == "handoff"]:
            sent = got_of(per_rank[(s - 1) * tp:s * tp], name)
            why = handoff_mismatch(name, s, sent, own[name][1])
            if why and notes is not None:
                notes[name] = why
        points.update(own)
    return points


def got_of(ranks: list[dict], name: str) -> list | None:
    """Each of ``ranks``' tensor of point ``name`` (None when one of them did not report it)."""
    parts = [r.get(name) for r in ranks]
    return None if any(p is None for p in parts) else [p[1] for p in parts]


def handoff_mismatch(name: str, receiver: int, sent: list | None, received: list) -> str:
    """Why the hand-off of boundary ``name`` into stage ``receiver`` is wrong, or "": each TP rank r of stage
    ``receiver`` must hold, bit for bit, what TP rank r of stage ``receiver - 1`` sent (``sent`` None: the sender
    reported nothing)."""
    where = f"stage boundary {receiver - 1}->{receiver} (after layer {split_point(name)[0]})"
    if sent is None:
        return f"{where}: stage {receiver - 1} reported no hand-off it sent"
    for r, (a, b) in enumerate(zip(sent, received)):
        if a.shape != b.shape:
            return f"{where}: TP rank {r} received shape {list(b.shape)}, stage {receiver - 1} sent {list(a.shape)}"
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        bad = (a != b) & ~(a.isnan() & b.isnan())  # a NaN sent and received as NaN arrived intact
        if bad.any():
            rows, cols = bad.nonzero()[0].tolist()
            part = "hidden_states" if cols < a.shape[-1] // 2 else "residual"
            return (f"{where}: TP rank {r} of stage {receiver} received other values than stage {receiver - 1} "
                    f"sent: {int(bad.sum())} of {bad.numel()} elements (first at row {rows}, {part}; max |diff| "
                    f"{float((a.double() - b.double()).abs().max()):.3g})")
    return ""


def generate_dumped(llm: LLM, prompts: list[list[int]], params=None, root: str | os.PathLike = "dump",
                    points: str | None = None, queue_mb: int = QUEUE_MB) -> list[list[int]]:
    """``llm.generate(prompts, params)`` with every rank dumping each scheduler step into ``root``
    (``tpcheck compare root --model CKPT`` judges it): impl's continuous batching as it ran, requests joining
    when admitted, prefills and recomputes after preemption included, each step naming its requests (the
    scheduler's sequence ids), their tokens and positions; the logits are the sampled rows only. ``points``: a
    regex of the points to dump. The scheduler starts afresh (a dump must not begin on blocks cached by earlier
    requests); a prefill that starts past position 0 on another request's blocks (a prefix-cache hit) records the
    sequence's token ids from position 0 in the step (``prompts``), and ``compare``'s golden runs the cached
    positions first. Each rank's files are written by a thread of its writer's own while the engine runs on
    (``queue_mb`` MiB of steps may wait, ``TPCHECK_DUMP_QUEUE_MB``'s default; past it a step waits; 0: each step
    written inside it), all written before this returns."""
    if queue_mb < 0:
        raise ValueError(f"queue_mb must be >= 0, got {queue_mb}")
    dtype = str(llm.dtype).removeprefix("torch.")
    llm.reset_scheduler()
    llm.call(capture_impl.setup, None, llm.block_size,
             {"root": str(root), "dtype": dtype, "points": points, "model": llm.model_dir,
              "background_bytes": queue_mb * 2**20 or None}, points, serving=True)  # a thread writes, as vLLM's
    # (``points`` given to the capture too: hooks only where a selected point comes from, as vLLM's plugin installs
    # them; the writer's own filter alone left every point copied at every hook, then dropped: on an H200, 18,624
    # host copies for the 1,600 tensors a selection of qwen2.5-0.5b wrote over 64 steps)
    scheduler, executor = llm.scheduler, llm.executor
    schedule, call, last = scheduler.schedule, executor.call, {}

    def scheduled():  # the batch's sequences, in the order generate() hands them to the ranks
        batch, is_prefill = schedule()
        last["ids"] = [str(s.seq_id) for s in batch]
        last["prompts"] = {str(s.seq_id): list(s.token_ids) for s in batch} if is_prefill else {}
        return batch, is_prefill

    def calling(method, *args, **kwargs):
        out = call(method, *args, **kwargs)
        if method == "step":  # one forward of the scheduled batch: every rank writes its points of it
            tokens, starts = [list(t) for t, _, _ in args[0]], [s for _, s, _ in args[0]]
            ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
            call("call", "tpcheck.engines.impl.ranks:serving_step", last["ids"], tokens, starts, {"logits": ends.tolist()},
                 last["prompts"])
        return out

    scheduler.schedule, executor.call = scheduled, calling
    try:
        return llm.generate(prompts, params)
    finally:
        del scheduler.schedule, executor.call  # the instance attributes go: the class methods again
        llm.call(capture_impl.serving_end)
