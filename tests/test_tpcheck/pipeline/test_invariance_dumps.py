"""``tpcheck invariance --dumps``: dumps of impl's own serving loop (``generate_dumped``: its scheduler, continuous
batching) compared bit for bit: the probe alone vs batched beside companions is identical in batch-invariant mode
and parts at a named point by default; requests matched by their tokens whatever their ids and slots; a prefix-cache
hit compares on the positions it computed; bad input exits 2 naming the dump or the flag."""
from __future__ import annotations

import json

import pytest

from tpcheck.cli.app import main
from tpcheck.pipeline.invariance_dumps import run_dumps

PROBE = [5, 17, 3, 29, 8, 41, 2, 13, 7, 30, 11, 4, 19, 23, 6, 9, 12, 33, 1, 27]  # 20 tokens: past one KV block
COMPANIONS = [[14, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62],
              [7, 7, 7, 7, 7, 7, 7, 7, 7]]


def _dump(llm, prompts, root, max_tokens=3):
    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped
    return generate_dumped(llm, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), root)


@pytest.fixture
def dumps(ckpt, engines, tmp_path):
    """``dumps(batch_invariant, tp=1) -> (alone, batched)``: the probe alone, then at slot 1 of a batch of 4."""
    from tpcheck.engines.impl.adapter import get_llm

    def make(batch_invariant: bool, tp: int = 1):
        llm = get_llm(engines, ckpt("tiny"), tp)
        tag = f"{'bi' if batch_invariant else 'default'}-tp{tp}"
        llm.set_batch_invariant(batch_invariant)
        try:
            alone = _dump(llm, [PROBE], tmp_path / f"alone-{tag}")
            batched = _dump(llm, [COMPANIONS[0], PROBE, *COMPANIONS[1:]], tmp_path / f"batched-{tag}")
        finally:
            llm.set_batch_invariant(False)  # the pooled engine goes back as it was
        assert alone[0] == batched[1]
        return tmp_path / f"alone-{tag}", tmp_path / f"batched-{tag}"
    return make


def test_batch_invariant_dumps_are_bitwise_identical_on_the_probes_rows(dumps):
    alone, batched = dumps(True)
    r = run_dumps([alone, batched], ulps=0)
    assert r.passed and r.first_break(r.schedules[1]) is None, r.summary()
    compared = {(x.step, x.point) for x in r.of(r.schedules[1])}
    assert {(0, "logits"), (2, "logits"), (0, "layers.0.attn.q"), (2, "layers.1.mlp.out")} <= compared
    assert all(x.numel > 0 and not x.note for x in r.of(r.schedules[1]))
    from tpcheck.engines.dump.replay import read_dump
    probe_id = read_dump(batched).batches[0].ids[1]  # slot 1 of the batch; another id than alone's
    assert f"its request {probe_id} is alone-bi-tp1's {read_dump(alone).batches[0].ids[0]}" in r.described[1]


def test_default_impl_dumps_part_at_a_named_point(dumps):
    """Default impl's batched decode (a GEMM over 4 rows vs a GEMV, attention over a padded batch) changes the
    probe's bits: the first differing point is named with its position and ulps, and the batched dump's companions
    are not compared."""
    alone, batched = dumps(False)
    r = run_dumps([alone, batched])
    first = r.first_break(r.schedules[1])
    assert r.passed and first is not None, r.summary()  # nothing declared: a report
    assert first.max_ulps > 0 and first.token is not None and first.token >= first.step
    assert not any(x.note for x in r.of(r.schedules[1])), r.summary()
    assert run_dumps([alone, batched], ulps=0).passed is False
    swapped = run_dumps([batched, alone])  # the batch as the reference: only its request that the other holds
    assert swapped.schedules[1:] == [alone.name] and swapped.first_break(alone.name).point == first.point


def test_dumps_of_other_tp_sizes_compare_unsharded(dumps):
    """Two ranks' shards are unsharded before the comparison: tp 2 vs tp 1 parts first at a row-parallel
    all-reduce or before it, never as a structural note."""
    alone1, _ = dumps(True)
    alone2, _ = dumps(True, tp=2)
    r = run_dumps([alone1, alone2])
    first = r.first_break(alone2.name)
    assert first is not None and not first.note and first.point.startswith("layers.0."), r.summary()


def test_cli_dumps_exit_codes_json_and_bad_input(dumps, tmp_path, capsys):
    alone, batched = dumps(False)
    doc = tmp_path / "inv.json"
    assert main(["invariance", "--dumps", str(alone), str(batched), "--json", str(doc)]) == 0
    d = json.loads(doc.read_text())
    assert d["kind"] == "invariance" and d["comparisons"][0]["first"] is not None and d["meta"]["dumps"]
    jsonschema = pytest.importorskip("jsonschema")
    from tpcheck.result.documents import load_schema
    jsonschema.Draft202012Validator(load_schema()).validate(d)
    assert main(["invariance", "--dumps", str(alone), str(batched), "--require", "bitwise"]) == 1
    assert "FAIL: bitwise invariance required" in capsys.readouterr().out
    assert main(["invariance", "--dumps", str(alone), str(batched), "--points", r"layers\.0\.input_norm"]) == 0
    assert "BITWISE IDENTICAL" in capsys.readouterr().out  # the norm is row-wise: the GEMMs after it part
    for argv, says in [([str(alone)], "two or more"), ([str(alone), str(batched), "--batch", "1,4"], "--batch"),
                       ([str(alone), str(tmp_path / "nowhere")], "no such dump directory")]:
        assert main(["invariance", "--dumps", *argv]) == 2
        assert says in capsys.readouterr().err


def test_dumps_of_other_requests_are_refused(ckpt, engines, tmp_path, capsys):
    from tpcheck.engines.impl.adapter import get_llm
    llm = get_llm(engines, ckpt("tiny"), 1)
    _dump(llm, [PROBE], tmp_path / "a", 1)
    _dump(llm, [COMPANIONS[0]], tmp_path / "b", 1)
    assert main(["invariance", "--dumps", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "holds none of" in capsys.readouterr().err


def test_a_prefix_cache_hit_compares_on_the_positions_it_computed(ckpt, tmp_path):
    """impl's own prefix cache (blocks of 4, one request at a time): the probe after a donor sharing its first 8
    tokens starts at position 8; against the probe alone, in batch-invariant mode, its prefill rows from position 8
    on and every decode step are bitwise, the cached positions not compared."""
    from impl import LLM, CacheConfig
    with LLM(ckpt("tiny"), tp_size=1, block_size=4, num_kv_blocks=32, cache=CacheConfig(max_num_seqs=1)) as llm:
        llm.set_batch_invariant(True)
        _dump(llm, [PROBE], tmp_path / "alone")
        _dump(llm, [PROBE[:8] + [60, 61, 62], PROBE], tmp_path / "hit")
    from tpcheck.engines.dump.replay import read_dump
    assert [(s, b.starts) for s, b in enumerate(read_dump(tmp_path / "hit").batches) if 8 in b.starts] == [(3, [8])]
    r = run_dumps([tmp_path / "alone", tmp_path / "hit"], ulps=0)
    assert r.passed, r.summary()
    q = next(x for x in r.of("hit") if (x.step, x.point) == (0, "layers.0.attn.q"))
    assert q.numel == (len(PROBE) - 8) * 64  # positions 8..19 of tiny's 8 heads x 8
    assert {x.step for x in r.of("hit")} == {0, 1, 2}
