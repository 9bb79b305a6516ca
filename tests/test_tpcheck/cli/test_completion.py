"""``tpcheck completion bash``: the generated script completes subcommands, nested subcommands, flags and a
flag's choices, as bash itself runs it."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tpcheck.cli.app import _parser, main
from tpcheck.cli.completion import bash_script

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _complete(script_path, line: str) -> list[str]:
    words = line.split(" ")
    cmd = (f"source {script_path}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
           f"COMP_CWORD={len(words) - 1}; _tpcheck; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout
    return [w for w in out.splitlines() if w]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    p = tmp_path_factory.mktemp("completion") / "tpcheck.bash"
    p.write_text(bash_script(_parser()))
    return p


@pytest.mark.parametrize("line, want", [
    ("tpcheck di", ["diff"]),
    ("tpcheck compare-r", ["compare-results"]),
    ("tpcheck faults m", ["matrix"]),
    ("tpcheck faults matrix --no", ["--no-clean"]),
    ("tpcheck diff --eng", ["--engine"]),
    ("tpcheck diff --engine h", ["hf-tp"]),
    ("tpcheck diff --tp 2 --preset small", ["small", "small-outliers", "small-hd32", "small-llama", "small-qwen3", "small-gemma3", "small-w8a8",
                                             "small-w8a8-tensor", "small-gptq", "small-gptq-act",
                                             "small-awq", "small-fp8", "small-fp8-tensor", "small-fp8-static",
                                             "small-fp8-kv", "small-fp8-kv-head"]),
    ("tpcheck sweep --qui", ["--quiet"]),
    ("tpcheck diff --inject qkv_sh", ["qkv_shard_dim1"]),  # fault names
    ("tpcheck diff --inject rope_skipped,qkv_b", ["rope_skipped,qkv_bias_missing"]),  # the last of a list
    ("tpcheck faults matrix --faults untied", ["untied_lm_head"]),
    ("tpcheck sweep --preset tiny,tiny-m", ["tiny,tiny-mha", "tiny,tiny-mqa", "tiny,tiny-mistral", "tiny,tiny-mixtral",
                                           "tiny,tiny-moe-ties"]),  # preset names
])
def test_bash_completes(script, line, want):
    assert _complete(script, line) == want


def test_completion_command_prints_the_script(capsys):
    assert main(["completion", "bash"]) == 0
    out = capsys.readouterr().out
    assert "complete -o filenames -F _tpcheck tpcheck" in out
    assert main(["completion", "zsh"]) == 0
    assert capsys.readouterr().out.startswith("autoload -U +X bashcompinit && bashcompinit")


def test_version_answers_without_importing_torch():
    import sys
    code = ("import sys; from tpcheck.cli.app import main; rc = main(['--version']); "
            "print(rc, 'torch' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "tpcheck" and out[-3:] == ["0", "False", "False"], out
