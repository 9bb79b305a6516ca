"""How a rank's local output of a module maps onto the full (tp=1) tensor.

Every parallel module declares ``output_placement`` so a harness can reassemble full tensors without
knowing the module's internals (compare torch DTensor's Shard / Replicate / Partial):

* ``Replicate()``            every rank holds the full tensor (they must agree).
* ``Shard(dim, replicas)``   rank r holds chunk ``r // replicas`` along ``dim``; with ``replicas > 1``
                             (KV heads replicated when tp > num_kv_heads) consecutive ranks hold copies.
* ``Partial()``              the full tensor is the sum over ranks (a value captured before its all-reduce).
* ``Fused(parts)``           the last dim is a concatenation of named parts of the given local widths, each
                             with its own placement (``qkv``: q | k | v; ``gate_up``: gate | up). Split each
                             rank's tensor into parts first, then unshard each part: concatenating ranks
                             first would interleave them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Shard:
    dim: int = -1
    replicas: int = 1


@dataclass(frozen=True)
class Partial:
    pass


@dataclass(frozen=True)
class Fused:
    parts: tuple[tuple[str, int, "Placement"], ...]  # (name, local width, placement) along the last dim


Placement = Replicate | Shard | Partial | Fused
