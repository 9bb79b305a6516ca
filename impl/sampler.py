"""Greedy / temperature / top-k / top-p sampling of next tokens."""
import torch

from impl.sampling_params import SamplingParams


def _top(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of `row` and their ids, ordered by (logit desc, id asc).

    This order is canonical (ties keep the lower id first, as argmax does), so a
    row's result never depends on what else is in the batch. torch.topk is
    used when no tie straddles the k-th place, else a full stable sort.
    """
    if k < row.numel():
        vals, ids = torch.topk(row, k)
        if int((row >= vals[-1]).sum()) == k:
            ids = ids.sort().values  # id asc, then a stable sort by value desc
            vals, order = row[ids].sort(descending=True, stable=True)
            return vals, ids[order]
    vals, ids = torch.sort(row, descending=True, stable=True)
    return vals[:k], ids[:k]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V]; returns int64 ids [B] on logits.device.

    Math is done in float32. Row b with temperature 0: argmax (lowest id on ties).
    Otherwise, over the top-k tokens x_0 >= x_1 >= ... (k = -1 keeps all V):
      * p_j = softmax(x / temperature)_j;
      * top-p: keep j iff sum_{i<j} p_i < top_p, i.e. the smallest prefix whose
        mass reaches top_p (j = 0 is always kept); top_p = 1 keeps all;
      * draw j ~ torch.multinomial(p restricted to kept, 1, generator=g_b).
    Each row is computed on its own, so a request's tokens depend only on its
    logits, params and generator, never on the rest of the batch; a CPU
    torch.Generator().manual_seed(seed) reused every step makes them reproducible.
    Sampling runs on the generator's device (None -> global RNG on logits' device).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"logits {tuple(logits.shape)} vs {len(params)} params, {len(generators)} generators")
    logits = logits.float()
    out = logits.argmax(dim=-1)
    vocab = logits.shape[1]
    for b, p in enumerate(params):
        if p.temperature == 0:
            continue
        k = p.top_k if 0 < p.top_k < vocab else vocab
        if k == vocab and p.top_p >= 1.0:
            vals, ids = logits[b], None  # plain temperature sampling: no sort needed
        else:
            vals, ids = _top(logits[b], k)
        probs = torch.softmax(vals / p.temperature, dim=-1)
        if p.top_p < 1.0:
            probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= p.top_p, 0.0)
        g = generators[b]
        j = torch.multinomial(probs if g is None else probs.to(g.device), 1, generator=g).to(out.device)
        out[b] = j[0] if ids is None else ids[j[0]]
    return out
