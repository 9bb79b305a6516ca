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
