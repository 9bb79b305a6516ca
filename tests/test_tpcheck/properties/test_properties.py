"""Property tests: Hypothesis draws (config, tp, prompts, decode length, dtype, block size) and impl must

* stay within the noise floor of Hugging Face at every point of every step (``tpcheck.diff``), with its
  RMSNorms and residual adds bit-identical to HF's on its own inputs (``--exact-ops``), also with massive
  activations in bfloat16/float16 (``outliers``: the TP-aware floor) and on trained-model magnitudes at depth
  (``deep-sink``: 24 layers, an attention sink of 2e4 at token 0),
* have its ranks agree bit for bit on every replicated point (residual stream, replicated KV heads): impl adds
  an all-reduce's partials in one order on every rank (the verdict itself admits a rank-dependent order's
  rounding, ``rank_spread`` within the threshold; impl is held to more),
* decode greedily in float32 exactly as HF ``generate`` does (up to a near-tie),
* keep only its own, un-repeated KV heads in the paged cache.

Engines come from the session pool (one per TP size per xdist worker, reloaded per drawn checkpoint);
drawn checkpoints go to a per-worker temp dir. Example budgets scale with the Hypothesis profile
(``tpcheck.properties.profiles``: ``HYPOTHESIS_PROFILE=dev|ci|thorough``); the ``ci`` profile runs
``CI_MINIMUM`` examples or more in all. A failure prints the shrunk example and a one-line ``tpcheck diff``
command that reproduces it (recreating the drawn checkpoint if its temp dir is gone)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from impl import SamplingParams
from tpcheck.properties import strategies as tst
from tpcheck.inputs.models.config_checkpoints import config_checkpoint, recreate_command
from tpcheck.properties.profiles import PROFILE, PROFILES, examples, record_examples, recorded
from tpcheck.properties.case import Case
from tpcheck.inputs.tp_layout import kv_layout


# share of the profile's max_examples each property runs; ci: 50 -> 70 + 70 + 2 x 25 + 2 x 2 + 50 + 30 + 20 = 294
WEIGHTS = {"diff[float32]": 1.4, "diff[bfloat16]": 1.4, "diff[outliers,bfloat16]": 0.5,
           "diff[outliers,float16]": 0.5, "diff[deep-sink,bfloat16]": 0.04, "diff[deep-sink,float16]": 0.04,
           "greedy_float32": 1.0, "kv_cache_heads": 0.6, "diff[moe]": 0.4}
CI_MINIMUM = 250
MAX_DECODE = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one intra-op thread in the driver (HF golden and reference runs, comparisons) is faster
    than two fighting the rank processes for the same cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Drawn checkpoints of this worker (content-addressed: an example drawn twice is written once)."""
    return tmp_path_factory.mktemp("drawn-checkpoints")


def _assert_covered(seen: list[tuple], name: str, decode_zero: bool = True) -> None:
    """With enough examples, the matrix is covered: every tp, both KV layouts, decode lengths 0 (where the
    property draws them) and > 0."""
    if len(seen) < 30:
        return
    tps = {s[0] for s in seen}
    layouts = {s[1] for s in seen}
    decode = {s[2] > 0 for s in seen}
    want = {False, True} if decode_zero else {True}
    assert tps >= {1, 2, 4} and layouts == {"partition", "replication"} and decode == want, \
        f"{name}: {len(seen)} examples did not cover the matrix: tp {sorted(tps)}, {sorted(layouts)}, decode>0 {decode}"


