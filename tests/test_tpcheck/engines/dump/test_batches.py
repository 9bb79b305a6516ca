"""Continuous batching in dumps (format 2): requests that join at any step, chunked prefill, preemption and
recompute, and logits only for the sampled rows; the comparison aligns rows per (request, position).

The engine here is Hugging Face itself (float32) run as a serving engine would run it, so the dump is clean by
construction; what is tested is the bookkeeping: the golden follows each request, and a wrong record is refused."""
from __future__ import annotations

import json

import pytest

from impl.placements import Replicate
from tpcheck.capture.batches import RequestLog, StepBatch
from tpcheck.capture.dump import DumpError, DumpWriter
from tpcheck.engines.dump.replay import read_dump
from tpcheck.cli.app import main
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache

A, B, C, D = [5, 17, 42, 99, 7, 3], [200, 11, 9], [8, 6, 4, 2, 1], [30, 31, 32, 33]
# (request, tokens, start) per step, rows in that order; decode tokens are arbitrary ("sampled")
SCHEDULE = [
    [("a", A[:4], 0), ("b", B, 0)],                            # a's prompt in two chunks
    [("b", [50], 3), ("a", A[4:], 4), ("c", C, 0)],            # c joins; rows reordered
    [("a", [51], 6), ("b", [52], 4), ("c", [53], 5), ("d", D, 0)],
    [("a", [54], 7), ("c", [55], 6), ("d", [56], 4)],          # b preempted
    [("b", B + [50, 52], 0), ("a", [57], 8), ("d", [58], 5)],  # b recomputed from 0; c finished
    [("b", [59], 5), ("d", [60], 6)],
]


def test_request_log_follows_each_request():
    log = RequestLog()
    assert log.advance(StepBatch(["a", "b"], [[1, 2], [3]], [0, 0])) == [None, None]
    assert log.advance(StepBatch(["b", "a"], [[4], [5]], [1, 2])) == [None, None]
    assert log.advance(StepBatch(["a"], [[2, 5]], [1])) == [1]         # recomputed from position 1
    assert log.order == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="'b' runs positions 5..5 but only 2"):
        log.advance(StepBatch(["b"], [[9]], [5]))
    with pytest.raises(ValueError, match="'a' runs positions 0.. again with tokens \\[7\\]"):
        log.advance(StepBatch(["a"], [[7]], [0]))
    with pytest.raises(ValueError, match="appears twice"):
        StepBatch(["a", "a"], [[1], [2]], [0, 0])


def _serve(model_dir, root, schedule, tamper=None, prompts=None):
    """Run ``schedule`` on HF float32 as a serving engine: one cache per request (cut back on a recompute),
    every point written at tp 1, logits only for each request's last row (as vLLM samples). ``prompts``:
    ``{step: {request: prompt}}`` recorded in the dump; a request that starts past 0 has its prefix run into its
    cache first (a prefix-cache hit: the same keys and values another request computed), without rows."""
    cap = HFCapture(load_hf_model(model_dir, "float32"))
    writer = DumpWriter(root, 0, 1, "float32", engine="serving-hf")
    caches: dict = {}
    for step, batch in enumerate(schedule):
        ids, tokens, starts = (list(x) for x in zip(*batch))
        known = (prompts or {}).get(step, {})
        for rid, start in zip(ids, starts):
            if rid not in caches or start == 0:
                caches[rid] = new_cache(cap.model)
                if start > 0:
                    cap.step([known[rid][:start]], [caches[rid]], [0])
            elif caches[rid].get_seq_length() > start:
                caches[rid].crop(start)
        points = cap.step(tokens, [caches[r] for r in ids], starts)
        last = StepBatch(ids, tokens, starts).last_rows()
        points["logits"] = points["logits"][last]
        if tamper is not None and step == tamper:
            points["layers.1.mlp.out"] = points["layers.1.mlp.out"] * 1.01
        writer.write(step, tokens, starts, {n: (Replicate(), t) for n, t in points.items()}, ids=ids,
                     rows={"logits": last}, prompts=known or None)


