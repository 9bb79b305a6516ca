"""How tpcheck reaches an engine under test: a small protocol, and the built-in adapter for impl.

An adapter runs the engine's TP ranks on a checkpoint and, for each step, returns its hook points as
``{name: (placement, [rank 0 tensor, rank 1 tensor, ...])}`` with canonical names (``tpcheck.capture.points``),
``[rows, features]`` tensors and ``impl.placements`` placements (a rank that does not hold a point gives
None). Points an engine does not report are not compared, and listed (``tpcheck.judge.coverage``). See
``docs/adapters.md``."""
from __future__ import annotations

from typing import Protocol

import torch

from tpcheck.capture import impl as capture_impl

from tpcheck.inputs import faults
from tpcheck.reference.reductions import Reductions

Points = dict[str, tuple[object, list[torch.Tensor | None]]]

# the built-in engines (``tpcheck diff --engine``); any other engine comes through a dump or an adapter
ENGINES = {"impl": "impl, this project's engine (faults can be injected)",
           "hf-tp": "Hugging Face transformers' own tensor parallelism (from_pretrained tp_plan, tpcheck.engines.hf_tp)"}


def by_point(per_rank: list[dict]) -> Points:
    """Each rank's ``{name: (placement, tensor)}`` regrouped as ``{name: (placement, [rank 0, rank 1, ...])}``
    (None where a rank lacks the point)."""
    points: Points = {}
    for rank, pts in enumerate(per_rank):
        for name, (placement, t) in pts.items():
            points.setdefault(name, (placement, [None] * len(per_rank)))[1][rank] = t
    return points


class EngineAdapter(Protocol):
    reductions: Reductions
    """How the engine's row-parallel all-reduces round (``tpcheck.reference.reductions``): its tp and reduce dtype. The
    noise floor admits that rounding; an adapter without it is judged against one-device HF only."""

    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        """Start fresh sequences (one per prompt) with room for ``decode_steps`` more tokens each."""

    def step(self, new_tokens: list[list[int]], teacher: dict[int, torch.Tensor] | None,
             capture_kv: bool) -> Points:
        """Feed each sequence its new tokens (the whole prompt first, then one token per decode step).
        ``teacher`` (isolate mode): ``{layer i: input of decoder layer i, num_layers: input of the final
        norm}``, full ``[rows, hidden]`` tensors the engine should use in place of its own."""

    def close(self) -> None:
        """Release what ``begin`` took; leave the engine reusable."""


class ImplAdapter:
    """impl through ``impl.LLM.call``: hooks live in ``tpcheck.capture.impl`` inside each rank. Faults
    (``tpcheck.inputs.faults``) are applied at ``begin`` and undone at ``close`` by reloading the weights.
    ``dump``: ``tpcheck.capture.dump.DumpWriter`` keywords less rank/tp/engine; each rank writes its own points there
    (``tpcheck diff --dump``). ``points``: a regex; the ranks capture only those points (``--points``)."""

    def __init__(self, llm, inject: list[str] = (), inject_layer: int | None = None, block_size: int = 16,
                 dump: dict | None = None, points: str | None = None):
        self.llm, self.block_size, self.dump, self.points = llm, block_size, dump, points
        self.reductions = Reductions(llm.tp_size)  # impl all-reduces in the activations' dtype, in place
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
