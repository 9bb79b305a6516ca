"""The KV cache as the run's own keys and values wrote it: what ``tpcheck.measure.own_attention`` recomputes a
decode step's (or a cached prefix's) attention from in a dump, and the op of a live engine's cache read back.

The own-op check of ``attn.context`` needs every key and value the step's queries attend to. A live engine reads
its cache back (``kv.k`` / ``kv.v``); a dump holds only each step's new rows (``attn.k_rope`` / ``attn.v``), so at a
step that starts past position 0 the check had nothing to read, ``own_err`` was NaN and a correct kernel that
rounds otherwise than Hugging Face's (vLLM's CPU decode attention in bfloat16 on a trained model: a gain of 1.5-4
units at ``attn.context``) could neither pass as inherited nor have its gain told from its inputs'. The cache an
engine wrote is the keys after RoPE and the values it computed at the positions it ran (for a prefix-cache hit, the
request that ran those positions: ``RecordedInputs``' donor; for the local pass's prefix, the golden's keys and
values it was given, ``seed``), in the cache's dtype, here the model's; so this module keeps each request's rows of
``attn.k_rope`` / ``attn.v`` over the steps and gives each step, per layer, ``kv.k`` / ``kv.v`` of positions ``0..kv_len
- 1`` of every request, in the step's order (the ``RowLayout.kv_lens`` layout): under ``written(name)`` always
(the cache points' own op: a key row over its threshold that passes as inherited passes in the cache that stores
it), and under the point's own name where the engine did not report it. They serve the own-op check only: they are
not the engine's report of its cache, so they are never compared or judged as points.

Ranks whose keys or values differ from the first replica's (a KV head replicated over ranks whose inputs differ by
an ulp: vLLM's rank-ordered all-reduce) each wrote their own: from the first step one differs, each such rank keeps
its own history (the steps before it, where it held the first replica's values, copied from that), given in the
step's replicas as rank -> tensor (``ByRank``), so each rank's cache and heads of the context are redone on what
that rank wrote.

What that does not see, and why it is still right: a cache that stores other values than the ones computed (a slot
off by one, a stale block) makes the engine's context differ from the op recomputed from its correct keys and
values, so ``own_err`` is the bug's full size and the context (or the cache read back) fails as its own error, not
as inherited; a wrong key or value fails at ``attn.k_rope`` / ``attn.v`` first. A quantized (FP8) cache rounds what
this check does not model: there the context's ``own_err`` holds that rounding too, so a context over its floor
passes as inherited only where the cache's rounding is itself within the threshold (without the check it could not
pass at all), and the cache points have no op (``own_attention.op``)."""
from __future__ import annotations

from typing import Callable

import torch

from tpcheck.capture.batches import StepBatch
from tpcheck.measure.own_attention import written
from tpcheck.pipeline.forced import RecordedInputs


class WithCache(dict):
    """A step's engine points, and its made-up ``kv.k`` / ``kv.v`` built on first use (``build``): most steps' contexts
    stay under half their threshold and are never recomputed, and a long history is not copied for them."""

    def __init__(self, points: dict[str, torch.Tensor], build: Callable[[str], torch.Tensor | None]):
        super().__init__(points)
        self._build = build

    def __missing__(self, name: str) -> torch.Tensor:
        t = self._build(name)
        if t is None:
            raise KeyError(name)
        self[name] = t
        return t


class ByRank(dict):
    """rank -> the tensor that rank's history makes, built on first lookup (``get``), for ``ranks`` alone: the
    others' is the first replica's (``get``'s default)."""

    def __init__(self, ranks: list[int], build: Callable[[int], torch.Tensor]):
        super().__init__()
        self._ranks, self._build = list(ranks), build

    def get(self, rank: int, default=None):
        if rank not in self._ranks:
            return default
        if not dict.__contains__(self, rank):
            self[rank] = self._build(rank)
        return self[rank]


def _of_rank(src: str, rank: int) -> str:
    return f"{src}@rank{rank}"


