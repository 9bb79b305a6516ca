"""End-to-end logits check: impl at each TP size against an fp64 Hugging Face golden run, gated by the
noise floor of Hugging Face at the same dtype. (The layer-by-layer diff localises; this says whether.)

The verdict (``passed``) is ``tpcheck.judge``'s on the logits (each (tp, prompt) judged as ``tpcheck diff`` judges
its ``logits`` point: the noise-floor gate under ``tpcheck.judge.tolerances.Tolerances``, NaN never passing); with ``logprobs_topk``
also vLLM's ``check_logprobs_close`` rule (``logprobs_close``, below). The argmax flips are informational and not
part of the verdict: ``argmax_flips`` counts the positions where the engine's top token differs from the golden's
although the golden's top-2 gap there is wider than twice the noise floor's largest logit error at that position
(Hugging Face at the dtype against the golden: each of the two logits may legitimately move by that much);
``near_tie_flips`` counts the flips within that gap, which Hugging Face at the dtype could make as well (in
bfloat16 one rounding alone is up to 2^-9 of each logit, ~1e-2 on a logit of 5, and a real 49k-vocab model has
such near ties at most prompts). ``argmax_agree`` (in the JSON) is ``argmax_flips == 0``. A flip is evidence of a
fault only where the gap is wider than twice the engine's error at that position; an error that large is what
``rel_err`` measures against the floor. (It is an aggregate over positions: an error confined to a few positions
is localised by ``tpcheck diff``.)

``logprobs_close`` is vLLM's token-level rule (``tests/models/utils.py::check_logprobs_close``) applied to
every position of the prompt: where the engine's top token differs from the golden's, each side's token must
be among the other side's ``logprobs_topk`` most likely tokens. It is reported per prompt, and with
``logprobs_topk`` set it is part of the verdict."""
from __future__ import annotations

import logging

from pathlib import Path

import pandas as pd
import torch

from tpcheck.inputs.devices import resolve_device
from tpcheck.inputs.prompts import random_prompts  # noqa: F401 - the logits check's prompts, importable here
from tpcheck.inputs.files.quant_check import check_quantized_checkpoint
from impl.config import load_config
from tpcheck.judge import judge
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure.metrics import compare
from tpcheck.reference.hf import hf_logits
from tpcheck.result.table import DiffResult, Row
from tpcheck.engines.pool import EnginePool

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr


def logprobs_close(got: torch.Tensor, golden: torch.Tensor, k: int) -> bool:
    """vLLM's rule at every position of ``[positions, vocab]`` logits: where the top tokens differ, each is
    among the other side's ``k`` most likely."""
    a, b = got.argmax(-1), golden.argmax(-1)
    differ = a != b
    if not bool(differ.any()):
        return True
    top_got, top_gold = got[differ].topk(k, -1).indices, golden[differ].topk(k, -1).indices
    a_in_gold = (top_gold == a[differ, None]).any(-1)
    b_in_got = (top_got == b[differ, None]).any(-1)
    return bool((a_in_gold & b_in_got).all())


def argmax_flips(got: torch.Tensor, golden: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(flips, near-tie flips) over the positions of ``[positions, vocab]`` logits: positions where ``got``'s top
    token is not ``golden``'s, apart by whether the golden's top-2 gap there is within twice the reference's
    (the noise floor's) largest |logit error| at that position (a near tie) or wider (a flip)."""
    top2 = golden.topk(2, dim=-1).values
    near = (top2[:, 0] - top2[:, 1]) <= 2 * (ref - golden).abs().amax(-1)
    flip = got.argmax(-1) != golden.argmax(-1)
    return int((flip & ~near).sum()), int((flip & near).sum())


def check_logits(model_dir: str | Path, tps: list[int], dtype: str, prompts: list[list[int]],
                 pool=None, logprobs_topk: int | None = None, device: str = "auto") -> pd.DataFrame:
    """One row per (tp, prompt): engine and HF-at-dtype errors against the fp64 golden, and the verdict
    (``passed``: the noise-floor gate and no NaN, and ``logprobs_close`` when ``logprobs_topk`` is given;
    ``argmax_flips`` / ``near_tie_flips`` are informational, see the module docstring). ``device``: the engine's,
    the golden's and the reference's (``tpcheck.inputs.devices``; ``auto``: the pool's where it has one, else CUDA
    when present); the engine's logits are compared there."""
    check_quantized_checkpoint(model_dir, load_config(model_dir))  # a broken scale: exit 2, not a verdict
    if device == "auto" and getattr(pool, "device", None) is not None:
        device = pool.device
    device = resolve_device(device)
    logger.info(f"HF float64 golden and HF {dtype} reference on {len(prompts)} prompt(s), on {device}...")
    golden = hf_logits(model_dir, "float64", prompts, device)
    ref = hf_logits(model_dir, dtype, prompts, device) if dtype != "float64" else golden
    own = pool is None
    pool = pool or EnginePool(device=device)
    rows = []
    try:
        for tp in tps:
            logger.info(f"impl tp={tp} {dtype}...")
            llm = pool.get(model_dir, tp, dtype, device=device)
            for i, p in enumerate(prompts):
                got = llm.logits(p).to(golden[i].device)  # a rank's logits arrive on the host
                e, r = compare(got, golden[i]), compare(ref[i], golden[i])
                flips, near_ties = argmax_flips(got.double(), golden[i], ref[i].double())
                close = logprobs_close(got.double(), golden[i], logprobs_topk or 5)
                within = _judged(e, r["rel_err"], dtype)
                rows.append({"tp": tp, "dtype": dtype, "prompt": i, "tokens": len(p), "rel_err": e["rel_err"],
                             "ref_rel_err": r["rel_err"], "max_abs": e["max_abs"], "cosine": e["cosine"],
                             "nan": e["nan"], "argmax_agree": flips == 0, "argmax_flips": flips,
                             "near_tie_flips": near_ties, "logprobs_close": close,
                             "passed": bool(within and e["nan"] == 0 and (close or logprobs_topk is None))})
    finally:
        if own:
            pool.close()
    return pd.DataFrame(rows)


def _judged(stats: dict, ref_rel_err: float, dtype: str, tolerances: Tolerances | None = None) -> bool:
    """The verdict ``tpcheck diff`` gives a ``logits`` point with these statistics (``tpcheck.judge``)."""
    row = Row(point="logits", layer=None, step=0, mode="propagated", kind="logits", rel_err=stats["rel_err"],
              ref_rel_err=ref_rel_err, max_abs=stats["max_abs"])
    return bool(judge(DiffResult.from_rows([row], {"dtype": dtype}, stamp=False), tolerances).table["passed"][0])
