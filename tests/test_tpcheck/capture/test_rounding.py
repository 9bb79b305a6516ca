"""An engine run's declared rounding (``capture.rounding``) and what the judge allows for it: vLLM in bfloat16 on a
CPU without AVX512-BF16 declares truncation, whose negative gain (and nothing else) the local pass then allows; a
vLLM bfloat16 dump declares from the CPU flags it recorded, an older dump that lacks them keeps the propagated pass
by default, with a note; every other engine and dtype rounds to nearest."""
from __future__ import annotations

import logging
import math

import pytest

from tpcheck.capture import rounding
from tpcheck.capture.rounding import NEAREST, Rounding, cpu_has_bf16_rounding, declared_rounding, \
    least_known, local_pass_default_off, overridden
from tpcheck.judge import judge
from tpcheck.pipeline.diff import engine_rounding, local_pass
from tpcheck.result.table import DiffResult, Row

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n"


def test_cpu_flags_read_from_cpuinfo():
    assert not cpu_has_bf16_rounding(AVX2) and cpu_has_bf16_rounding(SPR)
    assert not cpu_has_bf16_rounding("")  # unreadable flags: the truncation allowed, not a failing run


@pytest.mark.parametrize("engine, dtype, cpu_bf16, mode", [
    ("vllm", "bfloat16", False, "truncate"),
    ("vllm", "bfloat16", True, "nearest"),
    ("vllm", "bfloat16", None, "unknown"),  # a dump that does not record its CPU
    ("vllm", "float32", False, "nearest"),
    ("vllm", "float16", False, "nearest"),
    ("impl", "bfloat16", False, "nearest"),
    ("hf-tp", "bfloat16", None, "nearest"),
])
def test_declared_rounding(engine, dtype, cpu_bf16, mode):
    r = declared_rounding(engine, dtype, cpu_bf16)
    assert r.mode == mode
    assert (local_pass_default_off(r) is not None) == (mode == "unknown")  # only an unknown one keeps it off
    if mode == "truncate":
        assert "avx512_bf16" in r.why and "truncate" in r.why
    if mode == "unknown":
        assert "--isolate" in local_pass_default_off(r) and "cpu_bf16_rounding" in r.why


def test_overridden_by_the_flag():
    t = declared_rounding("vllm", "bfloat16", False)
    assert overridden(t, None) is t and overridden(t, "truncate") is t
    assert overridden(t, "nearest").mode == "nearest" and "declared: truncate" in overridden(t, "nearest").why
    assert overridden(NEAREST, "truncate").mode == "truncate"
    with pytest.raises(ValueError, match="--rounding"):
        overridden(NEAREST, "up")


class _Live:
    """A live vLLM adapter's declaration, as ``VLLMAdapter.restart`` makes it from this CPU's flags."""
    teacher_forcing = True

    def __init__(self, engine: str, dtype: str):
        self.dtype = dtype
        if engine == "vllm":
            self.rounding = declared_rounding(engine, dtype, rounding.cpu_has_bf16_rounding())


def test_the_local_pass_is_on_by_default_for_a_declared_truncation(monkeypatch, caplog):
    monkeypatch.setattr(rounding.Path, "read_text", lambda self: AVX2)
    caplog.set_level(logging.WARNING, logger="tpcheck")
    live = _Live("vllm", "bfloat16")
    assert engine_rounding(live).mode == "truncate"
    assert local_pass(live, None, 2, engine_rounding(live)) is True and not caplog.text
    assert engine_rounding(_Live("impl", "bfloat16")) == NEAREST  # no declaration: to nearest
    assert engine_rounding(live, "nearest").mode == "nearest"
    monkeypatch.setattr(rounding.Path, "read_text", lambda self: SPR)
    assert engine_rounding(_Live("vllm", "bfloat16")).mode == "nearest"


def test_an_unknown_rounding_keeps_the_propagated_pass_unless_asked(caplog):
    class OldDump(_Live):
        rounding = declared_rounding("vllm", "bfloat16", None)
    caplog.set_level(logging.WARNING, logger="tpcheck")
    old = OldDump("impl", "bfloat16")
    assert local_pass(old, None, 2, engine_rounding(old)) is False
    assert "the verdict is the propagated pass alone" in caplog.text and "truncate" in caplog.text
    assert local_pass(old, True, 2, engine_rounding(old)) is True  # asked for: the finding is reported
    assert local_pass(old, None, 2, engine_rounding(old, "truncate")) is True  # declared on the command line


# ------------------------------------------------------------------ the judge with a declared rounding

SE = 2e-4  # gain_se of 2,000 elements: gain_threshold = gain_z(2000) * se = 6.54 * 2e-4 = 1.3e-3


def _judged(gain: float, mode: str | None, dtype: str = "bfloat16", rel_err: float = 4e-3) -> DiffResult:
    row = Row(point="layers.0.attn.q_rope", layer=0, step=0, mode="isolated", kind="attn.q_rope", rel_err=rel_err,
              ref_rel_err=4e-3, gain=gain, gain_se=SE, gain_n=2000.0, gain_floor=1e-6, ref_gain=0.0)
    meta = {"dtype": dtype, **({"rounding": Rounding(mode).as_meta()} if mode else {})}
    return judge(DiffResult.from_rows([row], meta, stamp=False))