class KvHistory:
    """Per request, the engine's ``attn.k_rope`` / ``attn.v`` rows at every position it ran (``step``), and each
    rank's where its replicas differ."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.recorded = RecordedInputs()
        self.lost: set[str] = set()  # requests on a cached prefix no request of the dump ran: no history
        self.layers: list[int] | None = None  # the layers kept, fixed at the first step that has any
        self.ranks: list[int] = []  # ranks whose keys or values differed from the first replica's: their own

    def seed(self, batch: StepBatch, lens: list[int] | None,
             kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """The positions a local pass gave each request of its first step ``batch`` as a cache prefix (``lens[b]``
        first positions; ``kv``: per layer ``(keys, values)``, prompts concatenated, as the engine was given them:
        ``tpcheck.pipeline.local_rows.give_prefix``); nothing where it gave none (``kv`` None)."""
        if kv is None or lens is None:
            return
        offset = 0
        for rid, n in zip(batch.ids, lens):
            if n:
                self.recorded.tokens[rid] = list(batch.prompts[rid][:n])
                self.recorded.inputs[rid] = {f"layers.{i}.attn.{p}": t[offset:offset + n] for i, (k, v) in kv.items()
                                             for p, t in (("k_rope", k), ("v", v))}
            offset += n

    def step(self, batch: StepBatch, engine: dict[str, torch.Tensor], replicas: dict[str, dict[int, torch.Tensor]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
        """``engine`` (the step's unsharded points) and ``replicas`` (point -> rank -> the whole point as that
        rank's replicas make it, where they differ), where a lookup of ``written(layers.{i}.kv.k / kv.v)``, and of
        ``layers.{i}.kv.k / kv.v`` where the engine did not report it, gives ``[sum(batch.kv_lens), kv_dim]``:
        positions ``0..kv_len - 1`` of every request, in the step's order, for each layer whose ``attn.k_rope`` and
        ``attn.v`` it holds at every row of the step; none where a request of the step has no history (a cached
        prefix no request of the dump ran)."""
        rows = sum(batch.row_lens)
        layers = [i for i in range(self.num_layers) if all(
            f"layers.{i}.attn.{p}" in engine and engine[f"layers.{i}.attn.{p}"].shape[0] == rows
            for p in ("k_rope", "v"))]
        if not layers or self.layers is not None and layers != self.layers:
            if layers:  # a step that holds other layers' keys than the first did: no consistent history from here
                self.lost |= set(batch.ids)
            return engine, replicas
        self.layers = layers
        names = {f"layers.{i}.kv.{c}": f"layers.{i}.attn.{p}" for i in layers for c, p in (("k", "k_rope"), ("v", "v"))}
        new = sorted({r for src in names.values() for r in replicas.get(src, {})} - set(self.ranks))
        for kept in self.recorded.inputs.values():  # until now each new rank held the first replica's values
            kept.update({_of_rank(src, r): kept[src] for src in names.values() for r in new if src in kept})
        self.ranks += new
        rows_of = {src: engine[src] for src in names.values()}
        rows_of.update({_of_rank(src, r): replicas.get(src, {}).get(r, engine[src])
                        for src in names.values() for r in self.ranks})
        try:
            self.recorded.add(batch, rows_of)
        except ValueError:  # a request starts on positions no request of the dump ran; the step's others may be
            self.lost |= set(batch.ids)  # half recorded: none of them has a history to trust from here on
        if self.lost & set(batch.ids):
            return engine, replicas
        kept, lens = self.recorded.inputs, list(zip(batch.ids, batch.kv_lens))

        def cache(kv: str, rank: int | None = None) -> torch.Tensor:
            src = names[kv] if rank is None else _of_rank(names[kv], rank)
            return torch.cat([kept[rid][src][:n] for rid, n in lens])

        made = {written(kv): kv for kv in names} | {kv: kv for kv in names if kv not in engine}
        with_cache = WithCache(engine, lambda name: cache(made[name]) if name in made else None)
        if not self.ranks:
            return with_cache, replicas
        return with_cache, {**replicas, **{name: ByRank(self.ranks, lambda r, kv=kv: cache(kv, r))
                                           for name, kv in made.items()}}
