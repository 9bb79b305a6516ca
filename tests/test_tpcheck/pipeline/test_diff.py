"""tpcheck diff: clean impl passes; injected faults fail with the origin at the right point."""
from __future__ import annotations

import json

import pytest

from diff_runs import LAYERS, run_diff
from tpcheck.cli.app import main
from tpcheck.capture.points import point_names

run = run_diff


CLEAN = [("tiny", 1, "float32", 0, False), ("tiny", 2, "bfloat16", 3, True), ("tiny", 4, "float32", 3, True),
         ("tiny-mqa", 2, "float16", 2, False), ("small", 4, "bfloat16", 2, False), ("tiny-untied", 4, "float32", 0, True)]


@pytest.mark.parametrize("preset,tp,dtype,steps,isolate", CLEAN, ids=["-".join(map(str, c)) for c in CLEAN])
def test_clean_impl_passes(preset, tp, dtype, steps, isolate, ckpt, engines):
    r = run(ckpt, engines, preset, tp, dtype, steps, isolate)
    assert r.passed, r.summary() + "\n" + r.table[~r.table.passed].to_string()
    assert r.first_divergence is None
    spread = r.table["rank_spread"]  # impl adds an all-reduce's partials in one order on every rank: bit for bit
    assert (spread.dropna() == 0).all() and spread.notna().any() == (tp > 1)
    assert set(r.meta["effective_precision"]) == {"propagated"} | ({"isolated"} if isolate else set())
    num_layers = LAYERS[preset]
    per_step = len(point_names(num_layers, with_kv=steps > 0))
    assert len(r.table) == per_step * (steps + 1) * (2 if isolate else 1)  # every point, every step, every mode
    assert set(r.table["step"]) == set(range(steps + 1))
    assert (r.table["ref_rel_err"] > 0).any() and (r.table["rel_err"] >= 0).all()


FAULTS = [  # (fault, preset, tp, steps, expected origin, step)
    ("nan_causal_mask", "tiny", 2, 0, "layers.0.attn.context", 0),
    ("qkv_shard_dim1", "tiny", 2, 0, "layers.0.attn.q", 0),
    ("rope_skipped", "tiny", 1, 0, "layers.0.attn.q_rope", 0),
    ("qkv_bias_missing", "tiny", 2, 0, "layers.0.attn.q", 0),
    ("gqa_cache_repeated_heads", "tiny", 2, 2, "layers.0.kv.k", 0),
    ("kv_replica_index", "tiny", 4, 0, "layers.0.attn.k", 0),
]


@pytest.mark.parametrize("fault,preset,tp,steps,origin,step", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_origin(fault, preset, tp, steps, origin, step, ckpt, engines):
    r = run(ckpt, engines, preset, tp, steps=steps, inject=[fault])
    assert not r.passed
    fd = r.first_divergence
    assert (fd["point"], fd["step"]) == (origin, step), r.summary()
    # the engine is restored after the run: the same engine is clean again
    assert run(ckpt, engines, preset, tp, steps=steps).passed


def test_kv_replica_fault_is_silent_without_replication(ckpt, engines):
    """tiny at tp 2 partitions its 2 KV heads: the replica index is never used, and diff says so up front."""
    r = run(ckpt, engines, "tiny", 2, inject=["kv_replica_index"])
    assert r.passed
    assert "cannot show at tp 2 in float32" in r.meta["inject_silent"]["kv_replica_index"]
    r = run(ckpt, engines, "tiny", 2, inject=["decode_position_off_by_one", "rope_skipped"])
    assert r.meta["inject_silent"] == {"decode_position_off_by_one": "shows only while decoding, and --decode-steps is 0"}
    assert not r.passed  # rope_skipped shows
    with pytest.raises(ValueError, match="unknown fault 'nope'"):  # before any engine work
        run(ckpt, engines, "tiny", 2, inject=["nope"])


def test_isolate_separates_local_from_inherited_error(ckpt, engines):
    """A fault in layer 2 of 4: only layer 2 has a large local error; 0, 1 and 3 stay in the noise band."""
    r = run(ckpt, engines, "small", 2, isolate=True, inject=["rope_skipped"], layer=2)
    assert r.first_divergence["point"] == "layers.2.attn.q_rope"
    iso = r.table[r.table["mode"] == "isolated"]
    for layer in (0, 1, 3):
        assert iso[iso["layer"] == layer]["passed"].all(), layer
    assert not iso[iso["layer"] == 2]["passed"].all()
    prop = r.table[r.table["mode"] == "propagated"]
    assert not prop[prop["layer"] == 3]["passed"].all()  # propagated: layer 3 inherits the error
    growth = {g["layer"]: g for g in r.growth()}
    assert growth[2]["local_passed"] is False and growth[3]["local_passed"] is True
    assert "layer 2 creates the divergence" in r.summary()


def test_cli_diff_exit_codes_and_json(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["diff", "--layer-by-layer", "--model", str(ckpt("tiny")), "--tp", "2", "--prompt-ids", "1,2,3,4,5",
            "--inject", "rope_skipped", "--json", str(out)]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "origin: layers.0.attn.q_rope" in text
    data = json.loads(out.read_text())
    assert data["passed"] is False
    assert data["first_divergence"]["point"] == "layers.0.attn.q_rope" and data["first_divergence"]["layer"] == 0
    row = data["rows"][0]
    for key in ("point", "layer", "step", "rel_err", "ref_rel_err", "cosine", "max_abs", "mean_abs", "passed"):
        assert key in row
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--prompt-ids", "1,2,3"]) == 0
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "3"]) == 2
    assert main(["diff", "--model", str(ckpt("tiny")), "--prompt-ids", "1,999"]) == 2


def test_generation_after_a_diff_is_what_it_was_before(ckpt, engines):
    """A diff writes its prompts into the engine's own KV blocks (when they suffice): the prefix cache must
    forget what those blocks held, or the next request reuses keys of another prompt."""
    import tpcheck
    from impl.sampling_params import SamplingParams
    from tpcheck.pipeline.check import random_prompts
    d = str(ckpt("small"))  # tiny's greedy tokens repeat one id: they would not show stale keys
    llm = engines.get(d, 2)
    llm.reset_scheduler()  # free blocks from 0 up: the prompt's blocks are those the diff writes
    prompt, other = random_prompts(llm.cfg.vocab_size, 2, 40, 5)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    before = llm.generate([prompt], greedy)
    assert llm.generate([prompt], greedy) == before  # served from the prefix cache
    r = tpcheck.diff(model=d, tp=2, prompts=[other], decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert llm.generate([prompt], greedy) == before
