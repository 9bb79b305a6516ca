"""tpcheck.options.DiffOptions: every option round-trips through ``to_argv()`` and the ``tpcheck diff`` parser, so
a result's recorded command names the same run; the Python API and the CLI build the same object."""
from __future__ import annotations

import shlex
from dataclasses import fields

import pytest

from tpcheck import options
from tpcheck.cli.app import _parser
from tpcheck.options import DiffOptions

# a value other than the default for every field
CHANGED = {"model": "/ckpt/dir", "preset": "tiny", "tp": 4, "dtype": "bfloat16", "prompts": ((1, 2, 3), (7,)),
           "decode_steps": 3, "block_size": 8, "isolate": True, "local_rows": 0, "rounding": "truncate",
           "exact_ops": True, "inject": ("rope_skipped", "x"),
           "inject_layer": 1, "engine": "hf-tp", "seq_len": 9, "batch": 3, "seed": 5, "ep": 2, "pp": 2,
           "pp_partition": "1,1",
           "points": r"layers\.\d+\.out|logits", "layers": (0, 2, 3), "require_points": "logits",
           "fail_fast": True, "golden": "/g", "save_golden": "/sg", "streamed": True, "dump": "/d",
           "dump_points": "embed", "dump_budget_mb": 1.5, "tolerances": "/t.toml", "device": "cuda:1",
           "golden_device": "cpu"}


def parse(argv: list[str]) -> DiffOptions:
    return options.from_args(_parser().parse_args(argv))


def test_every_field_has_a_changed_value():
    names = {f.name for f in fields(DiffOptions)}
    assert names == set(CHANGED), names ^ set(CHANGED)
    assert all(CHANGED[f.name] != f.default for f in fields(DiffOptions))


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_each_option_round_trips(name):
    # model and preset exclude each other: a model names the run (its preset is not used)
    base = {"model": "/m"} if name != "preset" else {}
    opts = DiffOptions(**{**base, name: CHANGED[name]})
    argv = opts.to_argv()
    assert parse(argv) == opts, argv
    flag = next(f.metadata["flag"] for f in fields(DiffOptions) if f.name == name)
    assert flag in argv


def test_all_options_at_once_round_trip():
    opts = DiffOptions(**{k: v for k, v in CHANGED.items() if k != "preset"})
    assert parse(opts.to_argv()) == opts
    preset = DiffOptions(**{k: v for k, v in CHANGED.items() if k != "model"})
    assert parse(preset.to_argv()) == preset


def test_the_api_and_the_cli_build_the_same_options():
    cli = parse(["diff", "--tp", "2", "--engine", "hf-tp", "--points", "logits", "--layers", "0-1", "--fail-fast",
                 "--golden", "/g", "--golden-streamed", "--require-points", "embed"])
    api = DiffOptions.of(tp=2, engine="hf-tp", points="logits", layers=[0, 1], fail_fast=True, golden="/g",
                         streamed=True, require_points="embed")
    assert cli == api


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="fail_fsat"):
        DiffOptions.of(fail_fsat=True)


def test_the_cli_default_tp_is_2_and_the_api_default_is_1():
    assert parse(["diff"]).tp == 2 and DiffOptions().tp == 1


def test_a_diff_records_the_command_of_the_same_run(ckpt, engines):
    """The recorded command of an API run with every selection option, parsed back, gives the options of the run
    (with the checkpoint directory and the prompts it resolved)."""
    import tpcheck
    d = str(ckpt("tiny"))
    r = tpcheck.diff(model=d, tp=2, prompts=[[1, 2, 3]], decode_steps=1, pool=engines, points=r"layers\.\d+\.out",
                     layers=[1], fail_fast=True, require_points=r"layers\.1\.out")
    argv = shlex.split(r.meta["command"])[1:]
    assert parse(argv) == DiffOptions(model=d, tp=2, prompts=((1, 2, 3),), decode_steps=1,
                                      points=r"layers\.\d+\.out", layers=(1,), fail_fast=True,
                                      require_points=r"layers\.1\.out")
