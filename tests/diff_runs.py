"""``run_diff``: ``tpcheck.diff`` of a synthetic preset on the session's engines, with ragged seeded prompts
(shared by the diff and exact-ops tests)."""
from __future__ import annotations

import random

import tpcheck

VOCAB = {"tiny": 250, "small": 1000, "tiny-mqa": 203, "tiny-untied": 301}
LAYERS = {"tiny": 2, "small": 4, "tiny-mqa": 2, "tiny-untied": 3}


def run_diff(ckpt, engines, preset, tp, dtype="float32", steps=0, isolate=False, inject=(), layer=None, seq_len=12,
             batch=2, **kw):
    """Prompts of ``seq_len``, ``seq_len + 5``, ... tokens, seeded by the configuration; ``kw`` goes to
    ``tpcheck.diff`` (e.g. ``exact_ops=True``)."""
    rng = random.Random(f"{preset}{tp}{dtype}{steps}")
    lens = [seq_len + 5 * i for i in range(batch)]  # ragged
    prompts = [[rng.randrange(VOCAB[preset]) for _ in range(n)] for n in lens]
    return tpcheck.diff(model=ckpt(preset), tp=tp, dtype=dtype, prompts=prompts, decode_steps=steps, isolate=isolate,
                        inject=list(inject), inject_layer=layer, pool=engines, **kw)


# what two runs of the same comparison must agree on, row for row (live vs dump, saved vs replayed golden)
COLS = ["point", "step", "mode", "rel_err", "ref_rel_err", "threshold", "passed", "note"]


def verdict_rows(r) -> list[list]:
    """``r.table``'s ``COLS`` as lists (NaN as -1, so equal rows compare equal)."""
    return r.table[COLS].fillna(-1).values.tolist()


def propagated_rows(r) -> list[list]:
    """``verdict_rows`` of the propagated pass: what a live run and its dump share when both have a local pass (they
    force differently: the engine onto the golden's inputs, the golden onto the engine's)."""
    return [row for row in verdict_rows(r) if row[COLS.index("mode")] == "propagated"]
