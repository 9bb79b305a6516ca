"""Dumps: a live ``tpcheck diff --dump`` and ``tpcheck compare`` of its dump give the same rows, faults
included; a dump that is incomplete, inconsistent or over budget is refused naming what is wrong."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import tpcheck
from diff_runs import verdict_rows
from tpcheck.cli.app import main
from tpcheck.capture.dump import DumpError
from tpcheck.engines.dump.replay import DumpAdapter, read_dump
from tpcheck.cli.fault_matrix import prompts_for, smallest_config
from tpcheck.pipeline.diff import compare_engine
from tpcheck.reference.reductions import Reductions




def _live_and_offline(ckpt, engines, tmp_path, preset="tiny", tp=2, dtype="float32", steps=2, inject=(),
                      block_size=16, prompts=None):
    from impl.config import load_config
    d = ckpt(preset)
    prompts = prompts or [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]
    live = tpcheck.diff(model=d, tp=tp, dtype=dtype, prompts=prompts, decode_steps=steps, inject=list(inject),
                        pool=engines, dump=str(tmp_path / "dump"), block_size=block_size,
                        isolate=False)  # a dump records the propagated pass: compared with it alone
    dump = read_dump(tmp_path / "dump")
    assert dump.tp == tp and dump.tokens[0] == prompts and len(dump.tokens) == steps + 1
    offline = compare_engine(DumpAdapter(dump, Reductions(tp)), str(d), dump.tokens[0], dtype, steps,
                             isolate=False)  # the live run's one pass (the dump's local pass: test_dump_local.py)
    assert load_config(d).num_layers
    return live, offline


def test_live_and_dump_give_the_sameverdict_rows(ckpt, engines, tmp_path):
    live, offline = _live_and_offline(ckpt, engines, tmp_path)
    assert live.passed and verdict_rows(live) == verdict_rows(offline)


@pytest.mark.parametrize("fault", ["nan_causal_mask", "skip_o_proj_allreduce", "kv_replica_index",
                                   "slot_mapping_off_by_one_at_block_boundary", "vocab_ids_not_masked"])
def test_faults_through_dumps_keep_verdict_and_origin(ckpt, engines, tmp_path, fault):
    from impl.config import load_config
    config = smallest_config(tpcheck.engines.impl.faults.get_fault(fault), ckpt)
    prompts = prompts_for(config, load_config(ckpt(config["preset"])).vocab_size)
    live, offline = _live_and_offline(ckpt, engines, tmp_path, config["preset"], config["tp"], config["dtype"],
                                      config["decode_steps"], [fault], config["block_size"], prompts)
    assert not live.passed and not offline.passed
    assert live.first_divergence["point"] == offline.first_divergence["point"]
    assert verdict_rows(live) == verdict_rows(offline)


@pytest.fixture
def dumped(ckpt, engines, tmp_path):
    tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=[[1, 2, 3, 4]], decode_steps=1, pool=engines,
                 dump=str(tmp_path / "d"))
    return tmp_path / "d"


def test_incomplete_or_inconsistent_dumps_are_named(dumped, ckpt, capsys):
    model = str(ckpt("tiny"))
    assert main(["compare", str(dumped), "--model", model]) == 0
    meta = dumped / "rank1" / "step1.json"
    m = json.loads(meta.read_text())
    meta.write_text(json.dumps({**m, "tokens": [[7]]}))
    with pytest.raises(DumpError, match=r"rank1/step1.json: tokens \[\[7\]\] differs from rank 0's"):
        read_dump(dumped)
    meta.unlink()
    assert main(["compare", str(dumped), "--model", model]) == 2
    assert "rank1: steps [0] differ from rank 0's [0, 1]" in capsys.readouterr().err
    shutil.rmtree(dumped / "rank1")
    assert main(["compare", str(dumped), "--model", model]) == 2
    assert "missing ranks [1]" in capsys.readouterr().err


def test_dump_budget_and_dir_are_checked_before_filling_a_disk(ckpt, tmp_path, capsys):
    model = str(ckpt("tiny"))
    assert main(["diff", "--model", model, "--tp", "2", "--dump", str(tmp_path / "d"), "--dump-budget-mb", "0.01"]) == 2
    assert "past the budget" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["diff", "--model", model, "--tp", "2", "--dump", str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err


def test_dump_points_selects(ckpt, engines, tmp_path):
    tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=[[1, 2, 3]], pool=engines, dump=str(tmp_path / "d"),
                 dump_points=r"logits|layers\.\d+\.out")
    names = set(json.loads((tmp_path / "d" / "rank0" / "step0.json").read_text())["placements"])
    assert names == {"logits", "layers.0.out", "layers.1.out"}


def test_dump_points_keeps_parts_of_a_fused_point(ckpt, engines, tmp_path):
    tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=[[1, 2, 3]], pool=engines, dump=str(tmp_path / "d"),
                 dump_points=r"layers\.0\.attn\.q|logits")
    names = set(json.loads((tmp_path / "d" / "rank0" / "step0.json").read_text())["placements"])
    assert names == {"layers.0.attn.q", "logits"}


def test_a_second_run_into_a_dump_directory_is_refused(dumped):
    from tpcheck.capture.dump import DumpWriter
    with pytest.raises(DumpError, match="earlier run"):
        DumpWriter(dumped, 0, 2, "float32")


def test_steps_that_do_not_follow_each_other_are_refused(dumped):
    meta = dumped / "rank0" / "step1.json"
    m = json.loads(meta.read_text())
    m["starts"] = [0]
    meta.write_text(json.dumps(m))
    with pytest.raises(DumpError, match="does not follow step 0"):
        read_dump(dumped)


def _equal_points(a: dict, b: dict) -> bool:
    """Two steps' ``{name: (placement, [per rank])}``, bit for bit (None where a rank holds no such point)."""
    same = lambda x, y: x is y is None or x is not None and y is not None and torch.equal(x, y)  # noqa: E731
    return a.keys() == b.keys() and all(a[n][0] == b[n][0] and all(map(same, a[n][1], b[n][1])) for n in a)


