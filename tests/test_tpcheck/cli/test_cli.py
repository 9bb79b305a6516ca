"""The command lines: exit codes 0 / 2 and their output."""
from __future__ import annotations

import json
import subprocess
import sys

from tpcheck.cli.app import main


def test_make_checkpoint_and_presets(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "tiny-mqa", "--out", str(tmp_path / "ck"), "--shards", "2"]) == 0
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ck")]) == 2  # not empty
    assert str(tmp_path / "ck") in capsys.readouterr().err
    assert main(["presets"]) == 0
    assert "qwen2.5-0.5b" in capsys.readouterr().out


def test_check_passes_on_clean_impl(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["check", "--model", str(ckpt("tiny-mqa")), "--tp", "1,2", "--seq-len", "12", "--batch", "1",
               "--json", str(out)])
    assert rc == 0
    assert "PASS" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["passed"] and {r["tp"] for r in data["rows"]} == {1, 2}


def test_check_bad_input_exits_2(ckpt, tmp_path, capsys):
    assert main(["check", "--model", str(tmp_path), "--tp", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["check", "--model", str(ckpt("tiny")), "--tp", "3"]) == 2
    assert "not divisible by tp_size=3" in capsys.readouterr().err
    assert main(["check", "--model", str(ckpt("tiny")), "--tp", "1", "--prompt-ids", "1,999"]) == 2


def test_impl_generate_cli(ckpt):
    r = subprocess.run([sys.executable, "-m", "impl", "generate", "--model", str(ckpt("tiny")), "--tp", "2",
                        "--prompt-ids", "1,2,3", "--prompt-ids", "9", "--max-new-tokens", "5", "--ignore-eos"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == [[1, 2, 3], [9]]
    assert all(len(row["token_ids"]) == 5 for row in rows)
    bad = subprocess.run([sys.executable, "-m", "impl", "generate", "--model", str(ckpt("tiny")),
                          "--prompt-ids", "1,250"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "token id 250 is outside the vocab" in bad.stderr


def test_no_arguments_runs_the_layer_by_layer_diff(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TPCHECK_CACHE", str(tmp_path))  # the embedded default checkpoint, written once
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "worst point per layer" in out and "PASS: tp=2 float32" in out


def test_diff_flags_without_a_command_mean_diff():
    from tpcheck.cli.app import _parser, default_command
    assert default_command([]) == ["diff", "--layer-by-layer"]
    assert default_command(["--tp", "4", "--no-isolate"]) == ["diff", "--tp", "4", "--no-isolate"]
    assert default_command(["--help"]) == ["--help"] and default_command(["gate", "r.json"]) == ["gate", "r.json"]
    a = _parser().parse_args(default_command(["--tp", "4", "--no-isolate"]))
    assert a.cmd == "diff" and a.tp == 4


def test_logprobs_close_is_vllms_rule():
    import torch

    from tpcheck.pipeline.check import logprobs_close
    gold = torch.tensor([[5.0, 4.9, 1.0, 0.0], [0.0, 1.0, 2.0, 9.0]])
    near_tie = torch.tensor([[4.9, 5.0, 1.0, 0.0], [0.0, 1.0, 2.0, 9.0]])  # swapped top-2: in each other's top 2
    far = torch.tensor([[0.0, 1.0, 9.0, 0.5], [0.0, 1.0, 2.0, 9.0]])       # top token 2: not in golden's top 2
    assert logprobs_close(gold, gold, 1) and logprobs_close(near_tie, gold, 2)
    assert not logprobs_close(near_tie, gold, 1) and not logprobs_close(far, gold, 2)


def test_check_logprobs_topk_in_the_verdict(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["check", "--model", str(ckpt("tiny")), "--tp", "2", "--seq-len", "8", "--batch", "1",
                 "--logprobs-topk", "5", "--json", str(out)]) == 0
    assert all(r["logprobs_close"] for r in json.loads(out.read_text())["rows"])
    assert main(["check", "--model", str(ckpt("tiny")), "--tp", "2", "--logprobs-topk", "0"]) == 2
    assert "--logprobs-topk must be >= 1" in capsys.readouterr().err
