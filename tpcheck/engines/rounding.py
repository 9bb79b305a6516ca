"""What is known of an engine build's rounding that the local pass's gain statistic reports, and so whether the
local pass is on by default for it.

vLLM's CPU kernels on a CPU without AVX512-BF16 convert their float32 results to bfloat16 by truncation, not by
rounding to nearest: its RoPE output equals the float32 result with the low 16 bits dropped, bit for bit (README
"The local pass of `--engine vllm`"). Truncation loses half an ulp on average, a relative -2^-9 .. -2^-8 per row:
a systematic shrink the local pass's gain finds after RoPE on every clean run, and names (``result.origin``
``truncation_like``). It is a true finding about the kernel, not a TP bug, so such a run keeps the propagated pass
by default, with a note, and ``--isolate`` asks for the local pass and its finding. A floor for a declared
rounding mode would let the local pass stay on; it is not built."""
from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # hardware float32 -> bfloat16 conversion, rounding to nearest


def cpu_has_bf16_rounding(cpuinfo: str | None = None) -> bool:
    """Whether this CPU converts float32 to bfloat16 in hardware (``BF16_CPU_FLAGS`` in ``/proc/cpuinfo``'s flags);
    False where the flags cannot be read (the conservative side: the note, not a failing run)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return any(f in flags for f in BF16_CPU_FLAGS)


def local_pass_default_off(engine: str, dtype: str, where: str = "live") -> str | None:
    """Why the local pass is not on by default for ``engine`` (``"vllm"``, ``"impl"``, ...) in ``dtype``, or None.
    ``where``: ``"live"`` (the engine runs on this CPU, whose flags decide) or ``"dump"`` (it ran on a machine
    tpcheck cannot see: a vLLM bfloat16 dump keeps the propagated pass by default)."""
    if engine != "vllm" or dtype != "bfloat16" or (where == "live" and cpu_has_bf16_rounding()):
        return None
    machine = "this CPU has no AVX512-BF16" if where == "live" else "a vLLM bfloat16 dump (its CPU unknown)"
    return (f"{machine}: vLLM's CPU kernels there truncate float32 results to bfloat16, which the local pass "
            "reports by its gain after RoPE on every run (README \"The local pass of `--engine vllm`\"); "
            "--isolate asks for it")
