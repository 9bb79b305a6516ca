"""impl, this project's engine, as an engine under test (``tpcheck diff --engine impl``, the default): hooks live
in ``tpcheck.capture.impl`` inside each rank; faults (``tpcheck.inputs.faults``) can be injected."""
from __future__ import annotations

import os

import torch

from impl import LLM
from tpcheck.capture import impl as capture_impl
from tpcheck.engines.adapter import Points, by_point
from tpcheck.inputs import faults
from tpcheck.reference.reductions import Reductions

FAULTS = True  # --inject patches impl's modules in its ranks


def get_llm(pool, model_dir: str | os.PathLike, tp: int, dtype: str = "float32", block_size: int = 16,
            num_kv_blocks: int | None = None, ep: int = 1) -> LLM:
    """``pool``'s ``impl.LLM`` of ``tp`` ranks, started once and reloaded when the checkpoint, cache layout or
    expert-parallel size ``ep`` (MoE models) changes."""
    key = (str(model_dir), dtype, block_size, num_kv_blocks, ep)

    def start() -> LLM:
        return LLM(model_dir, tp_size=tp, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                   ep_size=ep, **pool.llm_kwargs)

    def reload(llm: LLM) -> None:
        llm.load(model_dir, dtype, block_size, num_kv_blocks, ep)

    return pool.acquire("impl", tp, key, start, reload, close=LLM.close)


def start(pool, plan) -> "ImplAdapter":
    """The adapter of one diff (``tpcheck.engines.registry``): the pool's engine, with the plan's faults, block size,
    dump (each rank writes its own points) and selection."""
    opts, model_dir = plan.opts, plan.model_dir
    budget = None if opts.dump_budget_mb is None else int(opts.dump_budget_mb * 2**20)  # the whole dump's bound
    # each rank writes its own points of every propagated step (--dump), its share of the budget
    dump = None if opts.dump is None else {"root": str(opts.dump), "dtype": opts.dtype, "points": opts.dump_points,
                                           "budget_bytes": None if budget is None else budget // opts.tp,
                                           "model": model_dir}
    llm = get_llm(pool, model_dir, opts.tp, opts.dtype, ep=opts.ep)
    return ImplAdapter(llm, list(opts.inject), opts.inject_layer, opts.block_size, dump, plan.capture_points)


class ImplAdapter:
    """impl through ``impl.LLM.call``: hooks live in ``tpcheck.capture.impl`` inside each rank. Faults
    (``tpcheck.inputs.faults``) are applied at ``begin`` and undone at ``close`` by reloading the weights.
    ``dump``: ``tpcheck.capture.dump.DumpWriter`` keywords less rank/tp/engine; each rank writes its own points there
    (``tpcheck diff --dump``). ``points``: a regex; the ranks capture only those points (``--points``)."""

    def __init__(self, llm, inject: list[str] = (), inject_layer: int | None = None, block_size: int = 16,
                 dump: dict | None = None, points: str | None = None):
        self.llm, self.block_size, self.dump, self.points = llm, block_size, dump, points
        self.reductions = Reductions(llm.tp_size)  # impl all-reduces in the activations' dtype, in place
        self.teacher_forcing = True  # each decoder layer's input can be replaced (the local pass)
        self.inject, self.inject_layer = list(inject), inject_layer
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        self.own_cache = False

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
        batch = [(toks, start, table) for toks, start, table in zip(new_tokens, self.lens, self.tables)]
        self.lens = [n + len(t) for n, t in zip(self.lens, new_tokens)]
        return by_point(self.llm.call(capture_impl.step, batch, teacher, self.lens if capture_kv else None))

    def close(self) -> None:
        if self.inject:
            self.llm.reload()  # undo the faults: fresh weights and module code
        elif not self.own_cache:  # give the engine back its own cache layout
            self.llm.executor.call("allocate_kv_cache", self.llm.num_kv_blocks, self.llm.block_size)
        self.llm.reset_scheduler()  # the diff wrote blocks the engine's prefix cache may name


def generate_dumped(llm: LLM, prompts: list[list[int]], params=None, root: str | os.PathLike = "dump",
                    points: str | None = None) -> list[list[int]]:
    """``llm.generate(prompts, params)`` with every rank dumping each scheduler step into ``root``
    (``tpcheck compare root --model CKPT`` judges it): impl's continuous batching as it ran, requests joining
    when admitted, prefills and recomputes after preemption included, each step naming its requests (the
    scheduler's sequence ids), their tokens and positions; the logits are the sampled rows only. ``points``: a
    regex of the points to dump. The scheduler starts afresh (a dump must not begin on blocks cached by earlier
    requests); a prefill that starts past position 0 on another request's blocks (a prefix-cache hit) records the
    sequence's token ids from position 0 in the step (``prompts``), and ``compare``'s golden runs the cached
    positions first."""
    dtype = str(llm.dtype).removeprefix("torch.")
    llm.reset_scheduler()
    llm.call(capture_impl.setup, None, llm.block_size,
             {"root": str(root), "dtype": dtype, "points": points, "model": llm.model_dir}, None)
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
            call("call", "tpcheck.capture.impl:serving_step", last["ids"], tokens, starts, {"logits": ends.tolist()},
                 last["prompts"])
        return out

    scheduler.schedule, executor.call = scheduled, calling
    try:
        return llm.generate(prompts, params)
    finally:
        del scheduler.schedule, executor.call  # the instance attributes go: the class methods again
        llm.call(capture_impl.serving_end)
