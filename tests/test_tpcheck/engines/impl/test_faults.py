"""tpcheck.engines.impl.faults: the registry (one declaration per fault, beside its patch), when a fault is silent (the
KV layout included), and each fault injected into a live (pooled) engine breaks it as described,
only where aimed, and a reload restores it. Every test restores its engine in a ``finally``."""
from __future__ import annotations

import pickle
import random

import pytest
import torch

from impl import SamplingParams
from impl.config import load_config
from tpcheck.engines.impl import faults
from tpcheck.engines.impl.faults import FAULTS, Fault, fault_names, get_fault
from tpcheck.engines.impl.faults.registry import register

APPLY = "tpcheck.engines.impl.faults:apply"
DESCRIBE = "tpcheck.engines.impl.faults:describe"
# prefill faults that show on tiny in float32 (rope_theta_default needs rope_theta != 10000, rmsnorm a half
# dtype: tested below; full_state_dict_every_rank changes memory, not numerics; the family faults need another
# family's preset: test_families.py)
FAMILY = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.families"]
# mixture-of-experts faults need an MoE preset: tests/test_tpcheck/judge/test_routing.py
MOE = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.moe"]
# quantization faults need a quantized preset: tests/test_tpcheck/reference/test_quantized.py
QUANT = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant"]
GPTQ = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_gptq"]
AWQ = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_awq"]
KV = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.quant_kv"]  # FP8 KV cache
# pipeline-stage faults need --pp 2: tests/test_tpcheck/pipeline/test_pipeline_diff.py
PIPELINE = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.pipeline"]
# Gemma 3's own faults need a Gemma 3 preset: tests/test_tpcheck/engines/impl/test_gemma3.py
GEMMA = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.gemma"]
PREFILL = [n for n, f in FAULTS.items() if not f.decode_only and f.check == "diff"
           and n not in ("rope_theta_default", "rmsnorm_weight_before_cast", *FAMILY, *MOE, *QUANT, *GPTQ, *AWQ, *KV,
                         *PIPELINE, *GEMMA)]


def smallest_tp(fault, cfg) -> int:
    return next(tp for tp in (1, 2, 4) if fault.applies(cfg, tp, "float32"))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


# ---- registry ---------------------------------------------------------------------------------------

def test_registry():
    names = fault_names()
    assert len(names) == len(set(names)) == len(FAULTS) == 61
    assert PIPELINE == ["pp_residual_not_sent", "pp_final_norm_mid_stage", "pp_lm_head_untied",
                        "pp_stage_relative_positions", "pp_boundary_layer_twice", "pp_kv_global_layer_id"]
    assert all(FAULTS[n].pp == 2 and not FAULTS[n].per_layer for n in PIPELINE)
    assert GPTQ == ["gptq_row_group_scales_misaligned", "gptq_every_rank_rank0_qweight",
                    "gptq_row_scales_sharded_by_output"]
    assert AWQ == ["awq_nibble_order_sequential", "awq_row_scales_sharded_by_output", "awq_every_rank_rank0_qzeros"]
    assert FAMILY == ["qk_norm_after_rope", "llama3_scaling_ignored", "bias_where_none", "sliding_window_ignored"]
    assert MOE == ["moe_router_low_precision", "moe_topk_not_renormalized", "moe_shared_gate_skipped",
                   "moe_expert_offset_wrong", "moe_experts_reduced_twice", "moe_wrong_combine_weights",
                   "moe_shared_gate_reduced"]
    for n in names:
        f = get_fault(n)
        assert f.name == n
        assert f.description and "\n" not in f.description
        assert f.shows_when and f.expected_origin
        assert f.origin(3, stage1=1) == f.expected_origin.format(layer=3, stage1=1, boundary=0)
    assert {n for n, f in FAULTS.items() if f.decode_only} == {"gqa_cache_repeated_heads", "decode_position_off_by_one",
                                                               "slot_mapping_off_by_one_at_block_boundary",
                                                               "pp_stage_relative_positions", "pp_kv_global_layer_id"}
    assert {n: f.origin_step for n, f in FAULTS.items() if f.origin_step != "prefill"} == {
        "decode_position_off_by_one": "decode", "slot_mapping_off_by_one_at_block_boundary": "block_boundary",
        "pp_stage_relative_positions": "decode"}
    with pytest.raises(ValueError, match="first layer of pipeline stage 1; give stage1"):
        get_fault("pp_residual_not_sent").origin()
    assert get_fault("pp_final_norm_mid_stage").origin(stage1=2) == "layers.1.handoff"  # the last layer of stage 0
    assert [n for n, f in FAULTS.items() if f.check != "diff"] == ["full_state_dict_every_rank",
                                                                  "gemm_split_by_batch_tokens",
                                                                  "rmsnorm_split_by_padded_batch",
                                                                  "mlp_split_by_batch_size",
                                                                  "attention_reads_neighbour_kv_at_slot",
                                                                  "attention_split_at_chunk_boundary"]
    assert {f.schedule for f in FAULTS.values() if f.check == "invariance"} == {"batch", "slot", "chunk"}
    mem = get_fault("full_state_dict_every_rank")
    assert mem.check == "memory" and mem.origin(1) == "memory" and not mem.per_layer
    assert get_fault("vocab_ids_not_masked").origin(1) == "embed"
    assert get_fault("rmsnorm_weight_before_cast").origin(2) == "layers.2.input_norm"
    assert get_fault("slot_mapping_off_by_one_at_block_boundary").origin(1) == "layers.1.kv.k"
    assert get_fault("untied_lm_head").origin(1) == "logits" and not get_fault("untied_lm_head").per_layer
    assert get_fault("rope_skipped").origin(1) == "layers.1.attn.q_rope"
    with pytest.raises(ValueError) as e:
        get_fault("nope")
    assert all(n in str(e.value) for n in names)