def test_a_truncation_sized_shrink_passes_only_where_declared():
    g = -2.0 ** -8  # one truncation's mean at its largest: 3x the gain threshold
    near, trunc = _judged(g, None), _judged(g, "truncate")
    origin = near.summary().replace("\n    ", " ")  # its lines wrapped at 120 characters, joined again
    assert not near.passed and "why: a systematic gain: every element scaled by -0.00391 (threshold " in origin
    assert "rounding toward zero to bfloat16" in origin  # the origin names it (result.origin), and what to check:
    assert "next: check whether a kernel truncates its bfloat16 results (rounding toward zero): if so, --rounding " \
        "truncate" in origin
    assert trunc.passed, trunc.summary()
    row = trunc.table.iloc[0]
    assert bool(row.by_rounding) and row.gain_threshold == near.table.iloc[0].gain_threshold  # the column unchanged
    assert math.isclose(row.excess, 2.0 ** -8 / (row.gain_threshold + 2.0 ** -7))
    assert "rounding: declared truncate" in trunc.summary() and "1 rows' gain" in trunc.summary()
    assert not bool(near.table.iloc[0].by_rounding) and "rounding:" not in _judged(0.0, None).summary()


def test_a_positive_gain_is_judged_as_before_with_a_declared_truncation():
    for mode in (None, "truncate", "nearest"):  # the residual_gain fault's +2^-7
        r = _judged(2.0 ** -7, mode)
        assert not r.passed and not r.table.iloc[0].by_rounding
        assert r.table.iloc[0].excess == _judged(2.0 ** -7, None).table.iloc[0].excess


def test_a_shrink_beyond_the_allowance_fails():
    r = _judged(-(2.0 ** -7) - 1e-2, "truncate")  # past 2^-7 + the threshold
    assert not r.passed and not r.table.iloc[0].by_rounding
    assert "a systematic gain: every element scaled by -0.0178 (threshold " in r.summary()
    within = _judged(-(2.0 ** -7) - 1e-3, "truncate")  # 2^-7 past the threshold's noise, within its sum
    assert within.passed and within.table.iloc[0].by_rounding


def test_the_allowance_is_the_dtypes_and_a_failing_rel_err_still_fails():
    assert not _judged(-2.0 ** -8, "truncate", "float32").passed  # float32: no truncation allowed
    assert _judged(-2.0 ** -11, "truncate", "float16").passed  # float16: 2^-10
    assert not _judged(-2.0 ** -8, "truncate", "float16").passed
    r = _judged(-2.0 ** -8, "truncate", rel_err=1.0)  # the per-element rule is not widened
    origin = r.summary(brief=True).split("\n", 1)[1]  # the origin's lines: rel_err, its gain allowed
    assert not r.passed and "gain" not in origin and "why: above the noise floor: rel_err 1," in origin


def test_a_saved_result_keeps_its_declared_rounding(tmp_path):
    from tpcheck.result.table import load_result
    r = _judged(-2.0 ** -8, "truncate")
    r.to_json(tmp_path / "r.json")
    back = judge(load_result(tmp_path / "r.json"))  # tpcheck gate re-judges it by the same declaration
    assert back.passed and back.meta["rounding"]["mode"] == "truncate" and bool(back.table.iloc[0].by_rounding)


# ------------------------------------------------------------------ a dump's recorded CPU flags

def _dump(root, cpu_bf16: bool | None, engine: str = "vllm", dtype: str = "bfloat16", tp: int = 2):
    import json

    import torch

    from impl.placements import Replicate
    from tpcheck.capture.dump import DumpWriter
    from tpcheck.engines.dump.replay import read_dump
    for r in range(tp):
        w = DumpWriter(root, r, tp, dtype, engine, cpu_bf16_rounding=cpu_bf16)
        w.write(0, [[1, 2, 3]], [0], {"embed": (Replicate(), torch.ones(3, 8, dtype=getattr(torch, dtype)))})
    step = json.loads((root / "rank0" / "step0.json").read_text())
    assert ("cpu_bf16_rounding" in step) == (cpu_bf16 is not None)  # an old writer's step: the field absent
    return read_dump(root)


@pytest.mark.parametrize("cpu_bf16, engine, dtype, mode", [
    (False, "vllm", "bfloat16", "truncate"), (True, "vllm", "bfloat16", "nearest"),
    (None, "vllm", "bfloat16", "unknown"), (None, "impl", "bfloat16", "nearest"), (False, "vllm", "float32", "nearest"),
])
def test_a_dump_records_its_cpus_rounding_and_compare_declares_from_it(tmp_path, cpu_bf16, engine, dtype, mode):
    from tpcheck.engines.dump.replay import DumpAdapter
    dump = _dump(tmp_path, cpu_bf16, engine, dtype)
    assert dump.cpu_bf16_rounding is cpu_bf16 and dump.rounding.mode == mode
    adapter = DumpAdapter(dump)
    assert engine_rounding(adapter).mode == mode
    if mode == "truncate":
        assert "the CPU the dump ran on has no" in engine_rounding(adapter).why


def test_a_dump_whose_ranks_disagree_or_hold_a_bad_flag(tmp_path):
    import json

    from tpcheck.capture.dump import DumpError

    from tpcheck.engines.dump.replay import read_dump
    _dump(tmp_path, True)
    path = tmp_path / "rank1" / "step0.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "cpu_bf16_rounding": False}))
    assert read_dump(tmp_path).rounding.mode == "truncate"  # one rank's CPU truncates: the dump is declared so
    path.write_text(json.dumps({**meta, "cpu_bf16_rounding": "yes"}))
    with pytest.raises(DumpError, match="cpu_bf16_rounding must be true, false or absent"):
        read_dump(tmp_path)


def test_several_parts_declare_as_the_least_known_one():
    near, trunc, unknown = Rounding("nearest", "a"), Rounding("truncate", "b"), Rounding("unknown", "c")
    assert least_known([near, near]) == near
    assert least_known([near, trunc, near]) == trunc
    assert least_known(iter([trunc, unknown, near])) == unknown
