"""One exit-code contract for every subcommand: 0 pass, 1 diverged, 2 bad input (named), 3 the engine or the
harness failed (the rank named). One line on stderr, no traceback, no orphan worker."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from multiprocessing.connection import wait

import pytest

import tpcheck.engines.impl.adapter
from impl.executor import RankError
from tpcheck.cli.app import _exit_code, main
from tpcheck.pipeline.diff import compare_engine
from impl.placements import Replicate
from procs import descendants


def _one_line_error(err: str, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.startswith("tpcheck: error:")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def ckpt_copy(ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(ckpt("tiny"), d)
    return d


def test_truncated_safetensors_is_bad_input(ckpt_copy, capsys):
    f = ckpt_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    before = descendants()
    assert main(["diff", "--model", str(ckpt_copy), "--tp", "2"]) == 2
    _one_line_error(capsys.readouterr().err, str(f), "not a readable safetensors file")
    assert descendants() <= before


def test_safetensors_header_not_json_is_bad_input(ckpt_copy, capsys):
    f = ckpt_copy / "model.safetensors"
    header = b"{this is not json}"
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    assert main(["diff", "--model", str(ckpt_copy), "--tp", "2"]) == 2
    _one_line_error(capsys.readouterr().err, str(f))


def test_config_not_json_names_the_file(ckpt_copy, capsys):
    (ckpt_copy / "config.json").write_text("{model_type: qwen2")
    assert main(["diff", "--model", str(ckpt_copy), "--tp", "1"]) == 2
    _one_line_error(capsys.readouterr().err, str(ckpt_copy / "config.json"), "not valid JSON")


@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_unwritable_output_fails_before_engine_work(ckpt, tmp_path, capsys, where):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "r.json" if where == "under-a-file" else tmp_path
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--json", str(out)]) == 2
    cap = capsys.readouterr()
    _one_line_error(cap.err, str(out))
    assert "tpcheck diff:" not in cap.err  # refused before the run started


def _patch_step(monkeypatch, before):
    real = tpcheck.engines.impl.adapter.ImplAdapter.step

    def step(self, *args):
        before(self)
        return real(self, *args)
    monkeypatch.setattr(tpcheck.engines.impl.adapter.ImplAdapter, "step", step)


def test_rank_killed_mid_diff_is_named(ckpt, monkeypatch, capsys):
    """The driver writes the next step to the dead rank's pipe: it names the rank, not a BrokenPipeError."""
    pids = {}

    def kill_rank1(adapter):
        if not pids:
            pids.update(enumerate(adapter.llm.call("worker_fns:pid")))
            os.kill(pids[1], signal.SIGKILL)
            assert wait([adapter.llm.executor.procs[1].sentinel], 10)  # dead before the next step is sent
    _patch_step(monkeypatch, kill_rank1)
    before = descendants()
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--decode-steps", "2"]) == 3
    _one_line_error(capsys.readouterr().err, "TP rank 1 died (killed by SIGKILL)")
    assert descendants() <= before  # the other rank was torn down


def test_raising_rank_is_an_engine_failure(ckpt, monkeypatch, capsys):
    _patch_step(monkeypatch, lambda adapter: adapter.llm.call("worker_fns:runtime_error_on_rank", 1))
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2"]) == 3
    _one_line_error(capsys.readouterr().err, "rank 1", "RuntimeError", "Index put requires")