# ---- the noise-floor gate and rank agreement, at every point -----------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_diff_within_noise_floor_and_ranks_agree(dtype, engines, root):
    name = f"diff[{dtype}]"
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS[name]))
    @given(case=tst.cases(dtypes=(dtype,), max_decode=MAX_DECODE, max_batch=8, max_len=300))
    def prop(case):
        seen.append((case.tp, case.layout, case.decode_steps))
        note(f"case: {case.describe()}")
        r = dataclasses.replace(case, exact_ops=True).check(pool=engines, root=root)
        spread = r.table[r.table["rank_spread"] != 0].dropna(subset=["rank_spread"])
        assert spread.empty, f"impl's replicas differ: {spread[['point', 'step', 'rank_spread', 'rank_spread_by']]}"

    prop()
    record_examples(name, len(seen))
    assert len(seen) >= examples(WEIGHTS[name])
    _assert_covered(seen, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_outliers_within_tp_aware_noise_floor(dtype, engines, root):
    """Massive activations (trained-model statistics) at low precision: where a one-device floor fails correct
    engines at tp > 1, the TP-aware floor must not."""
    name = f"diff[outliers,{dtype}]"
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS[name]))
    @given(case=tst.cases(dtypes=(dtype,), max_decode=MAX_DECODE, max_batch=8, max_len=120,
                          outliers=tst.OUTLIER_STRENGTHS[1:]))
    def prop(case):
        seen.append((case.tp, case.layout, case.decode_steps))
        note(f"case: {case.describe()}")
        case.check(pool=engines, root=root)

    prop()
    record_examples(name, len(seen))
    assert len(seen) >= examples(WEIGHTS[name])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_deep_sink_within_tp_aware_noise_floor(dtype, engines, root):
    """Trained-model magnitudes at depth (``deep-sink``: 24 layers, a 2e4 attention sink at token 0, a second
    channel of 1.5e3) at low precision, with drawn prompts (at most 2 of at most 64 tokens), tp, block size and
    decode length. Its own small budget: a 24-layer example costs ~5 s after an engine reload."""
    name = f"diff[deep-sink,{dtype}]"
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS[name]))
    @given(case=tst.cases(dtypes=(dtype,), max_decode=MAX_DECODE, presets=tst.DEPTH_PRESETS, preset_share=1))
    def prop(case):
        seen.append((case.tp, case.layout, case.decode_steps))
        note(f"case: {case.describe()}")
        assert case.preset == "deep-sink"
        case.check(pool=engines, root=root)

    prop()
    record_examples(name, len(seen))
    assert len(seen) >= examples(WEIGHTS[name])


def test_moe_within_noise_floor_under_tp_and_ep(engines, root):
    """Mixture-of-experts models drawn (experts, top-k, expert width, shared expert, renormalisation, sparse layers,
    tp and an ep that splits them) in float32 and bfloat16: every point within the noise floor, every differing
    route a near tie (tpcheck.judge.routing)."""
    from tpcheck.properties.moe_strategies import MOE_FAMILIES
    name = "diff[moe]"
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS[name]))
    @given(case=tst.cases(families=MOE_FAMILIES, dtypes=("float32", "bfloat16"), max_decode=4, max_batch=4,
                          max_len=64))
    def prop(case):
        seen.append((case.tp, case.ep, case.config["model_type"]))
        note(f"case: {case.describe()}")
        case.check(pool=engines, root=root)

    prop()
    record_examples(name, len(seen))
    assert len(seen) >= examples(WEIGHTS[name])
    if len(seen) >= 20:  # the matrix is covered: an ep > 1, and each MoE family
        assert any(ep > 1 for _, ep, _ in seen) and {m for *_, m in seen} == set(MOE_FAMILIES), seen


# ---- greedy decode: token for token with HF generate (float32) ---------------------------------------------

_HF: dict = {}


def _hf(model_dir):
    from tpcheck.reference.hf import load_hf_model
    key = str(model_dir)
    if key not in _HF:
        while len(_HF) >= 4:
            _HF.pop(next(iter(_HF)))
        _HF[key] = load_hf_model(key, "float32")
    return _HF[key]


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # explicit all-ones mask: without it HF takes token id == pad_token_id for padding. eos_token_id=None,
        # not min_new_tokens=n: min_new_tokens masks EOS out of the scores, so HF would never pick EOS where
        # impl (ignore_eos) rightly does
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, eos_token_id=None,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = [s[0].topk(2).values for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), [float(t[0] - t[1]) for t in top2], [float(t[0]) for t in top2]