def test_applies(ckpt):
    tiny, mqa, mha, untied = (load_config(ckpt(p)) for p in ("tiny", "tiny-mqa", "tiny-mha", "tiny-untied"))
    at = lambda name, cfg: [get_fault(name).applies(cfg, tp, "float32") for tp in (1, 2, 4)]  # noqa: E731
    assert at("qkv_shard_dim1", tiny) == [False, True, True]
    assert at("row_bias_every_rank", tiny) == [False, True, True]
    assert at("skip_o_proj_allreduce", tiny) == [False, True, True]
    assert at("kv_replica_index", tiny) == [False, False, True]
    assert at("kv_replica_index", mqa) == [False, False, False]  # one KV head: r % 1 == r // tp == 0
    assert at("gqa_cache_repeated_heads", tiny) == [True, True, True]  # 8/2, 4/1, 2/1 local heads
    assert at("gqa_cache_repeated_heads", mqa) == [True, True, False]  # 4/1, 2/1, 1/1
    assert at("gqa_cache_repeated_heads", mha) == [False, False, False]
    assert at("untied_lm_head", tiny) == [True, True, True]
    assert at("untied_lm_head", untied) == [False, False, False]
    for n in ("nan_causal_mask", "rope_skipped", "qkv_bias_missing", "gate_up_swapped", "decode_position_off_by_one",
              "rope_wrong_layout", "slot_mapping_off_by_one_at_block_boundary"):
        assert at(n, tiny) == [True, True, True], n
    for n in ("full_state_dict_every_rank", "vocab_ids_not_masked", "every_rank_loads_rank0_shard",
              "allreduce_low_precision"):
        assert at(n, tiny) == [False, True, True], n
    assert at("rope_theta_default", tiny) == [False] * 3  # tiny's rope_theta is the default 10000
    assert at("rope_theta_default", mqa) == at("rope_theta_default", untied) == [True] * 3
    rms, low = get_fault("rmsnorm_weight_before_cast"), get_fault("allreduce_low_precision")
    assert [rms.applies(tiny, 1, d) for d in ("float32", "bfloat16", "float16")] == [False, True, True]
    assert [low.applies(tiny, 2, d) for d in ("float32", "bfloat16", "float16")] == [True, False, False]
    assert not any(f.applies(tiny, 3, "float32") for f in FAULTS.values())  # 8 heads do not split 3 ways
    assert faults.applicable(tiny, 1) == [n for n in fault_names() if n not in
                                          ("qkv_shard_dim1", "row_bias_every_rank", "skip_o_proj_allreduce",
                                           "kv_replica_index", "full_state_dict_every_rank", "vocab_ids_not_masked",
                                           "every_rank_loads_rank0_shard", "rmsnorm_weight_before_cast",
                                           "rope_theta_default", "allreduce_low_precision", *FAMILY, *MOE, *QUANT,
                                           *GPTQ, *AWQ, *KV, *GEMMA)]



def test_each_fault_declared_once_with_its_patch():
    """One registry: every fault carries its patch and predicate (module-level: a Fault pickles), catalogue
    numbers give the listing order, and a second declaration of a name or number is refused."""
    numbers = [f.number for f in FAULTS.values()]  # 1-35, FP8's 36-37, GPTQ's 40-42, AWQ's 43-45, the pipeline's 46-51,
    assert numbers == list(range(1, 38)) + list(range(40, 64))  # the FP8 KV cache's 52-55, Gemma 3's 56-58,
    # invariance's 59-63
    for f in FAULTS.values():
        assert callable(f.patch) and f.patch.__module__.startswith("tpcheck.engines.impl.faults."), f.name
        assert pickle.loads(pickle.dumps(f)) == f
    rope = get_fault("rope_skipped")
    with pytest.raises(ValueError, match="duplicate fault name"):
        register(rope)
    with pytest.raises(ValueError, match="share the number 3"):
        register(Fault("other", "d", "always", "embed", number=3, patch=rope.patch))
    assert list(FAULTS)[2] == "rope_skipped" and len(FAULTS) == 61  # the refused ones left no trace


