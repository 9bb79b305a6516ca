"""Whether the local pass is on by default for an engine build whose rounding it reports (``engines.rounding``):
vLLM in bfloat16 on a CPU without AVX512-BF16 keeps the propagated pass unless asked, with a note; the rest on."""
from __future__ import annotations

import logging

import pytest

from tpcheck.engines import rounding
from tpcheck.engines.rounding import cpu_has_bf16_rounding, local_pass_default_off
from tpcheck.pipeline.diff import local_pass

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n"


def test_cpu_flags_read_from_cpuinfo():
    assert not cpu_has_bf16_rounding(AVX2) and cpu_has_bf16_rounding(SPR)
    assert not cpu_has_bf16_rounding("")  # unreadable flags: the conservative side (the note, not a failing run)


@pytest.mark.parametrize("flags, engine, dtype, where, off", [
    (AVX2, "vllm", "bfloat16", "live", True),
    (SPR, "vllm", "bfloat16", "live", False),
    (AVX2, "vllm", "float32", "live", False),
    (AVX2, "vllm", "float16", "live", False),
    (AVX2, "impl", "bfloat16", "live", False),
    (SPR, "vllm", "bfloat16", "dump", True),  # a dump's CPU is not this one
    (AVX2, "impl", "bfloat16", "dump", False),
])
def test_local_pass_default_off(monkeypatch, flags, engine, dtype, where, off):
    monkeypatch.setattr(rounding.Path, "read_text", lambda self: flags)
    why = local_pass_default_off(engine, dtype, where)
    assert (why is not None) == off
    if off:
        assert "truncate" in why and "--isolate" in why


class _Live:
    teacher_forcing = True

    def __init__(self, engine_name: str, dtype: str):
        self.engine_name, self.dtype = engine_name, dtype


def test_local_pass_default_follows_the_rule_and_isolate_overrides(monkeypatch, caplog):
    monkeypatch.setattr(rounding, "cpu_has_bf16_rounding", lambda cpuinfo=None: False)
    caplog.set_level(logging.WARNING, logger="tpcheck")
    assert local_pass(_Live("vllm", "bfloat16"), None, 2) is False
    assert "the verdict is the propagated pass alone" in caplog.text and "truncate" in caplog.text
    assert local_pass(_Live("vllm", "bfloat16"), True, 2) is True  # asked for: the finding is reported
    assert local_pass(_Live("vllm", "float32"), None, 2) is True
    assert local_pass(_Live("impl", "bfloat16"), None, 2) is True
    monkeypatch.setattr(rounding, "cpu_has_bf16_rounding", lambda cpuinfo=None: True)
    assert local_pass(_Live("vllm", "bfloat16"), None, 2) is True
