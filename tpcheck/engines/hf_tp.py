"""Hugging Face's own tensor parallelism as an engine under test: ``tpcheck diff --engine hf-tp``.

Each rank loads the family's HF class (``Qwen2ForCausalLM``, ...) with ``from_pretrained(..., tp_plan="auto")``
(transformers shards the weights as DTensors and installs its column/row-parallel forwards; gloo on CPU, NCCL
on GPU) and captures its points
with ``tpcheck.capture`` and ``HF_TP_MAP`` (placements read from the DTensor weights), plus each rank's KV
cache. Two ways to run it:

* live: ``HFTPAdapter`` starts the ranks (impl's rank process management, ``impl.executor.Executor``, with
  ``HFTPRank`` as the rank-side object) and hands each step's points to ``tpcheck.compare_engine``;
* under torchrun, dumping (any number of nodes)::

      torchrun --nproc-per-node 2 -m tpcheck.engines.hf_tp --model CKPT --dump DIR --prompt-ids 1,2,3 --decode-steps 4
      tpcheck compare DIR --model CKPT

  (greedy decode; every rank writes ``DIR/rank{r}/step{s}.*``, ``tpcheck.capture.dump``).

transformers shards ``k_proj`` / ``v_proj`` by rows with no KV-head replication, so a tp that does not divide
``num_key_value_heads`` (or ``num_attention_heads``) would split a head: refused (``check_layout``)."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from impl.config import ConfigError, ModelConfig, load_config
from impl.env import env_number
from impl.placements import Shard
from tpcheck.engines.adapter import by_point
from tpcheck.capture.copies import as_rows
from tpcheck.capture.core import install
from tpcheck.capture.maps import HF_TP_MAP
from tpcheck.capture.teacher import Teacher
from tpcheck.reference.hf import ATTN_NAME, RopeProbe, cache_kv, fill_caches, forward_one, load_hf_model, new_cache, \
    register_attention
from tpcheck.reference.reductions import Reductions
import torch.distributed as dist
from impl.distributed import close_tp, init_tp, local_device, shares_device
from tpcheck.inputs.arg_types import int_list
from tpcheck.inputs.devices import gpu_count
from tpcheck.capture.dump import DumpWriter
import importlib.util
import importlib
from impl.executor import Executor

RUNNER = "tpcheck.engines.hf_tp:HFTPRank"


def check_layout(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tp that transformers' ``tp_plan`` would shard through the middle of a head."""
    cfg.check_tp(tp)
    for field, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads)):
        if n % tp:
            raise ConfigError(f"--engine hf-tp: {field}={n} is not divisible by tp={tp}: transformers' tp_plan "
                              "shards q/k/v_proj by rows without replicating KV heads and would split a head")


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