def test_block_boundary_fault_silent_where_no_decode_step_writes_a_boundary(ckpt):
    """slot_mapping_off_by_one_at_block_boundary fires only on a decode token at position p % block == 0:
    ``tpcheck diff --preset small --tp 2 --seq-len 21 --decode-steps 3`` (block 16) writes 21..23, so diff
    must say up front that the run cannot show it; a prompt of 14 tokens writes 16 at decode step 3."""
    cfg = load_config(ckpt("small"))
    slot = get_fault("slot_mapping_off_by_one_at_block_boundary")
    why = slot.silent_because(cfg, 2, "float32", 3, False, prompt_lens=[21, 21], block_size=16)
    assert why == ("shows only when a decode step writes the first slot of a KV block, and none does here "
                   "(block size 16; decode steps write positions 21..23)")
    assert slot.silent_because(cfg, 2, "float32", 3, False, prompt_lens=[14, 21], block_size=16) is None
    assert slot.silent_because(cfg, 2, "float32", 4, False, prompt_lens=[21], block_size=8) is None  # 24: step 4
    assert "positions 6, 14" in slot.silent_because(cfg, 1, "float32", 1, False, prompt_lens=[6, 14], block_size=8)
    assert slot.silent_because(cfg, 2, "float32", 3, False) is None  # layout not given: no claim (old callers)
    assert slot.silent_because(cfg, 2, "float32", 0, False, prompt_lens=[21], block_size=16) == (
        "shows only while decoding, and --decode-steps is 0")
    assert slot.expected_step([21, 21], 3, 16) is None and slot.expected_step([6, 14], 3, 8) == 3
    # faults without a block-boundary origin ignore the layout
    pos = get_fault("decode_position_off_by_one")
    assert pos.silent_because(cfg, 2, "float32", 3, False, prompt_lens=[21, 21], block_size=16) is None


def test_diff_notes_a_block_boundary_fault_that_cannot_fire(ckpt, engines):
    """End to end (tpcheck.diff passes the run's prompt lengths and block size to ``silent_because``)."""
    import tpcheck
    slot = "slot_mapping_off_by_one_at_block_boundary"
    d = ckpt("small")
    for seq_len, silent in ((21, True), (14, False)):
        r = tpcheck.diff(model=str(d), tp=2, seq_len=seq_len, decode_steps=3, inject=[slot], pool=engines)
        assert (slot in r.meta["inject_silent"]) is silent, (seq_len, r.meta["inject_silent"])
        assert r.passed is silent, r.summary()
        if not silent:
            assert (r.first_divergence["point"], r.first_divergence["step"]) == ("layers.0.kv.k", 3)

# ---- prefill faults on a live engine ----------------------------------------------------------------

@pytest.mark.parametrize("name", PREFILL)
def test_prefill_fault_breaks_logits_reload_restores(name, ckpt, engines, hf_model):
    d = ckpt("tiny")
    fault = get_fault(name)
    tp = smallest_tp(fault, load_config(d))
    llm = engines.get(d, tp)
    rng = random.Random(name)
    ids = [rng.randrange(llm.cfg.vocab_size) for _ in range(16)]
    ref = hf_logits(hf_model(d), ids)
    try:
        assert llm.call(APPLY, [name]) == [[name]] * tp
        got = llm.logits(ids)
        if name == "nan_causal_mask":
            assert torch.isnan(got).any()
        else:
            assert torch.isfinite(got).all()
            assert max_diff(got, ref) > 1e-2, f"{name} at tp {tp} left the logits unchanged"
    finally:
        llm.load(llm.model_dir)
    assert max_diff(llm.logits(ids), ref) <= 1e-4


def test_layer_selects_one_decoder_layer(ckpt, engines, hf_model):
    d = ckpt("small")
    llm = engines.get(d, 2)
    rng = random.Random(1)
    ids = [rng.randrange(llm.cfg.vocab_size) for _ in range(16)]
    try:
        assert llm.call(DESCRIBE)[0]["overrides"] == [[]] * 4  # a clean engine
        llm.call(APPLY, ["rope_skipped", "gate_up_swapped"], 1)
        for rank in llm.call(DESCRIBE):
            assert rank["model"] == []
            assert rank["layers"] == [[], ["rope_skipped", "gate_up_swapped"], [], []]
            assert rank["overrides"] == [[], ["self_attn.rotary_emb.forward"], [], []]
        assert max_diff(llm.logits(ids), hf_logits(hf_model(d), ids)) > 1e-2
        # errors are raised before anything is touched
        with pytest.raises(ValueError, match="out of range"):
            llm.call(APPLY, ["rope_skipped"], 4)
        with pytest.raises(ValueError, match="known faults"):
            llm.call(APPLY, ["rope_skipped", "nope"])
        assert llm.call(DESCRIBE)[0]["layers"][0] == []
    finally:
        llm.load(llm.model_dir)
    assert llm.call(DESCRIBE)[1]["layers"] == [[]] * 4