def test_a_continuously_batched_dump_compares_clean(ckpt, tmp_path, capsys):
    d = ckpt("tiny")
    _serve(d, tmp_path / "dump", SCHEDULE)
    dump = read_dump(tmp_path / "dump")
    assert [b.ids for b in dump.batches][:2] == [["a", "b"], ["b", "a", "c"]]
    out = tmp_path / "r.json"
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d), "--isolate", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    # prefill rows without logits: a 4 + b 3 + c 5 + d 4 + b's recompute 5, less one sampled row per request and step
    rows_total = sum(len(t) for step in SCHEDULE for _, t, _ in step)
    assert doc["meta"]["coverage"]["rows_not_produced"] == {"logits": rows_total - sum(len(s) for s in SCHEDULE)}
    assert "rows not produced by the engine" in capsys.readouterr().out


def test_a_fault_in_a_late_request_step_is_found_there(ckpt, tmp_path):
    d = ckpt("tiny")
    _serve(d, tmp_path / "dump", SCHEDULE, tamper=4)
    out = tmp_path / "r.json"
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d), "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    fd = doc["first_divergence"]
    assert (fd["point"], fd["step"]) == ("layers.1.mlp.out", 4)


def test_a_recompute_with_other_tokens_is_refused(ckpt, tmp_path):
    d = ckpt("tiny")
    bad = [list(s) for s in SCHEDULE]
    bad[4] = [("b", B + [50, 99], 0)] + bad[4][1:]
    _serve(d, tmp_path / "dump", bad)
    with pytest.raises(DumpError, match="step4.json: does not follow step 3: request 'b' runs positions 0.. again"):
        read_dump(tmp_path / "dump")


def test_format_1_dumps_are_refused_naming_the_file(ckpt, tmp_path):
    """Format 1 carried no tensor hashes and no request ids: such a dump cannot vouch for its contents."""
    d = ckpt("tiny")
    _serve(d, tmp_path / "dump", [[("0", A, 0), ("1", B, 0)], [("0", [1], 6), ("1", [2], 3)]])
    for p in (tmp_path / "dump" / "rank0").glob("*.json"):
        m = json.loads(p.read_text())
        m["format"] = 1
        del m["ids"], m["rows"], m["tensors"]
        p.write_text(json.dumps(m))
    with pytest.raises(DumpError, match=r"rank0/step\d\.json: dump format 1 .*write the dump again"):
        read_dump(tmp_path / "dump")


def test_impl_serving_dump_compares_clean(ckpt, tmp_path):
    """impl's own scheduler, dumped as it ran (``tpcheck.engines.impl.adapter.generate_dumped``): 4 requests of different
    lengths and max_tokens, at most 3 running (the others join at later steps), a KV cache small enough to preempt
    and recompute; ``tpcheck compare`` judges it clean, and a fault seeded in the ranks is found."""
    from impl import LLM, CacheConfig, SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped
    from tpcheck.engines.impl import faults
    d = ckpt("tiny")
    prompts = [[3 + i for i in range(n)] for n in (5, 11, 3, 8)]
    prompts = [[(7 * k + t) % 200 + 3 for t in p] for k, p in enumerate(prompts)]  # no shared prefixes
    params = [SamplingParams(max_tokens=m) for m in (6, 3, 8, 5)]
    with LLM(d, tp_size=2, block_size=4, num_kv_blocks=6, cache=CacheConfig(max_num_seqs=3)) as llm:
        want = llm.generate(prompts, params)
        got = generate_dumped(llm, prompts, params, tmp_path / "dump")
        preempted = llm.num_preemptions
        llm.call(faults.apply, ["skip_o_proj_allreduce"])  # a TP bug inside the ranks
        generate_dumped(llm, prompts, params, tmp_path / "faulty")
    assert got == want  # dumping does not change what the engine generates
    dump = read_dump(tmp_path / "dump")
    first_step = {}
    for s, b in enumerate(dump.batches):
        for rid in b.ids:
            first_step.setdefault(rid, s)
    assert len(first_step) == 4 and max(first_step.values()) > 0  # requests joined at later steps
    assert preempted > 0, "the KV cache was meant to be small enough to preempt"
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d), "--isolate"]) == 0
    assert main(["compare", str(tmp_path / "faulty"), "--model", str(d), "--json", str(tmp_path / "f.json")]) == 1
    origin = json.loads((tmp_path / "f.json").read_text())["first_divergence"]
    assert origin["point"] == "layers.0.attn.out" and origin["step"] == 0


# a prefix-cache hit: "p" runs A whole; "q" (the same first 4 tokens, then its own) starts at 4 on p's blocks, and
# its parallel-sampling sibling "r" (q's prompt) on the same blocks in the same step
Q = A[:4] + [77, 78, 79]
HIT = [[("p", A, 0)], [("p", [61], 6), ("q", Q[4:], 4), ("r", Q[4:], 4)], [("q", [62], 7), ("r", [63], 7)]]
HIT_PROMPTS = {1: {"q": Q, "r": Q}}


