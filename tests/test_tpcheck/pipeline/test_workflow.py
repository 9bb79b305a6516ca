"""Workflow flags of ``tpcheck diff``: a saved golden replays to the same table and refuses another run's
inputs; ``--points`` / ``--layers`` compare only the selection; ``--fail-fast`` stops at the first failing step."""
from __future__ import annotations

import argparse
import json
import re

import pandas as pd
import pytest

import tpcheck
from diff_runs import COLS
from tpcheck.inputs.arg_types import int_ranges
from tpcheck.cli.app import main
from tpcheck.reference.saved import GoldenError
from tpcheck.capture.selection import selection

PROMPTS = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]


def _diff(ckpt, engines, **kw):
    kw = {"tp": 2, "prompts": PROMPTS, "decode_steps": 2, "pool": engines, **kw}
    return tpcheck.diff(model=ckpt(kw.pop("preset", "tiny")), **kw)


def test_a_saved_golden_replays_to_the_same_table(ckpt, engines, tmp_path):
    saved = _diff(ckpt, engines, isolate=True, save_golden=str(tmp_path / "g"))
    files = sorted(p.name for p in (tmp_path / "g").iterdir())
    assert files == ["golden.json", "step0.safetensors", "step1.safetensors", "step2.safetensors"]
    replayed = _diff(ckpt, engines, isolate=True, golden=str(tmp_path / "g"))
    pd.testing.assert_frame_equal(saved.table[COLS], replayed.table[COLS])
    assert replayed.meta["golden"] == str(tmp_path / "g")
    fewer = _diff(ckpt, engines, decode_steps=1, golden=str(tmp_path / "g"))  # a prefix of the saved steps
    assert fewer.passed and fewer.table["step"].max() == 1


def test_a_saved_golden_refuses_another_run(ckpt, engines, tmp_path, capsys):
    _diff(ckpt, engines, decode_steps=1, save_golden=str(tmp_path / "g"))
    with pytest.raises(GoldenError, match="prompt 1 differs"):
        _diff(ckpt, engines, decode_steps=1, prompts=[PROMPTS[0], [1, 2]], golden=str(tmp_path / "g"))
    with pytest.raises(GoldenError, match="this run needs 4"):
        _diff(ckpt, engines, decode_steps=3, golden=str(tmp_path / "g"))
    with pytest.raises(GoldenError, match="fingerprint differs"):
        _diff(ckpt, engines, preset="tiny-untied", decode_steps=1, golden=str(tmp_path / "g"))
    meta = json.loads((tmp_path / "g" / "golden.json").read_text())
    assert main(["diff", "--model", str(ckpt("tiny")), "--decode-steps", "1", "--golden", str(tmp_path / "g"),
                 *sum((["--prompt-ids", ",".join(map(str, p))] for p in meta["prompts"]), [])]) == 0
    assert main(["diff", "--preset", "tiny", "--save-golden", str(tmp_path / "g")]) == 2  # not empty
    assert "--save-golden" in capsys.readouterr().err


def test_points_and_layers_select_what_is_compared(ckpt, engines):
    r = _diff(ckpt, engines, preset="small", points=r"layers\.\d+\.(attn\.out|out)|logits", layers=[1, 3])
    assert set(r.table["point"]) == {"layers.1.attn.out", "layers.1.out", "layers.3.attn.out", "layers.3.out"}
    assert r.passed and r.meta["coverage"]["not_reported"] == []  # coverage is within the selection
    only = _diff(ckpt, engines, preset="small", points="logits")
    assert set(only.table["point"]) == {"logits"} and only.passed
    bad = _diff(ckpt, engines, preset="small", layers=[2, 3], inject=["skip_o_proj_allreduce"], inject_layer=2)
    assert bad.first_divergence["point"] == "layers.2.attn.out"  # the origin rule within the selection
    with pytest.raises(ValueError, match="--layers 7 is beyond this 2-layer model"):
        _diff(ckpt, engines, layers=[7])


def test_fail_fast_stops_at_the_first_failing_step(ckpt, engines):
    full = _diff(ckpt, engines, isolate=True, inject=["decode_position_off_by_one"])
    fast = _diff(ckpt, engines, isolate=True, inject=["decode_position_off_by_one"], fail_fast=True)
    first_bad = int(full.table.loc[~full.table["passed"], "step"].min())
    assert first_bad == 1  # the fault shows at the first decode step
    assert fast.meta["stopped_at_step"] == 1 and fast.table["step"].max() == 1
    assert set(fast.table["mode"]) == {"propagated"}  # no isolated pass after a stop
    assert fast.first_divergence["point"] == full.first_divergence["point"]
    clean = _diff(ckpt, engines, fail_fast=True)
    assert clean.passed and clean.meta["stopped_at_step"] is None and clean.table["step"].max() == 2


def test_selection_and_layer_lists():
    assert int_ranges("0,3,10-12") == [0, 3, 10, 11, 12]
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_ranges(bad)
    assert selection() is None and selection("logits") == "logits"
    sel = selection(r".*attn\.q", [0, 2])
    names = ["layers.0.attn.q", "layers.1.attn.q", "layers.2.attn.q", "layers.2.out", "logits"]
    assert [n for n in names if re.fullmatch(sel, n)] == ["layers.0.attn.q", "layers.2.attn.q"]
    with pytest.raises(ValueError, match="not a regular expression"):
        selection("(")


def test_impl_ranks_capture_only_the_selection(ckpt, engines):
    from tpcheck.engines.impl.adapter import ImplAdapter
    llm = engines.get(ckpt("tiny"), 2, "float32")
    for sel, want in ((r"layers\.0\..*", lambda n: n.startswith("layers.0.")), (None, lambda n: True)):
        adapter = ImplAdapter(llm, points=sel)
        adapter.begin(PROMPTS, 1)
        got = set(adapter.step(PROMPTS, None, capture_kv=True))
        adapter.close()
        assert got and all(want(n) for n in got), got
        assert ("layers.1.kv.k" in got) == (sel is None) and "layers.0.kv.k" in got
