"""Mixture-of-experts bookkeeping of one diff pass (``tpcheck.pipeline.steps``): the routes each run took, the
router's noise floor for the near-tie rule, and which rows of a layer's routed points a flipped token leaves out.
The rule itself, and why it is sound, is ``tpcheck.judge.routing``.

* Every top-k is put in one order first (``sort_routes``): ids ascending per token, weights permuted alike, so
  ``moe.topk_weights`` compares weight of expert e with weight of expert e whatever order an engine emits.
* The propagated pass runs the engine first; the golden then follows the engine's route where it differs
  (``HFCapture.step(routes=...)``) and the references follow the golden's, so every later point of the pass
  compares like with like. The local pass reuses the golden (its inputs are the teacher): there the rows of a
  token whose route differs are left out of that layer's routed points (``Kind.routed``), counted in the row.
* ``tau`` of a layer: twice the largest router-logit error (max |ref - golden| over experts and rows) of the
  references at that point, over this and earlier steps."""
from __future__ import annotations

import logging
import re
from dataclasses import replace

import torch

from tpcheck.capture.points import KINDS, kind_of, split_point
from tpcheck.judge.routing import RouteCheck, check_routes
from tpcheck.measure.unshard import Unsharded

NEAR_TIE_FACTOR = 2.0  # tpcheck check's near_tie_flips uses the same factor on the logits
logger = logging.getLogger("tpcheck.pipeline.diff")  # the run's notes (tpcheck.pipeline.diff)


def sort_routes(points: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``points`` with every layer's ``moe.topk_ids`` sorted ascending per row and its ``moe.topk_weights``
    permuted alike (a new dict; other points as they are)."""
    out = dict(points)
    for name, ids in points.items():
        if kind_of(name).route != "ids":
            continue
        order = ids.long().argsort(-1)
        out[name] = ids.long().gather(-1, order)
        w = name[: -len("topk_ids")] + "topk_weights"
        if w in points and points[w].shape == ids.shape:
            out[w] = points[w].gather(-1, order)
    return out


def sort_unit_routes(routed: dict[str, Unsharded]) -> dict[str, Unsharded]:
    """A step's route points (``moe.topk_ids`` / ``moe.topk_weights``, unsharded) in one order (``sort_routes``),
    each replica that differs (a rank whose hidden state is ulps from the first one's: vLLM's rank-ordered
    all-reduce) in its own rank's order. A rank whose ids are the first replica's in another order chose the same
    experts: its ids replica is dropped and, with none left, the ranks' "different values" note with it (a near tie
    ordered otherwise); a rank that chose other experts keeps the note (its shard of another expert is summed in)."""
    sorted_ = sort_routes({n: u.tensor for n, u in routed.items()})
    by_rank = {r: sort_routes({n: u.replicas.get(r, u.tensor) for n, u in routed.items()})
               for r in {r for u in routed.values() for r in u.replicas}}
    out = {}
    for n, u in routed.items():
        reps, note = {r: by_rank[r][n] for r in u.replicas}, u.rank_mismatch
        if kind_of(n).route == "ids" and u.replicas:  # ranks that hold other ids (not other shapes: no replicas)
            reps = {r: t for r, t in reps.items() if not torch.equal(t, sorted_[n])}
            note = _other_experts(note, sorted_[n], reps)
        out[n] = replace(u, tensor=sorted_[n], replicas=reps, rank_mismatch=note)
    return out


def _other_experts(note: str, ids: torch.Tensor, replicas: dict[int, torch.Tensor]) -> str:
    """The ranks' note of a top-k whose replicas (sorted) still differ: which rank routes how many tokens to other
    experts; "" where none does."""
    if not replicas:
        return ""
    r = min(replicas)
    first = re.match(r"ranks (\d+) vs", note)
    n = int((replicas[r] != ids).any(-1).sum())
    return (f"ranks {first.group(1) if first else 0} vs {r} route {n} of {ids.shape[0]} tokens to different experts "
            f"(each rank computes its shard of its own choice, and the sum mixes them)")


def routes_of(points: dict[str, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """``{layer: [rows, k] ids}`` of every layer's ``moe.topk_ids`` in ``points`` (None: no MoE layer)."""
    out = {split_point(n)[0]: t.long() for n, t in points.items() if kind_of(n).route == "ids"}
    return out or None