def test_request_log_fills_a_recorded_prefix_and_refuses_an_unknown_one():
    log = RequestLog()
    log.advance(StepBatch(["p"], [A], [0]))
    assert log.advance(StepBatch(["q"], [Q[4:]], [4], prompts={"q": Q})) == [None]
    assert log.gaps == {"q": (0, A[:4])} and log.seen["q"] == Q
    log.advance(StepBatch(["q"], [[1]], [7]))
    assert log.gaps == {}
    with pytest.raises(ValueError, match="'s' runs positions 4..6 but only 0 .*no prompt tokens.*prefix-cache hit"):
        log.advance(StepBatch(["s"], [Q[4:]], [4]))
    with pytest.raises(ValueError, match="'t' .*runs \\[77, 78, 79\\] there, its recorded prompt has \\[1, 2, 3\\]"):
        log.advance(StepBatch(["t"], [Q[4:]], [4], prompts={"t": A[:4] + [1, 2, 3]}))


def test_a_prefix_cache_hit_with_recorded_prompts_compares_clean(ckpt, tmp_path):
    """q and r start at position 4 on p's blocks: the golden runs their first 4 tokens first (no rows compared
    there), then their steps as usual; a fault in the cached-prefix request's rows is still found there."""
    d = ckpt("tiny")
    _serve(d, tmp_path / "dump", HIT, prompts=HIT_PROMPTS)
    dump = read_dump(tmp_path / "dump")
    assert dump.batches[1].prompts == {"q": Q, "r": Q}
    out = tmp_path / "r.json"
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d), "--isolate", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["prompt_lens"] == [6, 7, 7]  # q's and r's prompts include the cached prefix
    _serve(d, tmp_path / "faulty", HIT, tamper=2, prompts=HIT_PROMPTS)
    assert main(["compare", str(tmp_path / "faulty"), "--model", str(d), "--json", str(out)]) == 1
    fd = json.loads(out.read_text())["first_divergence"]
    assert (fd["point"], fd["step"]) == ("layers.1.mlp.out", 2)


def test_a_prefix_cache_hit_without_prompts_is_refused_with_one_diagnosis(ckpt, tmp_path):
    """An older dump (no ``prompts``) of the same run reads as before and is refused: the message names the
    request, the step and the prefix cache, and no longer blames mixed or mislabelled steps."""
    d = ckpt("tiny")
    _serve(d, tmp_path / "dump", HIT, prompts=HIT_PROMPTS)
    for p in (tmp_path / "dump" / "rank0").glob("*.json"):
        m = json.loads(p.read_text())
        m.pop("prompts", None)
        p.write_text(json.dumps(m))
    with pytest.raises(DumpError, match="step1.json: request 'q' runs positions 4..6 .*prefix-cache hit") as e:
        read_dump(tmp_path / "dump")
    assert "mislabelled" not in str(e.value)
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d)]) == 2


def test_impl_serving_dump_with_prefix_cache_hits_compares_clean(ckpt, tmp_path):
    """impl's own prefix cache (blocks of 4 tokens): three prompts share their first 9 tokens, so the later ones
    start their prefill at position 8 on the first one's blocks; the dump records their prompts and ``compare``
    rebuilds the cached prefix in the golden and passes."""
    from impl import LLM, CacheConfig, SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped
    d = ckpt("tiny")
    shared = [(5 * t + 3) % 200 + 3 for t in range(9)]
    prompts = [shared + [40 + k, 90 + k] for k in range(3)]
    params = [SamplingParams(max_tokens=3)] * 3
    with LLM(d, tp_size=2, block_size=4, num_kv_blocks=16, cache=CacheConfig(max_num_seqs=1)) as llm:
        want = llm.generate(prompts, params)
        got = generate_dumped(llm, prompts, params, tmp_path / "dump")
    assert got == want
    dump = read_dump(tmp_path / "dump")
    hits = [(rid, start) for b in dump.batches for rid, start in zip(b.ids, b.starts)
            if start > 0 and rid in b.prompts]
    assert [s for _, s in hits] == [8, 8], hits  # the second and third prompts, each on the first's two blocks
    assert main(["compare", str(tmp_path / "dump"), "--model", str(d), "--isolate"]) == 0
