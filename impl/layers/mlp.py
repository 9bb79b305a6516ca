"""The gated MLP of every family, ``down(silu(gate(x)) * up(x))``, tensor-parallel as vLLM shards it:
``gate_up_proj`` column-parallel (``gate | up``, ``I/tp`` rows of each per rank), ``down_proj`` row-parallel
(one all-reduce, its bias added once). A dense decoder layer's ``mlp``; a MoE block's ``shared_expert``
(built with ``reduce_results=False``: its partial sum joins the routed experts' in the block's one all-reduce)."""
from __future__ import annotations

import torch
from torch import nn

from impl.layers.activation import ACTIVATIONS
from impl.layers.linear import MergedColumnParallelLinear, QuantScheme, RowParallelLinear
from impl.quant_gptq import layer_name


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` of width ``intermediate_size``; biases on all three when ``bias``; ``act``: a
    name in ``impl.layers.activation.ACTIVATIONS`` (``silu``; Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, reduce_results: bool = True,
                 quant: QuantScheme | None = None, act: str = "silu"):
        super().__init__()
        n = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [n, n], bias=bias, dtype=dtype, quant=quant)
        self.act_fn = ACTIVATIONS[act]()
        with layer_name("down_proj"):
            self.down_proj = RowParallelLinear(n, hidden_size, bias=bias, dtype=dtype, reduce_results=reduce_results,
                                               quant=quant)
        self.output_placement = self.down_proj.output_placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
