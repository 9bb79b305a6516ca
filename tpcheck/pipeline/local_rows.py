"""The local pass on each prompt's last rows (``local_rows``, ``--local-rows N``; default 32).

The local pass feeds every decoder layer of the engine and of both noise-floor references the golden's input of
that layer, at every row: a second forward of everything. What one row of a layer computes depends on other rows
only through attention, which reads the keys and values of the positions before it. So the last ``N`` positions of
a prompt of ``T`` can be run alone, teacher-forced as before, once positions ``0..T-N-1`` are in the caches: their
keys (after RoPE) and values are the golden's own (``attn.k_rope``, ``attn.v`` of its propagated pass, which the
local pass reuses: the golden's input is the golden, so its two passes are one), rounded once to the run's dtype
and written into the engine's KV cache (the adapter's ``take_prefix``, in the engine's own layout) and into each
reference's. Decode steps run as before, over that history.

What changes at a teacher-forced row: the keys and values of the earlier positions it attends to are the golden's
rounded once, where a full local pass has each run's own projections of the golden input (rounded a few times
more). The engine and both references read the same history, so the floor stays a floor of the same computation;
it does not grow with depth, since every row it judges is still forced at every layer. What the local pass no
longer judges: the first ``T-N`` rows of each prompt; the propagated pass still judges every row at every layer
(a bug that shows only at early positions shows there, with the margin that pass has at its depth). A prompt no
longer than ``N`` runs whole, as does every engine whose adapter cannot take a cache prefix (``takes_prefix``;
impl's does not for a pipelined or a quantized model), a dump's local pass, a mixture-of-experts model (its routes
follow the engine's, row by row) and a replayed golden that lacks a layer's keys or values.

Cost: the local pass's forwards and statistics scale with its rows (``benchmarks/diff_overhead.py``)."""
from __future__ import annotations

import torch

from tpcheck.capture.batches import StepBatch
from tpcheck.capture.points import kind_of
from tpcheck.engines.adapter import as_adapter
from tpcheck.reference.hf import fill_caches

PREFIX_KINDS = ("attn.k_rope", "attn.v")  # the golden's points a prefix is written from (kept for the local pass)


def planned_prefix(engine, prompts: list[list[int]], local_rows: int, sparse: bool, handoffs) -> list[int] | None:
    """The prefix the local pass gives each prompt (``prefix_lens``) where the run allows one: an engine that takes
    a prefix (``takes_prefix``), a dense model, one pipeline stage (no ``handoffs``); else None. The golden's cache
    then holds the first step split for it (``tpcheck.pipeline.steps.GoldenCache``)."""
    if sparse or handoffs or not as_adapter(engine).takes_prefix:
        return None
    return prefix_lens(prompts, local_rows)


class LastRows:
    """One local pass's prefix, per prompt, where it has one: the golden reused from the propagated pass
    (``cache_in``), which held the first step split for it (its ``prefix``: ``planned_prefix``, None where the
    golden lacked a layer's keys or values)."""

    def __init__(self, ctx, cache_in):
        self.ctx, self.cache_in = ctx, cache_in
        self.lens = getattr(cache_in, "prefix", None)
        ctx.local_rows_ran |= self.lens is not None

    def first(self, batch: StepBatch) -> StepBatch:
        """The pass's first step: ``suffix_batch`` where there is a prefix."""
        return batch if self.lens is None else suffix_batch(batch, self.lens)

    def golden(self, step: int) -> tuple[dict | None, dict | None]:
        """At the first step with a prefix, the golden's points at the rows the pass runs and the prefix's keys and
        values (``split_golden``, done as the propagated pass held the step); else ``(None, None)``."""
        if self.lens is None or step:
            return None, None
        return self.cache_in.take(0)  # held split (GoldenCache.put)

    def give(self, r_caches: dict[str, list], kv: dict | None) -> dict | None:
        """``give_prefix`` of ``kv`` (None: nothing) to the references' caches of the step and the engine; what was
        written."""
        if kv is None:
            return None
        c = self.ctx
        return give_prefix(c.engine, r_caches, self.lens, kv, c.dtype, c.head_dim, c.golden_device)


def prefix_lens(prompts: list[list[int]], local_rows: int | None) -> list[int] | None:
    """Per prompt, how many first positions the local pass gives as a cache prefix (its length less
    ``local_rows``, at least 0); None where no prompt is longer than ``local_rows`` or it is 0 / None (every row)."""
    if not local_rows:
        return None
    lens = [max(0, len(p) - local_rows) for p in prompts]
    return lens if any(lens) else None


def suffix_batch(batch: StepBatch, lens: list[int]) -> StepBatch:
    """The first step of the local pass: each request's tokens past its prefix, from that position, the whole
    prompt recorded (``StepBatch.prompts``: the step log sees the prefix as a prefix-cache hit's gap)."""
    return StepBatch(list(batch.ids), [list(t[n:]) for t, n in zip(batch.tokens, lens)],
                     [s + n for s, n in zip(batch.starts, lens)],
                     prompts={rid: list(t) for rid, t in zip(batch.ids, batch.tokens)})


def split_golden(gold: dict[str, torch.Tensor], row_lens: list[int], lens: list[int],
                 num_layers: int) -> tuple[dict[str, torch.Tensor], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The golden's points of a prefill (``row_lens`` rows per prompt, prompts concatenated) at the rows the local
    pass runs (the last ``row_lens[b] - lens[b]`` of prompt ``b``; a KV-cache point, whose rows are cached
    positions, whole), and per layer the prefix's ``(keys after RoPE, values)`` (``[sum(lens), kv_heads *
    head_dim]``, float64)."""
    keep = torch.zeros(sum(row_lens), dtype=torch.bool)
    offset = 0
    for n, p in zip(row_lens, lens):
        keep[offset + p:offset + n] = True
        offset += n
    keep = keep.to(next(iter(gold.values())).device) if gold else keep  # the mask where the golden is
    prefix = ~keep
    missing = [f"layers.{i}.{k}" for i in range(num_layers) for k in PREFIX_KINDS if f"layers.{i}.{k}" not in gold]
    if missing:
        raise ValueError(f"the golden's step lacks {missing[:2]}: the local pass on the last rows writes the "
                         "prefix's keys and values from them")
    kv = {i: (gold[f"layers.{i}.attn.k_rope"][prefix], gold[f"layers.{i}.attn.v"][prefix])
          for i in range(num_layers)}
    rows = {n: t if kind_of(n).rows == "cache" else t[keep] for n, t in gold.items()}
    return rows, kv


def give_prefix(engine, r_caches: dict[str, list], lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                dtype: torch.dtype, head_dim: int, device: str = "cpu") -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Write each prompt's first ``lens[b]`` positions, the golden's keys and values (``split_golden``'s, prompts
    concatenated) rounded to ``dtype``, into each reference's cache of it (``r_caches``: reference name -> the
    caches of the step's requests, in prompt order; the references on ``device``, the golden's) and into the
    engine's (its adapter's ``take_prefix``, which places them on its own device: impl's ranks receive them on the
    host, ``impl.executor.on_host``, and write them into their caches where those are). Returns what was written
    (the rounded keys and values)."""
    kv = {i: (k.to(dtype), v.to(dtype)) for i, (k, v) in kv.items()}
    for caches in r_caches.values():
        fill_caches(caches, lens, kv, head_dim, dtype, device)
    engine.take_prefix(list(lens), kv)
    return kv
