"""The rank side of Hugging Face's tensor parallelism under test: ``HFTPRank``, one rank of ``tp_plan``, run by
impl's executor (``tpcheck.engines.hf_tp.adapter.HFTPAdapter``) or under torchrun (``python -m
tpcheck.engines.hf_tp``).

Each rank loads the family's HF class with ``from_pretrained(..., tp_plan="auto")`` and captures its points with
``tpcheck.capture`` and ``HF_TP_MAP`` (placements read from the DTensor weights), plus its KV cache; teacher
forcing replaces each decoder layer's input (``tpcheck.capture.teacher``)."""
from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.distributed as dist

from impl.config import load_config
from impl.distributed import local_device
from impl.placements import Shard
from tpcheck.capture.copies import as_rows
from tpcheck.capture.core import install
from tpcheck.capture.maps import HF_TP_MAP
from tpcheck.capture.teacher import Teacher
from tpcheck.reference.hf import ATTN_NAME, RopeProbe, cache_kv, fill_caches, forward_one, load_hf_model, new_cache, \
    register_attention


def _dist_env(device: str) -> None:
    """transformers' ``tp_plan`` reads the rank layout from torchrun's variables; a group started by impl's
    executor (a FileStore, no torchrun) gets them from torch.distributed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
        os.environ.setdefault(key, str(value))
    if device.startswith("cuda"):  # this rank's own GPU (impl.distributed.rank_device), as init_tp set it
        torch.cuda.set_device(torch.device(local_device(device)))


def _tp_plan_kwargs(tp: int) -> dict:
    """``from_pretrained`` keywords for the model's own tp_plan: ``distributed_config`` where transformers has
    it (5.x; a bare ``tp_plan`` is deprecated there), ``tp_plan="auto"`` before."""
    try:
        from transformers import DistributedConfig  # transformers 5.x only (ImportError before)
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_size=tp, tp_plan="auto")}


class HFTPRank:
    """One rank: the tp_plan model with capture hooks, teacher pre-hooks and per-prompt ``DynamicCache``s."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu"):
        _dist_env(device)
        self.rank, self.tp = dist.get_rank(), dist.get_world_size()
        register_attention()
        if importlib.util.find_spec("accelerate") is None:  # transformers needs it for tp_plan, and says so late
            raise ImportError("--engine hf-tp needs accelerate (pip install 'tpcheck[hf-tp]' or "
                              "pip install accelerate)")
        self.model = load_hf_model(model_dir, dtype, **_tp_plan_kwargs(self.tp))
        if device != "cpu":  # transformers' tp_plan load leaves a tp-1 model on the CPU whatever LOCAL_RANK says
            self.model.to(torch.device(local_device(device)))
        self.model.config._attn_implementation = ATTN_NAME
        m = self.model.model
        for layer in m.layers:
            layer.self_attn.rope_probe = RopeProbe()
        self.teacher = Teacher(m.layers, m.norm, like=self.model, batch_dim=True)
        self.capture = install(self.model, HF_TP_MAP)
        self.caches: list = []
        self.head_dim = load_config(model_dir).head_dim

    def call(self, target, *args, **kwargs):
        """Run ``fn(rank, *args, **kwargs)`` (a function or ``"module:function"``) inside this rank: how a
        test patches one rank's weights."""
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target(self, *args, **kwargs)

    def begin(self, num_prompts: int) -> None:
        self.caches = [new_cache(self.model) for _ in range(num_prompts)]

    def take_prefix(self, lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Prompt ``b``'s positions ``0..lens[b]-1`` written into its cache (``tpcheck.pipeline.local_rows``):
        ``kv[layer]`` is ``(keys after RoPE, values)`` of every KV head, ``[sum(lens), kv_heads * head_dim]``;
        this rank keeps its contiguous block of heads, as transformers' TP plan splits ``k_proj`` / ``v_proj``."""
        own = {i: tuple(t.view(t.shape[0], self.tp, -1)[:, self.rank] for t in pair) for i, pair in kv.items()}
        fill_caches(self.caches, lens, own, self.head_dim, self.model.dtype, self.model.device)  # kv came on the host

    @torch.no_grad()
    def step(self, tokens: list[list[int]], starts: list[int], teacher: dict | None = None,
             with_kv: bool = False) -> dict:
        """One step of every prompt (each a batch of one, so no padding becomes rows): this rank's points
        ``{name: (placement, [rows, features] tensor)}``."""
        self.capture.clear()
        offset = 0
        try:
            for b, toks in enumerate(tokens):
                self.teacher.inputs = None if teacher is None else \
                    {i: x[offset:offset + len(toks)] for i, x in teacher.items()}
                forward_one(self.model, toks, self.caches[b], starts[b])
                offset += len(toks)
            points = self.capture.step_done()
        finally:
            self.teacher.inputs = None
            self.capture.clear()
        if with_kv:  # each rank's cache holds its own KV heads: Shard(-1) over heads, no replicas
            for i in range(len(self.model.model.layers)):
                ks, vs = zip(*(cache_kv(c, i) for c in self.caches))
                points[f"layers.{i}.kv.k"] = (Shard(-1), as_rows(torch.cat(ks)))
                points[f"layers.{i}.kv.v"] = (Shard(-1), as_rows(torch.cat(vs)))
        return points


def greedy_dump(rank: HFTPRank, prompts: list[list[int]], decode_steps: int, writer) -> list[list[int]]:
    """Greedy decode of every prompt, each step's points written by ``writer``; returns the generated ids."""
    rank.begin(len(prompts))
    tokens, starts, out = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    for step in range(decode_steps + 1):
        points = rank.step(tokens, starts, with_kv=decode_steps > 0)
        writer.write(step, tokens, starts, points)
        logits = points["logits"][1]  # gathered: every rank holds the full logits
        last = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        nxt = logits[last].argmax(-1).tolist()
        starts = [s + len(t) for s, t in zip(starts, tokens)]
        tokens = [[t] for t in nxt]
        for o, t in zip(out, nxt):
            o.append(t)
    return out
