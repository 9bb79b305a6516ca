"""A diff's ``meta`` is one typed record (``tpcheck.result.meta.DiffMeta`` with its ``RunOrigin``): what each kind of
run writes, and that a live run and a replayed dump go through the same writer."""
from __future__ import annotations

import dataclasses

import pytest

from tpcheck.result.meta import DiffMeta, RunOrigin

RUN = dict(model="/m", dtype="bfloat16", coverage={"problem": ""}, decode_steps=2, isolate=True, exact_ops=False,
           select=None, stopped_at_step=None, golden=None, reductions={"tp": 2, "dtype": "bfloat16"}, num_layers=3,
           prompt_lens=[4, 2])


def test_a_live_run_writes_its_injection_and_ep_a_dump_its_directory():
    live = RunOrigin(tp=2, ep=1, engine="impl", command="tpcheck diff", inject=("nan_causal_mask",), inject_layer=None,
                     inject_silent={})
    dump = RunOrigin(tp=3, engine="vllm", command="tpcheck compare d --model m", dump="d")
    assert list(live.to_dict()) == ["tp", "ep", "engine", "inject", "inject_layer", "inject_silent", "command"]
    assert live.to_dict()["inject"] == ["nan_causal_mask"] and live.to_dict()["inject_layer"] is None
    assert dump.to_dict() == {"tp": 3, "dump": "d", "engine": "vllm", "command": "tpcheck compare d --model m"}


def test_notes_and_precision_are_left_out_when_there_are_none():
    m = DiffMeta(origin=None, **RUN)
    d = m.to_dict()
    assert "notes" not in d and "effective_precision" not in d and "tp" not in d
    assert list(d) == list(RUN)
    n = dataclasses.replace(m, notes=("the engine adapter declares no `reductions`",), effective_precision={"x": 1})
    assert n.to_dict()["notes"] == ["the engine adapter declares no `reductions`"]
    assert n.to_dict()["effective_precision"] == {"x": 1}


def test_the_record_is_typed_an_unknown_field_is_refused():
    with pytest.raises(TypeError):
        DiffMeta(origin=None, prompt=[1, 2], **RUN)  # not a field: a typo cannot reach the saved result
    with pytest.raises(TypeError):
        RunOrigin(tp=2, engine="impl")  # the command that repeats the run is required
    with pytest.raises(dataclasses.FrozenInstanceError):
        DiffMeta(origin=None, **RUN).model = "other"


def test_a_diff_and_a_dump_compare_write_the_fields_of_the_record(tmp_path):
    """End to end: the saved meta of a live diff and of the compare of its dump hold the record's keys (and the
    run_meta stamp), nothing else."""
    import tpcheck
    from tpcheck.engines.dump.replay import DumpAdapter, read_dump
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.reference.reductions import Reductions
    from tpcheck.result.documents import RUN_META_KEYS
    d = str(cached_checkpoint("tiny"))
    live = tpcheck.diff(model=d, tp=2, prompts=[[1, 2, 3]], decode_steps=1, dump=str(tmp_path / "d"))
    # ``local_rows`` is written where the local pass ran the last rows of a longer prompt: test_local_rows.py
    fields = {f.name for f in dataclasses.fields(DiffMeta)} - {"origin", "notes", "local_rows"}
    origin = {f.name for f in dataclasses.fields(RunOrigin)}
    # ``stages`` (with ``pp``) is written for a pipelined run only: tests/test_tpcheck/pipeline/test_pipeline_diff.py
    assert set(live.meta) - {"tolerances", "notes", "allowances"} == fields | (origin - {"dump", "stages"}) | set(RUN_META_KEYS)
    dump = read_dump(tmp_path / "d")
    adapter = DumpAdapter(dump, Reductions(dump.tp))
    r = compare(adapter, DiffOptions(model=d, prompts=adapter.prompts, decode_steps=adapter.decode_steps),
                origin=RunOrigin(tp=dump.tp, engine=dump.engine, dump=str(tmp_path / "d"), command="tpcheck compare"))
    assert set(r.meta) - {"tolerances", "notes", "allowances"} == fields | {"tp", "dump", "engine"} | set(RUN_META_KEYS)
    assert r.meta["command"] == "tpcheck compare" and r.meta["dump"] == str(tmp_path / "d")
    assert r.passed and live.passed
