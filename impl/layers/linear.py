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

Quantized (``quant``: an ``impl.quant.Int8Scheme``): the layer's quant method (``impl.quant`` INT8,
``impl.quant_fp8`` FP8) creates an int8 / float8_e4m3fn ``weight`` (sharded
by the same ``weight_loader``) and a ``weight_scale`` loaded by ``scale_loader``: a channel scale ``[out, 1]``
follows the output rows (``channel_scale_loader``: the weight's own row rule on column-parallel layers, whole on
row-parallel and replicated ones); a per-tensor scale fills its fused partition's slot (``partition_index``).
``forward`` then calls the method's ``apply`` instead of ``F.linear``.

GPTQ W4A16 (``quant``: an ``impl.quant_gptq.GptqScheme``): ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, all
loaded by ``gptq_loader``: on column-parallel and replicated layers along the output columns of the layer's
``column_slot(shard_id)`` (a fused partition's slot), on row-parallel ones along the input rows
(``impl.quant_gptq``'s module docstring has the math and the rules).

AWQ W4A16 (``quant``: an ``impl.quant_awq.AwqScheme``): ``qweight`` / ``qzeros`` / ``scales`` loaded by
``awq_loader``, by the same column slots and row blocks as GPTQ's, ``qweight`` packed along the output
(``impl.quant_awq``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import batch_invariant
from impl.distributed import all_reduce, get_tp_rank, get_tp_size
from impl.errors import ShapeMismatch, check_shape  # noqa: F401 (re-exported: the loader and layers import them here)
from impl.placements import Fused, Partial, Replicate, Shard
from impl.quant import Int8LinearMethod, Int8Scheme, per_tensor_slot
from impl.quant_awq import AwqLinearMethod, AwqScheme
from impl.quant_fp8 import Fp8LinearMethod
from impl.quant_gptq import GptqLinearMethod, GptqScheme, load_columns, load_rows
from impl.shard_plan import kv_split

QuantScheme = Int8Scheme | GptqScheme | AwqScheme  # a quantized checkpoint's scheme (impl.quant*, config.quant)


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by tp_size={b}")
    return a // b


class LinearBase(nn.Module):
    quant_row_parallel = False  # GPTQ / AWQ: the input dim is sharded (RowParallelLinear)

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype,
                 quant: QuantScheme | None = None, partitions: list[int] | None = None, in_total: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if not getattr(quant, "quantizes_weights", True):
            quant = None  # a KV-cache-only scheme (impl.quant_kv): float linears
        if isinstance(quant, (GptqScheme, AwqScheme)):
            self.quant_method = (GptqLinearMethod if isinstance(quant, GptqScheme) else AwqLinearMethod)(quant)
            self.quant_method.create_weights(self, out_local, in_local, in_total or in_local, self.quant_row_parallel)
        elif quant is not None:
            self.quant_method = Fp8LinearMethod(quant) if quant.num_type == "float" else Int8LinearMethod(quant)
            self.quant_method.create_weights(self, out_local, in_local, partitions or [out_local])
        else:
            self.quant_method = None
            self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` on this rank's weight: ``F.linear``, or the quant method's ``apply``."""
        if self.quant_method is not None:
            return batch_invariant.linear(x, lambda rows: self.quant_method.apply(self, rows, bias))
        return batch_invariant.linear(x, lambda rows: F.linear(rows, self.weight, bias))

    def partition_index(self, shard_id) -> int:
        """Which fused partition ``shard_id`` names (a per-tensor weight scale's slot); 0 on an unfused layer."""
        return 0

    def column_slot(self, shard_id) -> tuple[int, int, int, int]:
        """GPTQ / AWQ: ``(local offset, width, source start, source width)`` in output columns of ``shard_id``'s
        partition (the float weight's row rule, on the output dim)."""
        n = self.scales.shape[1]
        return 0, n, self.tp_rank * n, n * self.tp_size

    def gptq_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """One GPTQ tensor (``qweight``, ``qzeros``, ``scales``, ``g_idx``) into this rank's slot; a ``g_idx``
        without act-order must be ``k // group_size`` (what the kernels assume)."""
        name = next(n for n in ("qweight", "qzeros", "scales", "g_idx") if getattr(self, n) is param)
        before = param.data.clone() if name == "g_idx" and getattr(self, "gptq_g_idx_loaded", False) else None
        if self.quant_row_parallel:
            load_rows(self, name, param, loaded)
        else:
            load_columns(self, name, param, loaded, self.column_slot(shard_id))
        if before is not None and not torch.equal(before, param.data):
            raise ShapeMismatch(f"g_idx of partition {shard_id!r} differs from the fused layer's other partitions' "
                                "(they share one input: one act-order permutation)")
        if name == "g_idx":
            self.gptq_g_idx_loaded = True
        if name == "g_idx" and not self.quant_method.scheme.desc_act:
            n = param.shape[0]
            start = self.tp_rank * n if self.quant_row_parallel else 0
            want = torch.arange(start, start + n, dtype=torch.int32) // self.quant_method.scheme.group_size
            if not torch.equal(param.data, want):
                raise ShapeMismatch("g_idx is not k // group_size while quantization_config.desc_act is false")

    def awq_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """One AWQ tensor (``qweight``, ``qzeros``, ``scales``) into this rank's slot: GPTQ's rules, with
        ``qweight`` packed along the output like ``qzeros``."""
        name = next(n for n in ("qweight", "qzeros", "scales") if getattr(self, n) is param)
        if self.quant_row_parallel:
            load_rows(self, name, param, loaded)
        else:
            load_columns(self, name, param, loaded, self.column_slot(shard_id), packed=("qweight", "qzeros"))

    def channel_scale_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """A per-channel weight scale ``[out, 1]`` follows the weight's output rows."""
        self.weight_loader(param, loaded, shard_id)

    def input_scale_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """A static FP8 ``input_scale`` ``[1]``: into its fused partition's slot (every rank holds them all)."""
        per_tensor_slot(param, loaded, self.partition_index(shard_id))

    def scale_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """``weight_scale``: per channel (2-D) by the row rule, per tensor (1-D) into its partition's slot."""
        if param.dim() == 1:
            per_tensor_slot(param, loaded, self.partition_index(shard_id))
        else:
            self.channel_scale_loader(param, loaded, shard_id)


class ReplicatedLinear(LinearBase):
    """``[out, in]`` held whole by every rank; output ``Replicate`` (vLLM's ``ReplicatedLinear``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 quant: QuantScheme | None = None):
        super().__init__(input_size, output_size, bias, dtype, quant)
        self.input_size, self.output_size = input_size, output_size
        self.output_placement = Replicate()

    def column_slot(self, shard_id) -> tuple[int, int, int, int]:
        n = self.scales.shape[1]
        return 0, n, 0, n

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``[out, in]`` split along out: rank r holds rows ``[r*out/tp, (r+1)*out/tp)``; output ``Shard(-1)``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 quant: QuantScheme | None = None, partitions: list[int] | None = None):
        tp = get_tp_size()
        super().__init__(input_size, divide(output_size, tp, "output_size"), bias, dtype, quant, partitions)
        self.input_size, self.output_size = input_size, output_size
        self.output_placement = Shard(-1)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (``gate_up``: gate | up).

    Local weight = ``[gate rows of rank r ; up rows of rank r]``, so the output is ``Fused`` with each part
    ``Shard(-1)``. ``shard_id`` is the index of the part being loaded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, names: tuple[str, ...] = ("gate", "up"),
                 quant: QuantScheme | None = None):
        local = [divide(s, get_tp_size(), "output_size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, quant, local)
        self.output_sizes = output_sizes
        self.output_placement = Fused(tuple((n, w, Shard(-1)) for n, w in zip(names, local)))

    def partition_index(self, shard_id) -> int:
        return shard_id

    def column_slot(self, shard_id) -> tuple[int, int, int, int]:
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, size, self.tp_rank * size, self.output_sizes[shard_id]

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
                 bias: bool = True, dtype: torch.dtype = torch.float32, quant: QuantScheme | None = None):
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
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias, dtype, quant,
                         [self.q_size, self.kv_size, self.kv_size])
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

    def partition_index(self, shard_id) -> int:
        return "qkv".index(shard_id)

    def column_slot(self, shard_id) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank * self.q_size, self.totals["q"]
        offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
        return offset, self.kv_size, self.tp_rank // self.kv_replicas * self.kv_size, self.totals[shard_id]


class RowParallelLinear(LinearBase):
    """``[out, in]`` split along in: rank r holds columns ``[r*in/tp, (r+1)*in/tp)`` and consumes the matching
    ``Shard(-1)`` input; ``y = all_reduce(x_r W_r^T) + b`` with the bias added once. Output ``Replicate``;
    ``Partial`` with ``reduce_results=False`` (the caller all-reduces ``x_r W_r^T + [r == 0] b``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 reduce_results: bool = True, quant: QuantScheme | None = None):
        tp = get_tp_size()
        self.quant_row_parallel = tp > 1
        super().__init__(divide(input_size, tp, "input_size"), output_size, bias, dtype, quant, in_total=input_size)
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

    def channel_scale_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """The output is not split: every rank holds the whole ``[out, 1]`` channel scale."""
        check_shape(loaded, param.shape)
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = self.matmul(x, bias)
        return all_reduce(y) if self.reduce_results else y
