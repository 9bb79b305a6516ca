"""Tensor-parallel linear layers with vLLM's contracts.

Weights follow ``nn.Linear``: ``W`` is ``[out_features, in_features]`` and ``y = x W^T + b``.

* Column parallel: ``W`` is split along dim 0 (out_features); rank r holds rows ``[r*out/tp, (r+1)*out/tp)``
  and produces that slice of ``y`` with no communication.
* Row parallel: ``W`` is split along dim 1 (in_features); rank r multiplies its slice of ``x`` and the
  partial products are summed with one all-reduce. The bias is added once (by rank 0, before the sum).
  With ``reduce_results=False`` the rank's partial product is returned and the caller sums it (vLLM's
  contract: a MoE block reduces its routed and shared experts in one all-reduce).
* Replicated: every rank holds the whole ``W`` and computes the whole ``y`` (a MoE router, the shared
  expert's gate).

Each parameter carries ``weight_loader(param, loaded, shard_id=None)``. ``loaded`` is the full checkpoint
tensor, or any object with ``.shape`` and ``.narrow(dim, start, length)`` (the loader passes lazy safetensors
slices, so a rank reads only its own rows or columns).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl.distributed import all_reduce, get_tp_rank, get_tp_size
from impl.placements import Fused, Partial, Replicate, Shard
from impl.shard_plan import kv_split


class ShapeMismatch(ValueError):
    """Checkpoint tensor shape differs from what the layer expects; the loader adds the tensor name."""


def check_shape(loaded, expected: tuple[int, ...]) -> None:
    got = tuple(loaded.shape)
    if got != tuple(expected):
        raise ShapeMismatch(f"checkpoint shape {list(got)} != expected {list(expected)}")


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by tp_size={b}")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)


class ReplicatedLinear(LinearBase):
    """``[out, in]`` held whole by every rank; output ``Replicate`` (vLLM's ``ReplicatedLinear``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__(input_size, output_size, bias, dtype)
        self.input_size, self.output_size = input_size, output_size
        self.output_placement = Replicate()

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """``[out, in]`` split along out: rank r holds rows ``[r*out/tp, (r+1)*out/tp)``; output ``Shard(-1)``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        tp = get_tp_size()
        super().__init__(input_size, divide(output_size, tp, "output_size"), bias, dtype)
        self.input_size, self.output_size = input_size, output_size
        self.output_placement = Shard(-1)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (``gate_up``: gate | up).

    Local weight = ``[gate rows of rank r ; up rows of rank r]``, so the output is ``Fused`` with each part
    ``Shard(-1)``. ``shard_id`` is the index of the part being loaded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, names: tuple[str, ...] = ("gate", "up")):
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.output_sizes = output_sizes
        local = [divide(s, self.tp_size, "output_size") for s in output_sizes]
        self.output_placement = Fused(tuple((n, w, Shard(-1)) for n, w in zip(names, local)))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int = None) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q | k | v projection, split by heads.

    Rank r holds query heads ``[r*H/tp, (r+1)*H/tp)``. KV heads are partitioned when ``tp <= K``
    (rank r holds KV heads ``[r*K/tp, (r+1)*K/tp)``) and replicated when ``tp > K``: each KV head is
    copied to ``replicas = tp / K`` consecutive ranks, rank r holding KV head ``r // replicas``.
    Local output width = ``(H/tp + 2*max(K/tp, 1)) * head_dim``; placement ``Fused(q, k, v)``."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True, dtype: torch.dtype = torch.float32):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if tp <= total_num_kv_heads:
            divide(total_num_kv_heads, tp, "num_key_value_heads")
        else:
            divide(tp, total_num_kv_heads, "tp_size over num_kv_heads")
        self.num_kv_heads, self.kv_replicas = kv_split(total_num_kv_heads, tp)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.totals = {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim,
                       "v": total_num_kv_heads * head_dim}
        # ColumnParallelLinear takes the global width; with KV replication it counts each replica.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias, dtype)
        kv = Shard(-1, self.kv_replicas)
        self.output_placement = Fused((("q", self.q_size, Shard(-1)), ("k", self.kv_size, kv), ("v", self.kv_size, kv)))

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str = None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        check_shape(loaded, (self.totals[shard_id], *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """``[out, in]`` split along in: rank r holds columns ``[r*in/tp, (r+1)*in/tp)`` and consumes the matching
    ``Shard(-1)`` input; ``y = all_reduce(x_r W_r^T) + b`` with the bias added once. Output ``Replicate``;
    ``Partial`` with ``reduce_results=False`` (the caller all-reduces ``x_r W_r^T + [r == 0] b``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 reduce_results: bool = True):
        tp = get_tp_size()
        super().__init__(divide(input_size, tp, "input_size"), output_size, bias, dtype)
        self.input_size, self.output_size, self.reduce_results = input_size, output_size, reduce_results
        self.output_placement = Replicate() if reduce_results else Partial()

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded
            check_shape(loaded, param.shape)
            param.data.copy_(loaded.narrow(0, 0, param.shape[0]))
            return
        cols = param.shape[1]
        check_shape(loaded, (self.output_size, self.input_size))
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)
        return all_reduce(y) if self.reduce_results else y