def test_debug_prints_the_rank_traceback(ckpt, monkeypatch, capsys):
    _patch_step(monkeypatch, lambda adapter: adapter.llm.call("worker_fns:runtime_error_on_rank", 1))
    assert main(["--debug", "diff", "--model", str(ckpt("tiny")), "--tp", "2"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "traceback on rank 1" in err and "worker_fns.py" in err


def test_exit_code_table():
    from impl.config import ConfigError
    from impl.loader import LoadError
    boom = ValueError("rank 1: ValueError: boom")
    boom.rank = 1
    cases = [(ConfigError("bad"), 2), (LoadError("bad"), 2), (ValueError("bad flag"), 2), (boom, 3),
             (RankError(0, "TP rank 0 died (exit code 1)"), 3), (PermissionError(13, "denied", "/x"), 3),
             (KeyError("surprise"), 3)]
    for e, code in cases:
        assert _exit_code(e)[0] == code, e
    assert "/x" in _exit_code(PermissionError(13, "denied", "/x"))[1]


def test_script_without_main_guard_runs(ckpt, tmp_path):
    """Spawned ranks do not re-run the user's script, so no ``if __name__ == "__main__":`` is needed."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(f"""
        from impl import LLM
        llm = LLM({str(ckpt("tiny"))!r}, tp_size=2)
        print("logits", tuple(llm.logits([1, 2, 3]).shape))
        llm.close()
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("logits (3, 250)") == 1  # once: the ranks did not run the script again


class _Reporting:
    """An adapter that reports ``names`` (replicated zeros) and nothing else."""

    reductions = None

    def __init__(self, names, hidden=64):
        self.names, self.hidden = names, hidden

    def begin(self, prompts, decode_steps):
        pass

    def step(self, new_tokens, teacher, capture_kv):
        import torch
        rows = sum(len(t) for t in new_tokens)
        return {n: (Replicate(), [torch.zeros(rows, self.hidden)]) for n in self.names}

    def close(self):
        pass


def test_adapter_reporting_nothing_does_not_pass(ckpt):
    r = compare_engine(_Reporting([]), str(ckpt("tiny")), [[1, 2, 3]], "float32")
    cov = r.meta["coverage"]
    assert cov["comparisons"] == 0 and "logits" in cov["not_reported"] and cov["problem"]
    assert not r.passed


def test_adapter_missing_required_points_does_not_pass(ckpt):
    r = compare_engine(_Reporting(["embed"]), str(ckpt("tiny")), [[1, 2, 3]], "float32")
    cov = r.meta["coverage"]
    assert cov["comparisons"] == 1
    assert set(cov["missing_required"]) == {"layers.0.out", "layers.1.out", "logits"}
    assert not r.passed
    relaxed = compare_engine(_Reporting(["embed"]), str(ckpt("tiny")), [[1, 2, 3]], "float32", require_points="embed")
    assert relaxed.meta["coverage"]["problem"] == "" and relaxed.meta["coverage"]["not_reported"]


def test_adapter_reporting_unknown_names_is_named(ckpt):
    with pytest.raises(ValueError, match=r"does not know: \['layer0.mlp'\]"):
        compare_engine(_Reporting(["layer0.mlp"]), str(ckpt("tiny")), [[1, 2, 3]], "float32")


def test_cli_coverage_failure_exits_3(ckpt, monkeypatch, capsys, tmp_path):
    real = tpcheck.engines.impl.adapter.ImplAdapter.step

    def no_logits(self, *args):
        points = real(self, *args)
        points.pop("logits", None)
        return points
    monkeypatch.setattr(tpcheck.engines.impl.adapter.ImplAdapter, "step", no_logits)
    out = tmp_path / "r.json"
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--json", str(out)]) == 3
    _one_line_error(capsys.readouterr().err, "coverage", "logits")
    assert json.loads(out.read_text())["meta"]["coverage"]["missing_required"] == ["logits"]


def test_gate_keeps_a_coverage_failure(ckpt, tmp_path):
    from tpcheck.cli.gate import regate
    r = compare_engine(_Reporting([]), str(ckpt("tiny")), [[1, 2, 3]], "float32")
    r.to_json(tmp_path / "r.json")
    code, msg = regate(tmp_path / "r.json")
    assert code == 3 and "0 comparisons" in msg
    assert main(["gate", str(tmp_path / "r.json")]) == 3


def test_a_rank_killed_at_pp_2_is_named_with_its_stage(ckpt, monkeypatch, capsys):
    """At pp > 1 a dead rank's number alone does not say where it ran: the message names its stage and its rank
    in the stage."""
    pids = {}

    def kill_rank1(adapter):
        if not pids:
            pids.update(enumerate(adapter.llm.call("worker_fns:pid")))
            os.kill(pids[1], signal.SIGKILL)
            assert wait([adapter.llm.executor.procs[1].sentinel], 10)
    _patch_step(monkeypatch, kill_rank1)
    before = descendants()
    assert main(["diff", "--model", str(ckpt("tiny")), "--tp", "1", "--pp", "2", "--decode-steps", "2"]) == 3
    _one_line_error(capsys.readouterr().err, "rank 1 (stage 1, TP rank 0 of 1) died (killed by SIGKILL)")
    assert descendants() <= before
