"""Hugging Face's own tensor parallelism as an engine under test: ``tpcheck diff --engine hf-tp``.

Each rank loads the family's HF class (``Qwen2ForCausalLM``, ...) with ``from_pretrained(..., tp_plan="auto")``
(transformers shards the weights as DTensors and installs its column/row-parallel forwards; gloo on CPU, NCCL
on GPU) and captures its points
with ``tpcheck.capture`` and ``HF_TP_MAP`` (placements read from the DTensor weights), plus each rank's KV
cache. Two ways to run it:

* live: ``HFTPAdapter`` starts the ranks (impl's rank process management, ``impl.executor.Executor``, with
  ``tpcheck.engines.hf_tp.ranks.HFTPRank`` as the rank-side object) and hands each step's points to ``tpcheck.compare_engine``;
* under torchrun, dumping (any number of nodes; ``tpcheck/engines/hf_tp/__main__.py``)::

      torchrun --nproc-per-node 2 -m tpcheck.engines.hf_tp --model CKPT --dump DIR --prompt-ids 1,2,3 --decode-steps 4
      tpcheck compare DIR --model CKPT

  (greedy decode; every rank writes ``DIR/rank{r}/step{s}.*``, ``tpcheck.capture.dump``).

transformers shards ``k_proj`` / ``v_proj`` by rows with no KV-head replication, so a tp that does not divide
``num_key_value_heads`` (or ``num_attention_heads``) would split a head: refused (``check_layout``)."""
from __future__ import annotations

import torch

from impl.config import ConfigError, ModelConfig, load_config
from impl.distributed import shares_device
from impl.executor import Executor
from tpcheck.engines.adapter import EngineAdapter, by_point
from tpcheck.inputs.devices import gpu_count
from tpcheck.reference.reductions import Reductions

RUNNER = "tpcheck.engines.hf_tp.ranks:HFTPRank"  # the rank-side object impl's executor builds in each rank


def check_layout(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tp that transformers' ``tp_plan`` would shard through the middle of a head."""
    cfg.check_tp(tp)
    for field, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads)):
        if n % tp:
            raise ConfigError(f"--engine hf-tp: {field}={n} is not divisible by tp={tp}: transformers' tp_plan "
                              "shards q/k/v_proj by rows without replicating KV heads and would split a head")


class HFTPAdapter(EngineAdapter):
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
