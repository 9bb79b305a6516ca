from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl.placements import Shard


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` on a ``[..., 2n]`` input laid out ``gate | up`` (the rank's local gate_up)."""

    def __init__(self):
        super().__init__()
        self.output_placement = Shard(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(SiluAndMul):
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation: HF's ``gelu_pytorch_tanh``, Gemma 3), laid out
    as ``SiluAndMul``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


#: HF's ``hidden_act`` / ``hidden_activation`` -> impl's gated activation (a name not here is refused by the config)
ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
