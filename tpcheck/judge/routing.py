"""The routing-aware part of the verdict for mixture-of-experts layers: which experts a token chose, judged as a set.

A router picks, per token, the k experts of largest logit. Two correct implementations can pick different sets
when the k-th and the (k+1)-th logits nearly tie: the router's own rounding (the noise floor's router-logit error)
moves one past the other. A different choice is therefore legitimate exactly when the golden's own margin is
within that error, and a bug otherwise:

* ``margin(t)`` = the golden's k-th largest logit minus the smallest golden logit among the experts the engine
  chose and the golden did not (the golden's order decides which of its experts the engine dropped);
* ``tau`` = twice the largest router-logit error of the noise floor's references at that point (their worst row
  over this and earlier steps): the same near-tie rule as ``tpcheck check``'s ``near_tie_flips``;
* a token whose set differs is a **near tie** when ``margin <= tau``, else an **illegitimate** route: the row of
  ``moe.topk_ids`` fails, with the token, both sets and the margin in its note.

What follows a legitimately flipped token is never silently dropped: in the propagated pass the golden and the
references follow the engine's route (``RouteForcer``: their router's top-k replaced by the engine's set for
that token, weights recomputed from their own logits), so every downstream point compares like with like; in the
local pass (golden cached) the layer's routed points exclude the flipped tokens' rows, counted in the row."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RouteCheck:
    """One ``moe.topk_ids`` comparison: per token whether the engine's expert set differs from the golden's
    (``flipped``), the golden's margin there, and which flips are near ties (``margin <= tau``)."""

    flipped: list[int] = field(default_factory=list)       # rows whose sets differ
    margins: list[float] = field(default_factory=list)     # the golden's margin at each flipped row
    tau: float = 0.0
    sets: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (engine, golden) sets per flipped row
    excluded: list[int] = field(default_factory=list)  # rows whose set differs from the route the golden followed

    @property
    def near_ties(self) -> int:
        return sum(m <= self.tau for m in self.margins)

    @property
    def illegitimate(self) -> list[int]:
        """Indices into ``flipped`` of the flips outside the near-tie margin."""
        return [i for i, m in enumerate(self.margins) if not m <= self.tau]

    def note(self, where=lambda row: f"row {row}") -> str:
        """The structural finding of an illegitimate route ('' when every flip is a near tie)."""
        bad = self.illegitimate
        if not bad:
            return ""
        i = max(bad, key=lambda j: self.margins[j])
        eng, gold = self.sets[i]
        return (f"routing: {len(bad)} of {len(self.flipped)} token(s) whose experts differ are not near ties; "
                f"{where(self.flipped[i])}: engine {eng} vs golden {gold}, golden margin {self.margins[i]:.3g} > "
                f"{self.tau:.3g} (2x the references' router-logit error)")


def check_routes(engine_ids: torch.Tensor, golden_ids: torch.Tensor, golden_logits: torch.Tensor,
                 tau: float) -> RouteCheck:
    """Compare ``[T, k]`` expert ids as sets per token, with the golden's ``[T, E]`` router logits for margins."""
    out = RouteCheck(tau=tau)
    eng, gold = engine_ids.long().sort(-1).values, golden_ids.long().sort(-1).values
    k = gold.shape[-1]
    logits = golden_logits.double()
    kth = logits.topk(k, dim=-1).values[:, -1]
    for t in torch.nonzero((eng != gold).any(-1)).flatten().tolist():
        e, g = eng[t].tolist(), gold[t].tolist()
        extra = [x for x in e if x not in g]
        margin = float(kth[t] - logits[t, extra].min()) if extra else 0.0
        out.flipped.append(t)
        out.margins.append(margin)
        out.sets.append((e, g))
    return out