def test_a_dump_never_changes_the_engines_numbers(ckpt, engines, tmp_path):
    """impl with a dump on computes what it does with the dump off, bit for bit: every point of a prefill and a
    decode step (logits and the KV cache included), the logits of a plain forward after it, the tokens it
    generates; and the dump holds those same logits."""
    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import ImplAdapter, generate_dumped, get_llm
    d = ckpt("tiny")
    llm = get_llm(engines, d, 2)
    prompts = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]
    before = llm.logits(prompts[0])

    def run(dump: dict | None) -> list[dict]:
        eng = ImplAdapter(llm, dump=dump)
        eng.begin(prompts, 1)
        try:
            return [eng.step(prompts, None, True), eng.step([[7], [11]], None, True)]
        finally:
            eng.close()
    off = run(None)
    on = run({"root": str(tmp_path / "d"), "dtype": "float32", "points": None, "budget_bytes": None, "model": str(d)})
    assert all(_equal_points(x, y) for x, y in zip(off, on))
    dumped = read_dump(tmp_path / "d")
    assert [_equal_points({"logits": off[s]["logits"]}, {"logits": dumped.points(s)["logits"]}) for s in (0, 1)] \
        == [True, True]
    assert torch.equal(llm.logits(prompts[0]), before)  # the hooks a dump leaves installed change nothing
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3)
    assert generate_dumped(llm, prompts, params, tmp_path / "g") == llm.generate(prompts, params)


def test_a_plain_generate_after_a_diff_or_a_dump_captures_nothing(ckpt, engines, tmp_path):
    """The hooks a diff or a dump leaves installed in impl's ranks capture nothing outside them: a plain
    ``generate`` after either leaves no point held in a rank (every point of each of its forwards was kept until
    the next diff: a rank's memory grew with every token), and a dump after a plain ``generate`` records its own
    forwards only (its first step's logits held the plain run's rows too)."""
    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped, get_llm
    d = ckpt("tiny")
    llm = get_llm(engines, d, 2)
    prompts = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]
    params = SamplingParams(max_tokens=3)
    generate_dumped(llm, prompts, params, tmp_path / "first")
    llm.generate(prompts, params)
    assert llm.call("worker_fns:pending_points") == [[], []]
    tpcheck.diff(model=d, tp=2, prompts=prompts, decode_steps=1, pool=engines)
    assert get_llm(engines, d, 2) is llm  # the same engine: its hooks stay installed
    llm.generate(prompts, params)
    assert llm.call("worker_fns:pending_points") == [[], []]
    generate_dumped(llm, prompts, params, tmp_path / "after")
    dump = read_dump(tmp_path / "after")
    assert [len(dump.points(s)["logits"]) for s in range(len(dump.tokens))] == [2, 2, 2]  # the sampled rows alone


def test_a_serving_dump_of_a_selection_hooks_only_the_selection(ckpt, engines, tmp_path):
    """``generate_dumped(points=...)`` installs the ranks' hooks where a selected point comes from (each hook copies
    its tensor: the writer's filter alone copied every point, then dropped it), the tokens unchanged; a diff after
    it hooks every point again."""
    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped, get_llm
    d = ckpt("tiny")
    llm = get_llm(engines, d, 2)
    prompts = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]
    params = SamplingParams(max_tokens=3)
    sel = r"logits|layers\.\d+\.out"
    assert generate_dumped(llm, prompts, params, tmp_path / "sel", points=sel) == llm.generate(prompts, params)
    for names in llm.call("worker_fns:capture_names"):
        assert names and all(re.fullmatch(sel, n) for n in names), names
    dump = read_dump(tmp_path / "sel")
    assert set(dump.points(0)) == {"logits", "layers.0.out", "layers.1.out"}
    tpcheck.diff(model=d, tp=2, prompts=prompts, decode_steps=1, pool=engines)
    assert all("layers.0.attn.q" in names for names in llm.call("worker_fns:capture_names"))


def test_a_moe_dump_keeps_the_routes_the_engine_took(ckpt, engines, tmp_path):
    """A dump holds each layer's ``moe.topk_ids`` (integer ids in a floating-point dump); ``compare`` follows them as
    the live run does: bfloat16 on tiny-moe-ties flips near-tie routes, and both give the same rows."""
    from tpcheck.inputs.prompts import random_prompts
    live, offline = _live_and_offline(ckpt, engines, tmp_path, "tiny-moe-ties", dtype="bfloat16",
                                      prompts=random_prompts(256, 2, 32, 0))
    assert live.passed and verdict_rows(live) == verdict_rows(offline)
    ids = offline.table[offline.table["point"].str.endswith("moe.topk_ids")]
    assert len(ids) == 6 and ids["route_flips"].sum() > 0, ids[["point", "step", "route_flips", "near_ties"]]
