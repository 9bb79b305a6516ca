"""What one TP rank runs: builds its shard of the model, owns its KV cache, executes forward passes.

The driver calls the same method on every rank with the same arguments; ranks meet only inside the
model's collectives. Logits come back from rank 0 (the other ranks return None). Under pipeline parallelism
(``impl.pipeline``) a rank builds, loads and caches only its stage's layers; a stage after the first receives its
input from the stage before, one before the last sends on, and the logits come from TP rank 0 of the last
stage."""
from __future__ import annotations

import importlib
import os

import torch

from impl import batch_invariant
from impl.config import load_config, parse_dtype
from impl.context import Context, set_context
from impl.distributed import (get_pp_rank, get_pp_size, get_tp_rank, get_tp_size, local_device, recv_prev,
                              send_next)
from impl.layers.attention import Attention
from impl.loader import load_weights
from impl.models import model_class
from impl.pipeline import INTERMEDIATE_NAMES, layer_partition, stage_of

# (new token ids, position of the first of them, block table) for one sequence in a step
SeqInput = tuple[list[int], int, list[int]]


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu", ep_size: int = 1,
                 pp_partition: str | tuple[int, ...] | None = None):
        self.rank, self.tp_size, self.ep_size = get_tp_rank(), get_tp_size(), ep_size
        # per stage, not per world: a batch's stages run one after another (each waits on its predecessor), and
        # the same thread count as one stage keeps a pipelined run's numbers bit-equal to it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.tp_size))
        self.cfg = load_config(model_dir)
        self.cfg.check_tp(self.tp_size, ep_size)
        self.partition = layer_partition(self.cfg.num_layers, get_pp_size(), pp_partition)
        self.stage = stage_of(self.partition, get_pp_rank())
        # "cuda": this rank's own GPU (impl.distributed.rank_device: ranks past the GPU count share them)
        self.dtype, self.device = parse_dtype(dtype), torch.device(local_device(str(device)))
        # the family's model class from the registry (impl.config.FAMILIES), by the config's model_type
        self.model = model_class(self.cfg)(self.cfg, self.dtype, ep_size, stage=self.stage).to(self.device)
        # {checkpoint tensor: elements this rank read}: other expert groups' experts are not in it
        self.loaded_tensors = load_weights(self.model, model_dir, self.dtype)
        self.block_size = 0

    def attention_layers(self) -> list[Attention]:
        """The attention of each of this stage's layers, by stage-local layer index."""
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """The model over one batch on this stage: the last stage's final hidden states, None on earlier stages
        (which send theirs on)."""
        inter = None
        if not self.stage.is_first:
            inter = recv_prev(INTERMEDIATE_NAMES, (len(ids), self.cfg.hidden_size), self.dtype, self.device)
        out = self.model(ids, pos, inter)
        if self.stage.is_last:
            return out
        send_next(out)
        return None

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Per layer ``k_cache, v_cache: [num_blocks, block_size, local kv heads, head_dim]``."""
        self.block_size = block_size
        for attn in self.attention_layers():
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            dtype = attn.cache_dtype(self.dtype)  # float8_e4m3fn for a checkpoint's FP8 KV cache
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    def kv_cache_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(tuple(a.k_cache.shape), tuple(a.v_cache.shape)) for a in self.attention_layers()]

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor | None:
        """``[len, vocab]`` logits of one prompt, no KV cache involved."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        set_context(Context([len(token_ids)], [len(token_ids)]))
        try:
            hidden = self._forward(ids, torch.arange(len(token_ids), device=self.device))
            return None if hidden is None else self.model.compute_logits(hidden)
        finally:
            set_context(None)

    @torch.inference_mode()
    def step(self, batch: list[SeqInput], all_logits: bool = False) -> torch.Tensor | None:
        """One forward over a ragged batch through the paged KV cache; ``[B, vocab]`` logits of each
        sequence's last token (``[T, vocab]`` of every token with ``all_logits``) on TP rank 0 of the last stage.
        Slot of position p: ``table[p // bs] * bs + p % bs``."""
        ids, pos, slots, lens_q, lens_k = [], [], [], [], []
        for tokens, start, table in batch:
            n = len(tokens)
            ids += tokens
            pos += range(start, start + n)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, start + n)]
            lens_q.append(n)
            lens_k.append(start + n)
        tables = None
        if any(start > 0 for _, start, _ in batch):  # keys come (partly) from the cache
            width = max(len(t) for _, _, t in batch)
            tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in batch], dtype=torch.long, device=self.device)
        dev = self.device
        set_context(Context(lens_q, lens_k, torch.tensor(slots, dtype=torch.long, device=dev), tables))
        try:
            hidden = self._forward(torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, device=dev))
            if hidden is None:
                return None
            if not all_logits:
                hidden = hidden[torch.tensor(lens_q, device=dev).cumsum(0) - 1]
            return self.model.compute_logits(hidden)
        finally:
            set_context(None)

    def set_batch_invariant(self, on: bool) -> None:
        """Run this rank's GEMMs in fixed row blocks and each sequence's attention alone (``impl.batch_invariant``):
        a request's bits then do not depend on the rest of its batch. A process-wide switch, kept across loads."""
        batch_invariant.set_enabled(on)

    def call(self, target: str, *args, **kwargs):
        """Run ``module:function(runner, *args, **kwargs)`` inside this rank: the seam through which a
        harness installs hooks or faults without impl knowing about it."""
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(self, *args, **kwargs)