# ---- decode-only faults -----------------------------------------------------------------------------

# On ``small`` (untied): greedy continuations of the tied ``tiny`` collapse to one repeated token at once,
# which no decode bug can change.

def test_gqa_cache_repeated_heads_is_numerically_harmless(ckpt, engines, hf_model):
    d = ckpt("small")
    llm = engines.get(d, 2)  # 4 local query heads over 1 local KV head
    hf = hf_model(d)
    rng = random.Random("gqa")
    prompts = [[rng.randrange(llm.cfg.vocab_size) for _ in range(n)] for n in (5, 20)]
    ref_logits = hf_logits(hf, prompts[1])
    try:
        before = llm.kv_cache_shapes()
        assert {k[2] for rank in before for k, _ in rank} == {1}
        faults.inject(llm, ["gqa_cache_repeated_heads"])
        after = llm.kv_cache_shapes()
        for rank_b, rank_a in zip(before, after):
            for (kb, _vb), (ka, va) in zip(rank_b, rank_a):
                assert ka == va == (*kb[:2], 4, kb[3])  # same blocks, heads repeated to the query count
        got = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        for g, p in zip(got, prompts):
            ref, gaps = hf_greedy(hf, p, 8)
            n = next((i for i, gap in enumerate(gaps) if gap < 1e-4), len(ref))  # up to a near-tie
            assert g[:n] == ref[:n]
        assert max_diff(llm.logits(prompts[1]), ref_logits) <= 1e-4
    finally:
        llm.load(llm.model_dir)
    assert llm.kv_cache_shapes() == before


def test_decode_position_off_by_one_changes_generation(ckpt, engines, hf_model):
    d = ckpt("small")
    llm = engines.get(d, 1)
    rng = random.Random("decode-pos")
    prompts = [[rng.randrange(llm.cfg.vocab_size) for _ in range(n)] for n in (3, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    clean = llm.generate(prompts, params)
    with faults.injected(llm, ["decode_position_off_by_one"]):
        assert max_diff(llm.logits(prompts[1]), hf_logits(hf_model(d), prompts[1])) <= 1e-4  # prefill untouched
        bad = llm.generate(prompts, params)
        assert [b[0] for b in bad] == [c[0] for c in clean]  # the first token comes from the prefill
    assert bad != clean
    assert llm.generate(prompts, params) == clean


# ---- faults that need another preset or dtype, and the memory fault ------------------------------------

def test_rope_theta_default_shows_where_the_checkpoint_sets_theta(ckpt, engines, hf_model):
    d = ckpt("tiny-mqa")  # rope_theta 5e5
    llm = engines.get(d, 1)
    rng = random.Random("theta")
    ids = [rng.randrange(llm.cfg.vocab_size) for _ in range(16)]
    ref = hf_logits(hf_model(d), ids)
    with faults.injected(llm, ["rope_theta_default"]):
        assert max_diff(llm.logits(ids), ref) > 1e-2
    assert max_diff(llm.logits(ids), ref) <= 1e-4


def test_rmsnorm_weight_before_cast_changes_half_precision_only(ckpt, engines):
    d = ckpt("tiny")
    rng = random.Random("rms")
    ids = [rng.randrange(250) for _ in range(16)]
    for dtype, changes in (("bfloat16", True), ("float32", False)):
        llm = engines.get(d, 1, dtype)
        clean = llm.logits(ids)
        with faults.injected(llm, ["rmsnorm_weight_before_cast"], 0):
            overrides = llm.call(DESCRIBE)[0]["overrides"]
            assert overrides[0] == ["input_layernorm.forward", "post_attention_layernorm.forward"]
            bad = llm.logits(ids)
        assert torch.equal(bad, clean) is not changes, dtype
        assert torch.equal(llm.logits(ids), clean)


def test_full_state_dict_every_rank_keeps_numerics(ckpt, engines):
    d = ckpt("tiny")
    llm = engines.get(d, 2)
    ids = list(range(3, 19))
    clean = llm.logits(ids)
    with faults.injected(llm, ["full_state_dict_every_rank"]):
        assert [r["model"] for r in llm.call(DESCRIBE)] == [["full_state_dict_every_rank"]] * 2
        assert torch.equal(llm.logits(ids), clean)  # a memory fault: the memory check finds it (test_fault_matrix)
    assert [r["model"] for r in llm.call(DESCRIBE)] == [[], []]
