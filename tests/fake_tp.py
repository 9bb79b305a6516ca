"""Simulated tensor-parallel ranks in one process, for unit tests of the parallel layers and the loader.

The layers read ``get_tp_rank()`` / ``get_tp_size()`` at construction and call ``all_reduce`` / ``gather``
in forward, all imported by name into ``impl.layers.linear``, ``impl.layers.embedding`` and ``impl.layers.moe``.  ``fake_rank``
patches those names so that code run inside it (construction, weight loading, forward) behaves as rank
``rank`` of a group of ``tp`` with the collectives replaced by identities that count their calls.  The
test then reassembles the per-rank outputs itself with ``combine`` according to a placement.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch

import impl.distributed
import impl.layers.embedding
import impl.layers.linear
import impl.layers.moe
from impl.placements import Fused, Partial, Replicate, Shard

PATCHED_MODULES = (impl.layers.linear, impl.layers.embedding, impl.layers.moe, impl.distributed)


@contextlib.contextmanager
def fake_rank(rank: int, tp: int):
    """Within the block, the layer modules see rank ``rank`` of ``tp``; collectives are identities.

    Yields a Counter of collective calls (``all_reduce``, ``gather``) made inside the block."""
    assert 0 <= rank < tp
    calls: Counter = Counter()

    def all_reduce(x):
        calls["all_reduce"] += 1
        return x

    def gather(x, dim=-1, dst=0):
        calls["gather"] += 1
        return x

    def all_gather(x, dim=-1):
        raise AssertionError("all_gather is not expected in a layer forward")

    fakes = {"get_tp_rank": lambda: rank, "get_tp_size": lambda: tp, "all_reduce": all_reduce,
             "gather": gather, "all_gather": all_gather}
    with contextlib.ExitStack() as stack:
        for mod in PATCHED_MODULES:
            for name, fn in fakes.items():
                if hasattr(mod, name):
                    stack.enter_context(mock.patch.object(mod, name, fn))
        yield calls


def build_ranks(tp: int, factory):
    """``[factory() built as rank r of tp for r in range(tp)]``."""
    mods = []
    for r in range(tp):
        with fake_rank(r, tp):
            mods.append(factory())
    return mods


def _replicas_equal(xs, what):
    for x in xs[1:]:
        assert torch.equal(x, xs[0]), f"{what}: ranks that should hold identical copies differ"
    return xs[0]


def combine(outs: list[torch.Tensor], placement, dim: int | None = None) -> torch.Tensor:
    """Reassemble the full tensor from the ranks' local tensors ``outs`` (rank order) under ``placement``.

    ``dim`` overrides the placement's dim (to reassemble a column-parallel *weight* along dim 0, whose
    output placement is declared on the last dim)."""
    tp = len(outs)
    if isinstance(placement, Replicate):
        return _replicas_equal(outs, "Replicate")
    if isinstance(placement, Partial):
        return torch.stack(outs).sum(0)
    if isinstance(placement, Shard):
        d = placement.dim if dim is None else dim
        rep = placement.replicas
        assert tp % rep == 0, f"tp={tp} not a multiple of replicas={rep}"
        chunks = []
        for g in range(tp // rep):
            chunks.append(_replicas_equal(outs[g * rep:(g + 1) * rep], f"Shard replicas group {g}"))
        return torch.cat(chunks, dim=d)
    if isinstance(placement, Fused):
        d = -1 if dim is None else dim
        widths = [w for _, w, _ in placement.parts]
        for o in outs:
            assert o.shape[d] == sum(widths), f"local width {o.shape[d]} != sum of fused parts {widths}"
        split = [o.split(widths, dim=d) for o in outs]
        parts = [combine([s[i] for s in split], p, dim=d) for i, (_, _, p) in enumerate(placement.parts)]
        return torch.cat(parts, dim=d)
    raise TypeError(f"unknown placement {placement!r}")
