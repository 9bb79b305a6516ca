"""Reassemble full tensors from per-rank local tensors by their declared placement.

Ranks that should hold the same values (``Replicate`` points, KV-head replicas) are compared, never silently
averaged. How far their floating-point values differ is measured, not judged here: a correct engine may add a
reduction's partials in a rank-dependent order (vLLM's CPU shared-memory all-reduce at tp >= 3), so its replicas
legitimately differ by a few ulps. ``rank_spread`` is that difference, a figure; the replicas that differ are kept
(``replicas``) so that each is judged against the golden as the first one is (``tpcheck.pipeline.rows``): a rank
that holds other data errs against the golden, one that rounded in another order does not. Ranks holding other
shapes, or other integer values (expert ids), are a structural finding in ``rank_mismatch``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.measure.wording import shape_text


@dataclass
class Unsharded:
    name: str
    tensor: torch.Tensor
    rank_mismatch: str = ""         # structural: e.g. "ranks 0 vs 1 hold shapes 2 x 8 vs 2 x 4"
    rank_spread: float = math.nan   # worst ||t_r - t_0|| / ||t_0|| over replicas; NaN: no replicas
    rank_spread_by: str = ""        # the ranks of that worst pair, e.g. "0 vs 2"
    # rank -> the whole point as that rank's replicas make it, for each rank whose replica is not bit-identical to
    # the first one's (empty: none differ); ``tensor`` is the first replicas'
    replicas: dict[int, torch.Tensor] = field(default_factory=dict)
    # a point sharded along its last dim: each group's (ranks, first column, end column); ``tensor``'s columns
    # ``a:b`` are ``ranks[0]``'s. Empty for a point not split by columns (replicated, summed, one group)
    columns: tuple[tuple[tuple[int, ...], int, int], ...] = ()

    def rank_fields(self) -> dict:
        """The ``Row`` columns of the ranks' agreement."""
        return {"rank_spread": self.rank_spread, "rank_spread_by": self.rank_spread_by}


def rank_spread(t0: torch.Tensor, t: torch.Tensor) -> float:
    """``||t - t0|| / ||t0||`` in float64: 0 where the two are bit-identical, infinite where ``t0`` is all zero and
    ``t`` is not. Non-finite elements must sit at the same places with the same values in both, else the spread is
    infinite (a NaN on one rank only is never rounding)."""
    if torch.equal(t, t0):
        return 0.0
    a, d = t0.detach().to(torch.float64), t.detach().to(torch.float64, copy=True)
    bad = ~torch.isfinite(a)
    if not torch.equal(bad, ~torch.isfinite(d)) or not torch.equal(a[bad].nan_to_num(0.0), d[bad].nan_to_num(0.0)):
        return math.inf
    d.sub_(a).masked_fill_(bad, 0.0)
    diff, ref = float(d.norm()), float((a.masked_fill(bad, 0.0) if bool(bad.any()) else a).norm())
    return diff / ref if ref > 0 else (math.inf if diff > 0 else 0.0)


def _agree(tensors: list[tuple[int, torch.Tensor]]) -> tuple[str, float, str, dict[int, torch.Tensor]]:
    """(structural finding, spread, its ranks, the replicas that differ from the first one by rank) of replicas
    ``[(rank, tensor), ...]`` against the first one."""
    r0, t0 = tensors[0]
    note, worst, by, differ = "", (math.nan if len(tensors) < 2 else 0.0), "", {}
    for r, t in tensors[1:]:
        if t.shape != t0.shape:
            return f"ranks {r0} vs {r} hold shapes {shape_text(t0.shape)} vs {shape_text(t.shape)}", math.nan, "", {}
        if not (t0.is_floating_point() and t.is_floating_point()):  # ids, counts: no rounding can change them
            n = int((t != t0).sum())
            note = note or (f"ranks {r0} vs {r} hold different values ({n} of {t.numel()} elements)" if n else "")
            if n:  # kept: expert ids in another order are the same route (tpcheck.pipeline.routes)
                differ[r] = t
            continue
        s = rank_spread(t0, t)
        if s > 0:
            differ[r] = t
        if s > worst:
            worst, by = s, f"{r0} vs {r}"
    return note, worst, by, differ


def _worst(found: list[tuple[str, float, str, dict]]) -> tuple[str, float, str]:
    """The first structural finding, and the largest spread, over groups of replicas."""
    note = next((n for n, _, _, _ in found if n), "")
    spreads = [(s, by) for _, s, by, _ in found if not math.isnan(s)]
    s, by = max(spreads, key=lambda x: x[0]) if spreads else (math.nan, "")
    return note, s, by


def _columns(placement: Shard, groups: list[torch.Tensor]) -> tuple:
    """``Unsharded.columns`` of a point sharded along its last dim over more than one group (group g: ranks
    ``g * replicas ..``), else ()."""
    if len(groups) < 2 or placement.dim not in (-1, groups[0].dim() - 1):
        return ()
    out, a = [], 0
    for g, t in enumerate(groups):
        out.append((tuple(range(g * placement.replicas, (g + 1) * placement.replicas)), a, a + t.shape[-1]))
        a += t.shape[-1]
    return tuple(out)


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
        note, s, by, differ = _agree(held)
        return [Unsharded(name, held[0][1], note, s, by, differ)]
    if isinstance(placement, Partial):
        return [Unsharded(name, torch.stack([t for _, t in held]).sum(0))]
    if isinstance(placement, Shard):
        groups, found = [], []
        for start in range(0, len(tensors), placement.replicas):
            replicas = [(r, tensors[r]) for r in range(start, start + placement.replicas)]
            found.append(_agree(replicas))
            groups.append(replicas[0][1])
        note, s, by = _worst(found)
        # a differing replica of group g: the whole point with group g's part taken from that rank
        whole = {r: torch.cat(groups[:g] + [t] + groups[g + 1:], dim=placement.dim)
                 for g, f in enumerate(found) for r, t in f[3].items()} if not note else {}
        return [Unsharded(name, torch.cat(groups, dim=placement.dim), note, s, by, whole,
                          _columns(placement, groups))]
    raise TypeError(f"{name}: unknown placement {placement!r}")
