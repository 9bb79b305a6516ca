"""The public engine: ``impl.LLM``. It validates requests, schedules them (continuous batching over a
paged KV cache), drives the TP workers step by step and samples on the driver."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from impl.block_manager import BlockManager
from impl.config import load_config, parse_dtype
from impl.executor import Executor, LocalExecutor
from impl.pipeline import layer_partition, pipeline_shape
from impl.sampler import sample
from impl.sampling_params import SamplingParams
from impl.scheduler import Scheduler
from impl.sequence import Sequence
from impl.shard_plan import shard_plan


@dataclass(frozen=True)
class CacheConfig:
    """How many sequences and tokens the scheduler batches and how the paged KV cache is sized and shared; fixed
    for an engine's life (``LLM.load`` keeps them).

    ``kv_cache_bytes`` is the per-rank budget the default number of KV blocks fills, capped at what
    ``max_num_seqs`` sequences of the model's maximum length could use; ``max_num_batched_tokens`` None means
    ``max(8192, max_position_embeddings)``."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True


class LLM:
    """``with LLM(model_dir, tp_size=2) as llm: llm.logits([1, 2, 3])`` — closing it stops the workers.

    ``num_kv_blocks`` defaults to what ``cache.kv_cache_bytes`` (per rank) holds, capped at what
    ``cache.max_num_seqs`` sequences of the model's maximum length could use (``CacheConfig``).
    ``ep_size``: a mixture-of-experts model's experts split over ``ep_size`` groups of the ``tp_size`` ranks
    (``impl.layers.moe``; ``tp_size % ep_size == 0``); 1 shards every expert over all ranks.
    ``pp_size``: pipeline stages of ``tp_size`` ranks each (``impl.pipeline``): a stage count, the layers split by
    vLLM's rule, or the layers per stage (``"3,3,2"``); the driver schedules and samples, the logits come from
    TP rank 0 of the last stage.
    ``set_batch_invariant(True)``: each request's numbers bit for bit the same whatever else is batched with it
    (``impl.batch_invariant``)."""

    def __init__(self, model_dir: str | os.PathLike, tp_size: int = 1, dtype: str = "float32", block_size: int = 16,
                 num_kv_blocks: int | None = None, cache: CacheConfig | None = None, device: str = "cpu",
                 timeout_s: float = 300.0, ep_size: int = 1, pp_size: int | str | tuple[int, ...] = 1):
        cache = cache or CacheConfig()
        self.tp_size, self.ep_size, self.device = tp_size, ep_size, device
        self.pp_size, self.pp_partition = pipeline_shape(pp_size)
        self.batch_invariant = False
        self.logits_rank = (self.pp_size - 1) * tp_size  # TP rank 0 of the last stage (global rank)
        self.max_num_seqs, self.kv_cache_bytes = cache.max_num_seqs, cache.kv_cache_bytes
        self.enable_prefix_caching, self._tokenizer = cache.enable_prefix_caching, None
        self._num_kv_blocks, self._max_batched = None, cache.max_num_batched_tokens
        cfg = load_config(model_dir)  # refuse bad configs before any worker starts
        cfg.check_tp(tp_size, ep_size)
        layer_partition(cfg.num_layers, self.pp_size, self.pp_partition)
        under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        self.executor = (LocalExecutor if under_torchrun else Executor)(tp_size, device=device, timeout_s=timeout_s,
                                                                        pp_size=self.pp_size)
        try:
            self.load(model_dir, dtype, block_size, num_kv_blocks)
        except BaseException:
            self.close()
            raise

    def load(self, model_dir: str | os.PathLike, dtype: str | None = None, block_size: int | None = None,
             num_kv_blocks: int | None = None, ep_size: int | None = None) -> None:
        """(Re)load the workers with a checkpoint and cache layout, keeping the worker processes.
        ``dtype`` / ``block_size`` / ``ep_size`` None keep the current ones; ``num_kv_blocks`` None sizes the cache."""
        cfg = load_config(model_dir)
        ep_size = self.ep_size if ep_size is None else ep_size
        cfg.check_tp(self.tp_size, ep_size)
        self.partition = layer_partition(cfg.num_layers, self.pp_size, self.pp_partition)
        self.ep_size = ep_size
        if block_size is not None:
            if block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {block_size}")
            self.block_size = block_size
        if num_kv_blocks is not None and num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        self._num_kv_blocks = num_kv_blocks  # None: sized from kv_cache_bytes
        self.model_dir, self.cfg, self._tokenizer = str(model_dir), cfg, None
        self.dtype = parse_dtype(dtype) if dtype is not None else self.dtype
        self.num_kv_blocks = self._num_kv_blocks or self._default_num_blocks(self.kv_cache_bytes, self.max_num_seqs)
        self.max_num_batched_tokens = self._max_batched or max(8192, cfg.max_position)
        self.executor.call("_load", self.model_dir, str(self.dtype).removeprefix("torch."), self.device,
                           ep_size=self.ep_size, **({"pp_partition": self.partition} if self.pp_size > 1 else {}))
        self.executor.call("allocate_kv_cache", self.num_kv_blocks, self.block_size)
        self.reset_scheduler()

    def set_batch_invariant(self, on: bool) -> None:
        """Switch batch-invariant mode on every rank (``impl.batch_invariant``); it stays across ``load``."""
        self.executor.call("set_batch_invariant", bool(on))
        self.batch_invariant = bool(on)

    def reload(self) -> None:
        """Reload the current checkpoint and cache layout (undoes anything done to the ranks' models)."""
        self.load(self.model_dir, None, self.block_size, self._num_kv_blocks, self.ep_size)

    def _default_num_blocks(self, budget: int, max_num_seqs: int) -> int:
        plan = shard_plan(self.cfg, self.tp_size, self.ep_size)
        # a rank caches its stage's layers only: the largest stage bounds the budget
        per_block = plan.kv_cache_bytes_per_block(max(self.partition), self.block_size, self.dtype.itemsize)
        c = self.cfg
        cap = max_num_seqs * -(-c.max_position // self.block_size)
        return max(1, min(budget // per_block, cap))

    def reset_scheduler(self) -> None:
        """A fresh scheduler over an empty block pool: forgets the prefix cache and any queued or half-run
        sequence (the KV cache tensors on the ranks are left as they are). For whoever changes what the
        ranks compute (fault injection, hooks): blocks the old model wrote are not reused."""
        bm = BlockManager(self.num_kv_blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = Scheduler(bm, self.max_num_seqs, self.max_num_batched_tokens, set(self.cfg.eos_token_ids))

    # ---- requests --------------------------------------------------------------------------------------
    def _check_prompt(self, i: int, ids: list[int], extra: int = 0) -> None:
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocab [0, {self.cfg.vocab_size})")
        if len(ids) + extra > self.cfg.max_position:
            raise ValueError(f"prompt {i}: {len(ids)} tokens + {extra} new exceed the model's maximum of "
                             f"{self.cfg.max_position} positions (max_position_embeddings)")

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def _ids(self, prompts) -> list[list[int]]:
        return [self.tokenizer().encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]

    def logits(self, token_ids: list[int] | str) -> torch.Tensor:
        """``[len, vocab]`` logits of one prompt (vocab = the checkpoint's real vocab size)."""
        ids = self._ids([token_ids])[0]
        self._check_prompt(0, ids)
        return self.executor.call("logits", ids)[self.logits_rank]

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[list[int]]:
        """New token ids of each prompt, in order. Every request is checked before any work starts."""
        ids = self._ids(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"{len(plist)} SamplingParams for {len(ids)} prompts")
        for i, (p, sp) in enumerate(zip(ids, plist)):
            self._check_prompt(i, p, sp.max_tokens)
        seqs = [Sequence(p, sp, self.block_size) for p, sp in zip(ids, plist)]
        for s in seqs:
            self.scheduler.check(s)
        gens = {s.seq_id: (torch.Generator().manual_seed(s.params.seed) if s.params.seed is not None else None)
                for s in seqs}
        bar = _progress(sum(sp.max_tokens for sp in plist)) if progress else None
        try:
            for s in seqs:
                self.scheduler.add(s)
            while not self.scheduler.is_finished():
                batch, is_prefill = self.scheduler.schedule()
                inputs = [(s.token_ids[s.num_cached_tokens:], s.num_cached_tokens, s.block_table) if is_prefill
                          else ([s.last_token], len(s) - 1, s.block_table) for s in batch]
                logits = self.executor.call("step", inputs)[self.logits_rank]
                tokens = sample(logits, [s.params for s in batch], [gens[s.seq_id] for s in batch])
                self.scheduler.postprocess(batch, tokens.tolist())
                if bar is not None:
                    bar.update(len(batch))
        except BaseException:
            self.reset_scheduler()  # half-run sequences must not hold blocks for the next request
            raise
        finally:
            if bar is not None:
                bar.close()
        return [s.completion_token_ids for s in seqs]

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def kv_cache_shapes(self) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        """Per rank (global), per layer of its stage: the (K, V) cache tensor shapes."""
        return self.executor.call("kv_cache_shapes")

    def call(self, target: Callable | str, *args, **kwargs) -> list:
        """Run ``target(runner, *args, **kwargs)`` on every rank (hooks, faults, inspection); ``target`` is a
        module-level function (each rank imports it by name) or its ``"module:function"`` name."""
        if callable(target):
            name = f"{target.__module__}:{target.__qualname__}"
            if "." in target.__qualname__ or target.__module__ == "__main__":
                raise ValueError(f"LLM.call needs a module-level function a rank can import, got {name}")
            target = name
        return self.executor.call("call", target, *args, **kwargs)

    def close(self) -> None:
        ex = getattr(self, "executor", None)
        if ex is not None:
            ex.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's tokenizer. ``tokenizer.json`` is loaded as is (AutoTokenizer would pick the class
    from config.json's model type and ignore a tokenizer.json of another kind); never remote code."""
    d = Path(model_dir)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{model_dir} has no tokenizer: pass token ids instead of text")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    return (PreTrainedTokenizerFast if (d / "tokenizer.json").is_file() else AutoTokenizer).from_pretrained(str(d))


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, unit="tok", desc="generate", leave=False)