@st.composite
def greedy_cases(draw):
    config, tp = draw(tst.config_and_tp())
    bs = draw(tst.block_sizes())
    ps = draw(tst.prompts(config["vocab_size"], bs, max_batch=8, max_len=300, shared_prefix=True))
    n = draw(st.integers(1, 12))
    case = Case(config, tp, "float32", ps, n, bs, bias_std=draw(tst.bias_stds()))
    # a cache just big enough for the longest request, sometimes: recompute preemption
    need = max(-(-(len(p) + n - 1) // bs) for p in ps)
    blocks = need + draw(st.integers(0, 2)) if draw(st.booleans()) else None
    return case, blocks


def test_greedy_decode_matches_hf_generate(engines, root):
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS["greedy_float32"]))
    @given(greedy_cases())
    def prop(drawn):
        case, blocks = drawn
        seen.append((case.tp, case.layout, case.decode_steps))
        d = case.checkpoint(root)
        note(f"case: {case.describe()}, num_kv_blocks {blocks}\ncheckpoint: {d}\nrecreate: "
             + recreate_command(case.config, root, case.weight_seed, case.bias_std))
        llm = engines.get(d, case.tp, "float32", block_size=case.block_size, num_kv_blocks=blocks)
        got = llm.generate(case.prompts, SamplingParams(max_tokens=case.decode_steps, ignore_eos=True))
        hf = _hf(d)
        for i, (prompt, g) in enumerate(zip(case.prompts, got)):
            ref, gaps, tops = _hf_greedy(hf, prompt, case.decode_steps)
            for j, (a, b) in enumerate(zip(g, ref)):
                if gaps[j] < 1e-4 * max(1.0, abs(tops[j])):
                    break  # a near-tie: float32 rounding may legitimately pick the other token from here on
                assert a == b, (f"prompt {i} token {j}: impl {a} != HF {b} (HF top-2 gap {gaps[j]:.3g})\n"
                                f"impl {g}\nHF   {ref}\nreproduce the forward pass: {case.repro(root)}")
            else:
                assert len(g) == len(ref) == case.decode_steps, (g, ref)

    prop()
    record_examples("greedy_float32", len(seen))
    assert len(seen) >= examples(WEIGHTS["greedy_float32"])
    _assert_covered(seen, "greedy", decode_zero=False)


# ---- the KV cache holds each rank's own KV heads, never repeated to the query-head count --------------------

def test_kv_cache_holds_unrepeated_heads(engines, root):
    seen: list[tuple] = []

    @settings(max_examples=examples(WEIGHTS["kv_cache_heads"]))
    @given(pair=tst.config_and_tp(), bs=tst.block_sizes(), blocks=st.integers(4, 64), dtype=tst.dtypes())
    def prop(pair, bs, blocks, dtype):
        config, tp = pair
        seen.append((tp, kv_layout(config["num_key_value_heads"], tp), 1))
        d = config_checkpoint(config, root)
        llm = engines.get(d, tp, dtype, block_size=bs, num_kv_blocks=blocks)
        kv = config["num_key_value_heads"]
        local = kv // tp if tp <= kv else 1
        expect = (blocks, bs, local, llm.cfg.head_dim)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))  # the cache in use
        shapes = llm.kv_cache_shapes()
        assert len(shapes) == tp
        for rank, per_layer in enumerate(shapes):
            assert len(per_layer) == config["num_hidden_layers"]
            for layer, (k, v) in enumerate(per_layer):
                assert tuple(k) == tuple(v) == expect, (
                    f"rank {rank} layer {layer}: K {tuple(k)} V {tuple(v)}, expected {expect} "
                    f"({kv} KV heads over tp {tp}: {local} per rank; head_dim {llm.cfg.head_dim})")

    prop()
    record_examples("kv_cache_heads", len(seen))
    assert len(seen) >= examples(WEIGHTS["kv_cache_heads"])
    _assert_covered(seen, "kv_cache_heads", decode_zero=False)


# ---- the budget ----------------------------------------------------------------------------------------------

def test_ci_profile_runs_at_least_250_examples():
    """The ci profile's budgets add up to >= CI_MINIMUM; when every property test ran in this process (no
    xdist split), the executed count is checked too. The total of a run is printed at its end and written to
    reports/property_examples.txt by the tpcheck.properties.profiles pytest plugin."""
    ci = PROFILES["ci"]["max_examples"]
    planned = sum(max(1, round(w * ci)) for w in WEIGHTS.values())
    assert planned >= CI_MINIMUM, f"ci profile plans {planned} property examples, fewer than {CI_MINIMUM}"
    done = recorded()
    if PROFILE == "ci" and set(WEIGHTS) <= set(done):
        assert sum(done[k] for k in WEIGHTS) >= CI_MINIMUM, done
