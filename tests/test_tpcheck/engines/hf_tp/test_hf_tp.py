"""Hugging Face's own tensor parallelism (``tp_plan``) as a built-in engine: clean runs pass, a broken rank
fails at its origin, a dump (live or written by ranks under torchrun) gives the live run's table, and a layout
transformers cannot shard is refused."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tpcheck
from diff_runs import propagated_rows
from tpcheck.cli.app import main
from tpcheck.engines.dump.replay import DumpAdapter, read_dump
from tpcheck.engines.hf_tp.adapter import get_adapter
from tpcheck.pipeline.diff import compare_engine
from tpcheck.reference.reductions import Reductions

PROMPTS = [[5, 17, 42, 99, 7, 3, 1, 64], [200, 11, 9]]



@pytest.mark.parametrize("preset, tp, dtype", [("tiny", 2, "float32"), ("tiny-untied", 2, "bfloat16"),
                                               ("tiny-mha", 4, "float32"), ("small", 2, "bfloat16")])
def test_clean_hf_tp_passes_with_every_point_reported(ckpt, engines, preset, tp, dtype):
    r = tpcheck.diff(model=ckpt(preset), tp=tp, dtype=dtype, prompts=PROMPTS, decode_steps=2, isolate=True,
                     engine="hf-tp", pool=engines)
    assert r.passed, r.summary()
    assert r.meta["coverage"]["not_reported"] == []  # q/k after RoPE and each rank's KV cache included
    assert r.meta["engine"] == "hf-tp" and r.meta["reductions"]["tp"] == tp
    assert r.table["excess"].max() < 1.0


@pytest.mark.parametrize("fn, origin", [("hf_tp_swap_q_halves", "layers.1.attn.q"),
                                        ("hf_tp_zero_o_proj", "layers.1.attn.out")])
def test_a_broken_hf_tp_rank_fails_at_its_origin(ckpt, engines, fn, origin):
    d = ckpt("small")
    adapter = get_adapter(engines, d, 2, "float32")
    try:
        assert adapter.call(f"worker_fns:{fn}", 1) == [False, True]
        r = compare_engine(adapter, str(d), PROMPTS, "float32", decode_steps=1, isolate=True)
    finally:
        adapter.reload(str(d), "float32")  # the pool's ranks get clean weights back
    assert not r.passed
    assert r.first_divergence["point"] == origin
    iso = r.table[(r.table["mode"] == "isolated") & ~r.table["passed"]]
    assert iso["layer"].min() == 1  # the teacher-forced run puts the error in layer 1 itself


def test_hf_tp_dump_gives_the_live_table(ckpt, engines, tmp_path):
    d = ckpt("tiny")
    live = tpcheck.diff(model=d, tp=2, dtype="float32", prompts=PROMPTS, decode_steps=2, engine="hf-tp",
                        pool=engines, dump=str(tmp_path / "dump"))
    dump = read_dump(tmp_path / "dump")
    assert dump.engine == "hf-tp" and dump.tp == 2
    offline = compare_engine(DumpAdapter(dump, Reductions(2)), str(d), dump.tokens[0], "float32", 2)
    assert live.passed and offline.passed and propagated_rows(live) == propagated_rows(offline)
    assert set(live.table["mode"]) == set(offline.table["mode"]) == {"propagated", "isolated"}  # --dump keeps it


def test_hf_tp_under_torchrun_dumps_what_compare_judges(ckpt, engines, tmp_path):
    """The recipe of docs/adapters.md: ranks launched by torchrun write the dump, ``tpcheck compare`` judges it
    with the same rows as the live ``tpcheck diff --engine hf-tp`` of the same prompts."""
    d = ckpt("tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
           "-m", "tpcheck.engines.hf_tp", "--model", str(d), "--dump", str(tmp_path / "dump"), "--decode-steps", "2"]
    for p in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    dump = read_dump(tmp_path / "dump")
    offline = compare_engine(DumpAdapter(dump, Reductions(2)), str(d), dump.tokens[0], "float32", 2)
    live = tpcheck.diff(model=d, tp=2, dtype="float32", prompts=PROMPTS, decode_steps=2, engine="hf-tp",
                        pool=engines, dump=str(tmp_path / "live"))
    assert offline.passed, offline.summary()
    assert dump.tokens == read_dump(tmp_path / "live").tokens  # HF-TP's greedy tokens = the golden's here
    assert live.table["point"].tolist() == offline.table["point"].tolist()
    # torchrun's ranks run one thread each (OMP_NUM_THREADS=1), the live ranks more: a matmul may round
    # another way, so values are compared as measurements (same verdicts, errors of the same size), not bits
    assert (live.table["passed"] == offline.table["passed"]).all()
    ratio = (offline.table["rel_err"] + 1e-12) / (live.table["rel_err"] + 1e-12)
    assert ratio.between(0.2, 5).all(), ratio.describe()


def test_layouts_transformers_cannot_shard_are_refused(ckpt, capsys):
    assert main(["diff", "--engine", "hf-tp", "--model", str(ckpt("tiny-mqa")), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "num_key_value_heads=1 is not divisible by tp=2" in err and "split a head" in err
    assert main(["diff", "--engine", "hf-tp", "--preset", "tiny", "--inject", "gate_up_swapped"]) == 2
    assert "--inject applies to impl only" in capsys.readouterr().err
    # impl's paged cache takes a block size; another engine keeps its own layout: the flag is refused, not ignored
    assert main(["diff", "--engine", "hf-tp", "--preset", "tiny", "--block-size", "8"]) == 2
    assert "--block-size 8 applies to --engine impl only" in capsys.readouterr().err
