"""The references follow the golden's MoE routes: a router's choice replaced by the golden's where the expert sets
differ (``tpcheck.judge.routing`` judges which differences are legitimate near ties)."""
from __future__ import annotations

import torch


def forced_route(logits: torch.Tensor, ids: torch.Tensor, want: torch.Tensor, renormalize: bool,
                 weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's ``(weights, ids)`` with each token's expert set replaced by ``want``'s where they differ: the
    weights are the router's own softmax probabilities (float32, as HF computes them) of the wanted experts,
    renormalised when the router renormalises. Rows whose sets agree keep ``ids`` as they are."""
    differ = (ids.long().sort(-1).values != want.long().sort(-1).values).any(-1)
    if not bool(differ.any()):
        return None, ids
    probs = torch.softmax(logits.float(), dim=-1)
    new_ids = torch.where(differ[:, None], want.to(ids.dtype), ids)
    w = probs.gather(-1, new_ids.long())
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(weights_dtype), new_ids
