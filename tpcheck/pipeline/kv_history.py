"""The KV cache of an engine that does not read it back (a dump: vLLM's plugin, SGLang's dumper), as its own keys and
values wrote it: what ``tpcheck.measure.own_attention`` recomputes a decode step's (or a cached prefix's) attention
from.

The own-op check of ``attn.context`` needs every key and value the step's queries attend to. A live engine reads
its cache back (``kv.k`` / ``kv.v``); a dump holds only each step's new rows (``attn.k_rope`` / ``attn.v``), so at a
step that starts past position 0 the check had nothing to read, ``own_err`` was NaN and a correct kernel that
rounds otherwise than Hugging Face's (vLLM's CPU decode attention in bfloat16 on a trained model: a gain of 1.5-4
units at ``attn.context``) could neither pass as inherited nor have its gain told from its inputs'. The cache an
engine wrote is the keys after RoPE and the values it computed at the positions it ran (for a prefix-cache hit, the
request that ran those positions: ``RecordedInputs``' donor), in the cache's dtype, here the model's; so this module
keeps each request's rows of ``attn.k_rope`` / ``attn.v`` over the steps and gives each step, per layer whose
``kv.k`` the engine did not report, ``kv.k`` / ``kv.v`` of positions ``0..kv_len - 1`` of every request, in the
step's order (the ``RowLayout.kv_lens`` layout). They serve the own-op check only: they are not the engine's
report of its cache, so they are never compared or judged as points.

What that does not see, and why it is still right: a cache that stores other values than the ones computed (a slot
off by one, a stale block) makes the engine's context differ from the op recomputed from its correct keys and
values, so ``own_err`` is the bug's full size and the context fails as its own error, not as inherited; a wrong key
or value fails at ``attn.k_rope`` / ``attn.v`` first. A quantized (FP8) cache rounds what this check does not model:
there ``own_err`` holds that rounding too, so a context over its floor passes as inherited only where the cache's
rounding is itself within the threshold (without the check it could not pass at all)."""
from __future__ import annotations

from typing import Callable

import torch

from tpcheck.capture.batches import StepBatch
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


class KvHistory:
    """Per request, the engine's ``attn.k_rope`` / ``attn.v`` rows at every position it ran (``step``)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.recorded = RecordedInputs()
        self.lost: set[str] = set()  # requests on a cached prefix no request of the dump ran: no history
        self.layers: list[int] | None = None  # the layers kept, fixed at the first step that has any

    def step(self, batch: StepBatch, engine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``engine`` (the step's unsharded points), where a lookup of ``layers.{i}.kv.k / kv.v`` it lacks gives
        ``[sum(batch.kv_lens), kv_dim]``: positions ``0..kv_len - 1`` of every request, in the step's order, for each
        layer whose ``attn.k_rope`` and ``attn.v`` it holds at every row of the step; none where a request of the
        step has no history (a cached prefix no request of the dump ran)."""
        rows = sum(batch.row_lens)
        layers = [i for i in range(self.num_layers) if f"layers.{i}.kv.k" not in engine and all(
            f"layers.{i}.attn.{p}" in engine and engine[f"layers.{i}.attn.{p}"].shape[0] == rows
            for p in ("k_rope", "v"))]
        if not layers or self.layers is not None and layers != self.layers:
            if layers:  # a step that holds other layers' keys than the first did: no consistent history from here
                self.lost |= set(batch.ids)
            return engine
        self.layers = layers
        names = {f"layers.{i}.kv.{c}": f"layers.{i}.attn.{p}" for i in layers for c, p in (("k", "k_rope"), ("v", "v"))}
        try:
            self.recorded.add(batch, {src: engine[src] for src in names.values()})
        except ValueError:  # a request starts on positions no request of the dump ran; the step's others may be
            self.lost |= set(batch.ids)  # half recorded: none of them has a history to trust from here on
        if self.lost & set(batch.ids):
            return engine
        kept, lens = self.recorded.inputs, list(zip(batch.ids, batch.kv_lens))
        return WithCache(engine, lambda kv: None if kv not in names else
                         torch.cat([kept[rid][names[kv]][:n] for rid, n in lens]))