class RouteBook:
    """One pass's routing state: the router floor per layer (``observe``), and per step the route checks and the
    rows each layer's routed points leave out (``check``, ``excluded``)."""

    def __init__(self):
        self.router_err: dict[int, float] = {}  # layer -> worst max |ref - golden| router logit so far
        self.checks: dict[int, RouteCheck] = {}  # this step: layer -> its route check

    def begin_step(self) -> None:
        self.checks = {}

    def observe(self, name: str, ref: torch.Tensor, gold: torch.Tensor) -> None:
        """A reference's tensor of ``name``: a router's logits raise that layer's floor."""
        layer, kind = split_point(name)
        if KINDS[kind].route == "logits" and ref.shape == gold.shape and ref.numel():
            err = float((ref.double() - gold.double()).abs().max())
            if err == err and err > self.router_err.get(layer, 0.0):
                self.router_err[layer] = err

    def tau(self, layer: int) -> float:
        return NEAR_TIE_FACTOR * self.router_err.get(layer, 0.0)

    def check(self, layer: int, engine_ids: torch.Tensor, gold: dict[str, torch.Tensor]) -> RouteCheck:
        """The engine's expert sets of ``layer`` against the golden's own choice (the top-k of its router logits:
        its ``moe.topk_ids`` may be the engine's route it followed), with the golden's margins; ``excluded``:
        the tokens whose set differs from the route the golden followed (the local pass leaves them out)."""
        logits, followed = gold[f"layers.{layer}.moe.router"], gold[f"layers.{layer}.moe.topk_ids"]
        own = logits.double().topk(followed.shape[-1], dim=-1).indices
        rc = check_routes(engine_ids, own, logits, self.tau(layer))
        rc.excluded = torch.nonzero((engine_ids.long().sort(-1).values != followed.long().sort(-1).values)
                                    .any(-1)).flatten().tolist()
        self.checks[layer] = rc
        return rc

    def excluded(self, name: str, exclude: bool) -> list[int]:
        """The rows of ``name`` to leave out this step: a routed point's flipped tokens (``exclude``: the golden
        did not follow the engine's route, i.e. the local pass)."""
        layer, kind = split_point(name)
        if not exclude or not KINDS[kind].routed or layer not in self.checks:
            return []
        return self.checks[layer].excluded


class RouteFollower(RouteBook):
    """MoE in one pass, behind one object: the route book, plus who follows whose route. The propagated pass of a
    sparse model runs the engine first (``engine_first``) and records its routes (``record``, into ``followed``:
    the run's, shared with the local pass, whose golden follows them too when it is computed again); the golden
    follows them (``golden_route``), the references follow the golden's (``reference_routes``), every top-k is put
    in one order (``order``). For a dense model (``sparse`` False) each of these is a pass-through."""

    def __init__(self, sparse: bool, followed: dict | None, isolated: bool):
        super().__init__()
        self.sparse, self.followed, self.isolated = sparse, followed, isolated

    @property
    def engine_first(self) -> bool:
        return self.sparse and not self.isolated

    def record(self, step: int, points) -> None:
        """The engine's routes of ``step`` (its raw points, before unsharding), for the golden to follow."""
        if self.followed is None:
            return
        self.followed[step] = engine_routes(points)
        if step == 0 and self.followed[step] is None:
            logger.warning("tpcheck diff: note: the engine reports no moe.topk_ids: the golden cannot follow "
                           "its routes, so a token that legitimately picks other experts (a near tie, "
                           "bfloat16/float16) shows as an error after its MoE layer")

    def golden_route(self, step: int) -> dict[int, torch.Tensor] | None:
        return None if self.followed is None else self.followed.get(step)

    def order(self, points: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sort_routes(points) if self.sparse else points

    def reference_routes(self, gold: dict[str, torch.Tensor]) -> dict[int, torch.Tensor] | None:
        return routes_of(gold) if self.sparse else None

    def observe(self, name: str, ref: torch.Tensor, gold: torch.Tensor) -> None:
        if self.sparse:
            super().observe(name, ref, gold)


def engine_routes(points) -> dict[int, torch.Tensor] | None:
    """``{layer: [rows, k] ids}`` of an engine step's ``moe.topk_ids`` points (replicated: rank 0's, or the
    first rank that holds it)."""
    ids = {name: next(t for t in per_rank if t is not None) for name, (_, per_rank) in points.items()  # fused: no kind
           if getattr(KINDS.get(split_point(name)[1]), "route", "") == "ids" and any(t is not None for t in per_rank)}
    return routes_of(ids)
