"""``tpcheck invariance``: impl's batch-invariant mode is bitwise invariant over batch 1/4/16 x the probe's slot x
prompt lengths, decode, chunked prefill and prefix-cache hits included, at tp 1 and 2 (Hypothesis, on the test run's
pooled engines); default impl is not, and the report names where it parts; an invariance fault is found at its
origin under the batched schedule only; the command's exit codes and its JSON document."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from tpcheck.cli import fault_invariance, fault_matrix
from tpcheck.cli.app import main
from tpcheck.engines.impl.faults import get_fault
from tpcheck.options import DiffOptions
from tpcheck.pipeline.invariance import InvarianceOptions, run
from tpcheck.properties.profiles import examples, record_examples

GEMM_POINTS = ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.gate", "mlp.up", "mlp.out", "logits")


def _opts(preset="tiny", dtype="float32", **kw) -> InvarianceOptions:
    return InvarianceOptions(DiffOptions(preset=preset, dtype=dtype), **kw)


def test_batch_invariant_mode_is_bitwise_over_batch_slot_length_chunks_and_prefix(engines):
    seen = []

    @settings(max_examples=examples(0.3))
    @given(tp=st.sampled_from([1, 2]), batch=st.sampled_from([4, 16]), slot=st.integers(0, 15),
           prompt_len=st.integers(1, 40), decode=st.integers(1, 3), chunk=st.integers(1, 40),
           dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
    def prop(tp, batch, slot, prompt_len, decode, chunk, dtype, seed):
        o = _opts(dtype=dtype, tps=(tp,), batches=(1, batch), slot=min(slot, batch - 1), prompt_len=prompt_len,
                  decode_steps=decode, chunks=(chunk,) if chunk < prompt_len else (), prefix_cache=prompt_len > 16,
                  seed=seed, batch_invariant=True, ulps=0)
        note(f"{o}")
        r = run(o, pool=engines)
        seen.append((tp, batch))
        assert r.passed, r.summary()

    prop()
    record_examples("invariance[batch-invariant]", len(seen))
    assert len(seen) >= examples(0.3)


def test_batch_invariant_moe_is_bitwise_over_batch_slot_and_tp(engines):
    """tiny-qwen2-moe in batch-invariant mode: expert routing, the experts' row blocks, the shared expert's gate
    (``impl.batch_invariant.rowwise``) and the combine bitwise whatever the batch and the probe's slot, at tp 1, 2
    and 4 (the all-reduce in rank order: ``impl.distributed``), decode included."""
    seen = []

    @settings(max_examples=examples(0.16))
    @given(tp=st.sampled_from([1, 2, 4]), slot=st.integers(0, 3), prompt_len=st.integers(1, 24),
           decode=st.integers(1, 2), dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
    def prop(tp, slot, prompt_len, decode, dtype, seed):
        o = _opts("tiny-qwen2-moe", dtype, tps=(tp,), batches=(1, 4), slot=slot, prompt_len=prompt_len,
                  decode_steps=decode, seed=seed, batch_invariant=True, ulps=0)
        note(f"{o}")
        r = run(o, pool=engines)
        seen.append(tp)
        assert r.passed, r.summary()
        assert any(x.point.endswith("moe.experts") for x in r.rows)

    prop()
    record_examples("invariance[moe batch-invariant]", len(seen))
    assert len(seen) >= examples(0.16)


def test_batch_invariant_tp4_sums_ranks_in_one_order(engines):
    """At tp 4 a ring all-reduce adds an element's four partials in an order set by where it falls in the step's
    tensor; batch-invariant mode adds them in rank order, so the probe is bitwise beside 15 companions."""
    r = run(_opts(tps=(4,), batches=(1, 16), decode_steps=2, batch_invariant=True, ulps=0), pool=engines)
    assert r.passed, r.summary()


def test_default_impl_is_not_batch_invariant_and_the_report_names_where(engines):
    """Default impl's decode GEMMs run one row alone (a GEMV) or the batch's rows (a GEMM), its decode attention over
    the batch padded to its longest sequence: the probe's bits part there."""
    r = run(_opts(batches=(1, 8), decode_steps=3, ulps=None), pool=engines)
    first = r.first_break("tp1-batch8")
    assert r.passed and first is not None  # nothing declared: a report
    assert first.point.endswith(GEMM_POINTS + ("attn.context",)) and first.token is not None, first
    assert first.max_ulps > 0 and first.differing > 0


@pytest.mark.parametrize("name, quiet", [
    ("gemm_split_by_batch_tokens", "prefix hit, chunked prefill"),
    ("rmsnorm_split_by_padded_batch", "prefix hit, chunked prefill"),
    ("mlp_split_by_batch_size", "prefix hit, chunked prefill"),
    ("attention_reads_neighbour_kv_at_slot", "slot 0 of batch 8, prefix hit, chunked prefill"),
    ("attention_split_at_chunk_boundary", "batch 8"),
])
def test_invariance_fault_found_at_its_origin_only_under_its_schedule(engines, ckpt, name, quiet):
    """The fault matrix's row: under the schedule that exercises the fault (batched, at a slot > 0, chunked), the
    first differing point is the fault's origin; under the schedules that do not, the probe stays bitwise; the diff
    passes."""
    fault = get_fault(name)
    assert fault.check == "invariance" and fault.schedule in fault_invariance.SCHEDULES
    row = fault_matrix.fault_row(name, engines, ckpt)
    assert row["check"] == "invariance" and row["detected"] and row["origin_ok"], row["note"]
    assert (row["origin_point"], row["origin_step"]) == (fault.origin(0), 0) and row["excess"] > 0
    assert row["ok"] and f"{quiet}: bitwise identical" in row["note"], row["note"]
    assert "diff passes" in row["note"]


def test_cli_exit_codes_and_json(tmp_path, capsys):
    doc = tmp_path / "inv.json"
    assert main(["invariance", "--preset", "tiny", "--batch", "1,8", "--decode-steps", "2", "--json", str(doc)]) == 0
    d = json.loads(doc.read_text())
    assert d["kind"] == "invariance" and d["passed"] and d["require_ulps"] is None
    assert d["comparisons"][0]["schedule"] == "tp1-batch8" and d["rows"]
    jsonschema = pytest.importorskip("jsonschema")
    from tpcheck.result.documents import load_schema
    jsonschema.Draft202012Validator(load_schema()).validate(d)
    assert main(["invariance", "--preset", "tiny", "--batch", "1,8", "--decode-steps", "2", "--require",
                 "bitwise"]) == 1
    assert "FAIL: bitwise invariance required; broken by tp1-batch8" in capsys.readouterr().out
    assert main(["invariance", "--preset", "tiny", "--batch", "1,8", "--decode-steps", "2", "--batch-invariant",
                 "--ulps", "0"]) == 0


@pytest.mark.parametrize("argv, says", [
    (["--batch", "1"], "one schedule only"),
    (["--ulps", "-1"], "--ulps must be"),
    (["--batch", "1,4", "--slot", "4"], "--slot 4"),
    (["--batch", "1", "--prefix-cache", "--prompt-len", "8"], "longer than one KV block"),
    (["--batch", "1,2", "--inject", "no_such_fault"], "unknown fault"),
])
def test_cli_bad_input_exits_2_naming_it(argv, says, capsys):
    assert main(["invariance", "--preset", "tiny", *argv]) == 2
    assert says in capsys.readouterr().err
