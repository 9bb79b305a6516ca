"""An engine that is not impl, for the adapter protocol's tests: Hugging Face itself, reported as if it ran on
2 ranks (q and gate/up sharded, mlp.out as two partial sums)."""
from __future__ import annotations

import torch

from impl.placements import Partial, Replicate, Shard
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache
from tpcheck.capture.points import split_point


class TwoRankHF:
    """An ``EngineAdapter`` over HF ``Qwen2ForCausalLM``; ``swap``: a sharded point whose ranks it reports in
    the wrong order. ``ulps``: rank 1's replicated points one ulp away from rank 0's on every other element (as
    when each rank adds an all-reduce's partials in its own order: vLLM's CPU shared-memory all-reduce at tp >= 3);
    ``stray``: a replicated point where rank 1 holds half of it (a rank that kept its partial of two equal halves)."""

    def __init__(self, model_dir, dtype: str, swap: str | None = None, ulps: bool = False, stray: str | None = None):
        self.cap, self.swap = HFCapture(load_hf_model(model_dir, dtype)), swap
        self.ulps, self.stray = ulps, stray

    def begin(self, prompts, decode_steps):
        self.caches, self.starts = [new_cache(self.cap.model) for _ in prompts], [0] * len(prompts)

    def step(self, new_tokens, teacher, capture_kv):
        points = self.cap.step(new_tokens, self.caches, self.starts, teacher, capture_kv)
        self.starts = [s + len(t) for s, t in zip(self.starts, new_tokens)]
        out = {}
        for name, t in points.items():
            kind = split_point(name)[1]
            if kind in ("attn.q", "mlp.gate", "mlp.up"):
                ranks = list(t.chunk(2, dim=-1))
                out[name] = (Shard(-1), ranks[::-1] if name == self.swap else ranks)
            elif kind == "mlp.out":
                out[name] = (Partial(), [t / 2, t / 2])  # halves of a float sum back exactly
            else:  # replicated points and the KV cache contents
                out[name] = (Replicate(), [t, t / 2 if name == self.stray else _nudged(t) if self.ulps else t])
        return out

    def close(self):
        self.caches = []


def _nudged(t):
    """``t`` with every other element moved one ulp up."""
    flat = t.reshape(-1).clone()
    flat[::2] = torch.nextafter(flat[::2], torch.full_like(flat[::2], float("inf")))
    return flat.view(t.shape)


PROMPTS = [[5, 17, 42, 99, 7, 3, 1, 64], [200, 11, 9]]
