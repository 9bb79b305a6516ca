"""How an engine build rounds its float32 results to its dtype, declared per run: ``"nearest"`` (the default: what
the references do) or ``"truncate"`` (toward zero), and what the local pass's gain rule allows for it.

vLLM's CPU kernels on a CPU without AVX512-BF16 convert their float32 results to bfloat16 by truncation, not by
rounding to nearest: its RoPE output equals the float32 result with the low 16 bits dropped, bit for bit (README
"The local pass of `--engine vllm`"). Truncation loses half an ulp on average, a relative -2^-9 .. -2^-8 per row:
a systematic shrink the local pass's gain finds after RoPE on every clean run (``result.origin.truncation_like``
names it). It is a true finding about the kernel, not a TP bug. So such a run declares ``"truncate"``
(``declared_rounding``), and the judge widens the gain threshold on the negative side only, by what truncation
explains (``tpcheck.judge.verdict.rounding_allowance``: 2^-bits, two truncating ops in a row at their largest
mean loss); a positive gain, or a shrink beyond that, is judged as before, and each row that passed only by the
allowance says so (``by_rounding``). The local pass stays on by default.

Where the declaration comes from: ``--engine vllm`` in bfloat16 reads this CPU's flags (``cpu_has_bf16_rounding``);
the ``TPCHECK_DUMP`` plugin records the flags of the CPU it ran on in the dump (``cpu_bf16_rounding``) and
``tpcheck compare`` declares from that. A vLLM bfloat16 dump written before that field existed (its CPU unknown:
``UNKNOWN``) keeps the propagated pass by default, with a note, and ``--isolate`` asks for the local pass. Every
other engine, dtype and build rounds to nearest (``NEAREST``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # hardware float32 -> bfloat16 conversion, rounding to nearest
MODES = ("nearest", "truncate")


@dataclass(frozen=True)
class Rounding:
    """An engine run's declared rounding: ``mode`` (``"nearest"``, ``"truncate"``, or ``"unknown"``: a vLLM
    bfloat16 dump that does not record its CPU) and ``why`` (the evidence: the CPU's flags, or what is missing)."""

    mode: str = "nearest"
    why: str = ""

    def as_meta(self) -> dict:
        return {"mode": self.mode, "why": self.why}


NEAREST = Rounding()


def cpu_has_bf16_rounding(cpuinfo: str | None = None) -> bool:
    """Whether this CPU converts float32 to bfloat16 in hardware (``BF16_CPU_FLAGS`` in ``/proc/cpuinfo``'s flags);
    False where the flags cannot be read (the conservative side: the negative gain allowed, not a failing run)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return any(f in flags for f in BF16_CPU_FLAGS)


def declared_rounding(engine: str, dtype: str, cpu_bf16: bool | None, where: str = "this CPU") -> Rounding:
    """The rounding of ``engine`` (``"vllm"``, ``"impl"``, ...) in ``dtype`` on a CPU with (``cpu_bf16`` True) or
    without (False) ``BF16_CPU_FLAGS``, or where that is not known (None: a dump that did not record it).
    ``where`` names that CPU in ``why``. Only vLLM's bfloat16 CPU kernels are known to truncate."""
    if engine != "vllm" or dtype != "bfloat16":
        return NEAREST
    if cpu_bf16 is None:
        return Rounding("unknown", "a vLLM bfloat16 dump that does not record its CPU's flags (written before "
                                   "the dump recorded cpu_bf16_rounding)")
    flags = " / ".join(BF16_CPU_FLAGS)
    if cpu_bf16:
        return Rounding("nearest", f"{where} has {flags}: vLLM's CPU kernels round float32 to bfloat16 to nearest")
    return Rounding("truncate", f"{where} has no {flags}: vLLM's CPU kernels truncate float32 results to bfloat16 "
                                "(docs/measured/depth.md \"The local pass of `--engine vllm`\")")


def overridden(declared: Rounding, mode: str | None) -> Rounding:
    """``declared``, or ``mode`` where ``--rounding`` names one (the declaration it replaced kept in ``why``)."""
    if mode is None or mode == declared.mode:
        return declared
    if mode not in MODES:
        raise ValueError(f"--rounding: {mode!r} is not one of {', '.join(MODES)}")
    return Rounding(mode, f"--rounding {mode} (declared: {declared.mode}{': ' + declared.why if declared.why else ''})")


def least_known(roundings) -> Rounding:
    """One declaration for several parts of one engine (the stages of a pipeline, each its own dump): any part's
    ``unknown``, else any part's ``truncate`` (the allowance a truncating part needs), else ``nearest``."""
    order = ("unknown", "truncate", "nearest")
    return min(roundings, key=lambda r: order.index(r.mode))


def local_pass_default_off(rounding: Rounding) -> str | None:
    """Why the local pass is not on by default for an engine run of this declared rounding, or None: only an
    unknown one (a vLLM bfloat16 dump that does not record its CPU) keeps the propagated pass."""
    if rounding.mode != "unknown":
        return None
    return (f"{rounding.why}: vLLM's CPU kernels without AVX512-BF16 truncate float32 results to bfloat16, which "
            "the local pass reports by its gain after RoPE on every run unless the rounding is declared (docs/measured/depth.md "
            "\"The local pass of `--engine vllm`\"); --isolate asks for it, --rounding truncate declares it")
