"""Reassemble full tensors from per-rank local tensors by their declared placement.

Disagreement between ranks that should hold the same values (``Replicate`` points, KV-head replicas) is
itself a finding: it is returned with the ranks and the size of the disagreement, never silently averaged."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.placements import Fused, Partial, Replicate, Shard


@dataclass
class Unsharded:
    name: str
    tensor: torch.Tensor
    rank_mismatch: str = ""  # e.g. "ranks 0 vs 1 differ by 0.37"


def _agree(name: str, tensors: list[tuple[int, torch.Tensor]]) -> str:
    r0, t0 = tensors[0]
    for r, t in tensors[1:]:
        if t.shape != t0.shape:
            return f"ranks {r0} vs {r} hold shapes {list(t0.shape)} vs {list(t.shape)}"
        if not torch.equal(t, t0):
            d = (t.double() - t0.double()).abs()
            return f"ranks {r0} vs {r} differ by up to {float(d.nan_to_num(float('inf')).max()):.3g}"
    return ""


def unshard(name: str, placement, tensors: list[torch.Tensor | None]) -> list[Unsharded]:
    """``tensors[r]`` is rank r's local tensor (None where a rank does not hold the point). Returns one
    entry, or one per part of a ``Fused`` placement (named ``name + part``)."""
    held = [(r, t) for r, t in enumerate(tensors) if t is not None]
    if not held:
        raise ValueError(f"{name}: no rank returned it")
    if isinstance(placement, Fused):
        widths = [w for _, w, _ in placement.parts]
        out: list[Unsharded] = []
        for (part, _, sub) in placement.parts:
            idx = [p for p, _, _ in placement.parts].index(part)
            pieces = [None if t is None else t.split(widths, dim=-1)[idx] for t in tensors]
            out += unshard(name + part, sub, pieces)
        return out
    if isinstance(placement, Replicate):
        return [Unsharded(name, held[0][1], _agree(name, held))]
    if isinstance(placement, Partial):
        return [Unsharded(name, torch.stack([t for _, t in held]).sum(0))]
    if isinstance(placement, Shard):
        groups, mismatch = [], ""
        for start in range(0, len(tensors), placement.replicas):
            replicas = [(r, tensors[r]) for r in range(start, start + placement.replicas)]
            mismatch = mismatch or _agree(name, replicas)
            groups.append(replicas[0][1])
        return [Unsharded(name, torch.cat(groups, dim=placement.dim), mismatch)]
    raise TypeError(f"{name}: unknown placement {placement!r}")
