"""End-to-end logits check: impl at each TP size against an fp64 Hugging Face golden run, gated by the
noise floor of Hugging Face at the same dtype. (The layer-by-layer diff localises; this says whether.)

The verdict (``passed``) is the noise-floor gate on the logits' ``rel_err`` (``tpcheck.metrics.gate``) and no
NaN, nothing else. ``argmax_agree`` (the engine's top token equals the golden's at every position whose golden
top-2 gap exceeds 1e-4) is informational and not part of the verdict: the 1e-4 cut is a fixed absolute gap,
while the legitimate error of logits at the run's dtype (what Hugging Face itself makes at that dtype: in
bfloat16 one rounding alone is up to 2^-9 of each logit, ~1e-2 on a logit of 5) can be far larger, so a correct
engine flips near-ties whose gap lies between the two, as Hugging Face at that dtype would. A flip is evidence
of a fault only where the gap is wider than twice the engine's error at that position; an error that large is
what ``rel_err`` measures against the floor. (It is an aggregate over positions: an error confined to a few
positions is localised by ``tpcheck diff``.)"""
from __future__ import annotations

import logging

import random
from pathlib import Path

import pandas as pd
import torch

from tpcheck.metrics import compare, gate

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr


def random_prompts(vocab: int, batch: int, seq_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(batch)]


def hf_logits(model_dir: str | Path, dtype: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from tpcheck.capture_hf import load_hf_model
    model = load_hf_model(model_dir, dtype)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def check_logits(model_dir: str | Path, tps: list[int], dtype: str, prompts: list[list[int]],
                 pool=None) -> pd.DataFrame:
    """One row per (tp, prompt): engine and HF-at-dtype errors against the fp64 golden, and the verdict
    (``passed``: the noise-floor gate and no NaN; ``argmax_agree`` is informational, see the module docstring)."""
    from tpcheck.pool import EnginePool
    logger.info(f"HF float64 golden and HF {dtype} reference on {len(prompts)} prompt(s)...")
    golden = hf_logits(model_dir, "float64", prompts)
    ref = hf_logits(model_dir, dtype, prompts) if dtype != "float64" else golden
    own = pool is None
    pool = pool or EnginePool()
    rows = []
    try:
        for tp in tps:
            logger.info(f"impl tp={tp} {dtype}...")
            llm = pool.get(model_dir, tp, dtype)
            for i, p in enumerate(prompts):
                got = llm.logits(p)
                e, r = compare(got, golden[i]), compare(ref[i], golden[i])
                top2 = golden[i].topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 1e-4
                argmax_ok = bool(torch.equal(got.argmax(-1)[clear], golden[i].argmax(-1)[clear]))
                rows.append({"tp": tp, "dtype": dtype, "prompt": i, "tokens": len(p), "rel_err": e["rel_err"],
                             "ref_rel_err": r["rel_err"], "max_abs": e["max_abs"], "cosine": e["cosine"],
                             "nan": e["nan"], "argmax_agree": argmax_ok,
                             "passed": gate(e["rel_err"], r["rel_err"], dtype) and e["nan"] == 0})
    finally:
        if own:
            pool.close()
    return pd.DataFrame(rows)