class HFTPAdapter:
    """``tpcheck.engines.adapter.EngineAdapter`` over ``tp`` HF tp_plan ranks (started here, reused until ``shutdown``).
    ``reductions``: transformers' row-parallel layers all-reduce their partial outputs in the activations'
    dtype, rank blocks contiguous along ``in_features`` (``Shard(1)`` weights)."""

    def __init__(self, model_dir: str, tp: int, dtype: str = "float32", device: str = "cpu",
                 timeout_s: float = 300.0):
        self.tp, self.device, self.reductions = tp, device, Reductions(tp)
        self.teacher_forcing = True  # pre-hooks replace each decoder layer's input (the local pass)
        self.takes_prefix = True  # a prompt's first positions can be given as keys and values (local_rows)
        self.executor = Executor(tp, device=device, timeout_s=timeout_s, runner=RUNNER)
        self.starts: list[int] = []
        try:
            self.reload(model_dir, dtype)
        except BaseException:
            self.executor.shutdown(force=True)
            raise

    def reload(self, model_dir: str, dtype: str) -> None:
        """Load another checkpoint / dtype into the running ranks."""
        check_layout(load_config(model_dir), self.tp)
        self.executor.call("_load", str(model_dir), dtype, self.device)

    def call(self, target, *args, **kwargs) -> list:
        """``HFTPRank.call`` on every rank; returns the per-rank results."""
        return self.executor.call("call", target, *args, **kwargs)

    def begin(self, prompts: list[list[int]], decode_steps: int) -> None:
        self.starts = [0] * len(prompts)
        self.executor.call("begin", len(prompts))

    def step(self, new_tokens, teacher, capture_kv):
        per_rank = self.executor.call("step", new_tokens, self.starts, teacher, capture_kv)
        self.starts = [s + len(t) for s, t in zip(self.starts, new_tokens)]
        return by_point(per_rank)

    def take_prefix(self, lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Before the first step: prompt ``b``'s positions ``0..lens[b]-1`` are in each rank's cache as ``kv``."""
        self.executor.call("take_prefix", lens, kv)
        self.starts = list(lens)

    def close(self) -> None:
        self.executor.call("begin", 0)  # drop the caches; the ranks stay up for the next run

    def shutdown(self) -> None:
        self.executor.shutdown()


def get_adapter(pool, model_dir: str, tp: int, dtype: str = "float32", device: str = "cpu") -> HFTPAdapter:
    """``pool``'s ``HFTPAdapter`` of ``tp`` ranks on ``device`` (a resolved one; kept; reloaded when the checkpoint
    or dtype changes). Ranks that would share a GPU are refused (``check_device``)."""
    check_device(device, tp)
    kind = "hf-tp" if device == "cpu" else f"hf-tp@{device}"
    return pool.acquire(kind, tp, (str(model_dir), dtype),
                        lambda: HFTPAdapter(str(model_dir), tp, dtype, device=device),
                        lambda adapter: adapter.reload(str(model_dir), dtype), close=HFTPAdapter.shutdown)


def check_device(device: str, tp: int, gpus: int | None = None) -> None:
    """transformers' TP runs its DTensor collectives on the group's backend, and gloo has no CUDA all-gather: ``tp``
    ranks on ``device`` that would share a GPU (``impl.distributed.shares_device``; ``gpus``: the node's, counted
    unless given) are a ``ValueError`` (exit 2), where impl's engine stages them through the host instead."""
    gpus = gpu_count() if gpus is None else gpus
    if shares_device(device, tp, gpus):
        raise ValueError(f"--engine hf-tp --tp {tp} --device {device}: transformers' TP needs one GPU per rank "
                         f"(NCCL) and this machine has {gpus}; run --engine impl (its ranks share a GPU) or "
                         "--device cpu")


def start(pool, plan):
    """The adapter of one diff (``tpcheck.engines.registry``) on the plan's device; ``--dump`` is written from the
    driver (the registry's ``DumpingAdapter`` splits the budget over the ranks)."""
    return get_adapter(pool, plan.model_dir, plan.opts.tp, plan.opts.dtype, plan.device)


def _greedy_dump(rank: HFTPRank, prompts: list[list[int]], decode_steps: int, writer) -> list[list[int]]:
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


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: load with tp_plan, greedy-decode the prompts, dump every step."""
    ap = argparse.ArgumentParser(prog="torchrun ... -m tpcheck.engines.hf_tp",
                                 description="one rank of Hugging Face tp_plan, dumping its points per step "
                                             "(then: tpcheck compare DIR --model CKPT)")
    ap.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    ap.add_argument("--dump", required=True, help="dump directory (shared by every rank; new or empty)")
    ap.add_argument("--prompt-ids", type=int_list, action="append", required=True, metavar="IDS",
                    help="comma-separated token ids; repeat for more prompts")
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        ap.error("run under torchrun (WORLD_SIZE is not set); for a single process use tpcheck diff --engine hf-tp")
    tp = env_number("WORLD_SIZE", integer=True, minimum=1)
    check_layout(load_config(a.model), tp)
    init_tp(env_number("RANK", integer=True), tp, None, device=a.device)
    try:
        rank = HFTPRank(a.model, a.dtype, a.device)
        writer = DumpWriter(a.dump, rank.rank, tp, a.dtype, "hf-tp", model=a.model)
        out = _greedy_dump(rank, a.prompt_ids, a.decode_steps, writer)
        if rank.rank == 0:
            print(f"dumped {a.decode_steps + 1} step(s) of {tp} rank(s) to {a.dump}; generated {out}")
    finally:
        close_tp()
    return 0


if __name__ == "__main__":
    sys.exit(main())
