"""``run_diff``: ``tpcheck.diff`` of a synthetic preset on the session's engines, with ragged seeded prompts
(shared by the diff and exact-ops tests); what vLLM declares of its rounding here, and a run failing by it alone."""
from __future__ import annotations

import random

import tpcheck
from tpcheck.capture.rounding import cpu_has_bf16_rounding, declared_rounding

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


# vLLM's CPU kernels on a machine without AVX512-BF16 truncate RoPE's (and attention's) bfloat16 results: a gain
# of -2^-9..-2^-8 after RoPE that the local pass finds (docs/measured/depth.md "A dump's local pass")
TRUNCATING = ("attn.q_rope", "attn.k_rope", "kv.k", "attn.context", "attn.out", "attn.residual")


def declared(dtype: str):  # what vLLM on this CPU declares: truncate in bfloat16 without AVX512-BF16, else nearest
    return declared_rounding("vllm", dtype, cpu_has_bf16_rounding())


def from_truncation(point: str, own_gain: float, gain_threshold: float) -> bool:
    """Whether a row's gain may be vLLM's truncation: at an op that truncates (``TRUNCATING``), or at a point after
    one that passes its gain on, its own op adding a gain within its bound (``layers.0.out``: the residual carrying
    ``attn.out``'s truncation, measured on an AVX2 CPU: -0.00134, own 0)."""
    return point.split(".", 2)[-1] in TRUNCATING or (own_gain is not None and abs(own_gain) <= gain_threshold)


def truncated_only(rows: list[dict], dtype: str) -> bool:
    """Whether a run's failing rows (``rows``: the result's, as dicts) are vLLM's bfloat16 truncation and nothing
    else, asserting it: every failing row is of the local pass, from truncation (``from_truncation``), within its
    rel_err threshold, and failed by a gain of truncation's sign and size; on a CPU without AVX512-BF16 in
    bfloat16 there is such a row at ``attn.q_rope`` (measured: every run). False where nothing failed."""
    from tpcheck.result.origin import truncation_like
    bad = [r for r in rows if not r["passed"]]
    for r in bad:
        assert r["mode"] == "isolated" and from_truncation(r["point"], r["own_gain"], r["gain_threshold"]), r
        assert r["rel_err"] <= r["threshold"] and abs(r["gain"]) > r["gain_threshold"], r
        assert truncation_like(r["gain"], dtype, r["gain_se"]), r
    if dtype == "bfloat16" and not cpu_has_bf16_rounding():
        assert any(r["point"].endswith("attn.q_rope") for r in bad), "no truncation found after RoPE"
    return bool(bad)
