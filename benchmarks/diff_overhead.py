"""What ``tpcheck diff`` costs over the forward passes it needs anyway.

Bare: HF float64 forward + HF forward at the test dtype (+ the same with the TP reductions emulated, the
noise floor's second reference, at tp > 1) + impl forward (``LLM.logits``) on the same prompt. Diff:
``tpcheck.diff`` on the same engine and prompt (hooks, transfers, unsharding, float64 statistics), by default
(the propagated pass and the local pass, which reuses the golden's points) and with ``--no-isolate`` (the
propagated pass alone: the default before the local pass) and ``--local-rows 0`` (the local pass on every row of
the prompt: the default before ``tpcheck.pipeline.local_rows``). Models are loaded and warmed before timing, so every
side times forward work only. The sides alternate (bare, diff, no-isolate, exact-ops, bare, ...) so that a slow spell of
a shared machine hits all; the ratio is of the
medians, and the min ratio is printed beside it. Peak memory is the largest summed RSS of this process and
its TP workers while each side runs; CPU seconds are those of this process and its TP workers (on a shared
machine they move less than wall time).

    python benchmarks/diff_overhead.py [--preset qwen2.5-0.5b] [--tp 2] [--seq-len 128] [--dtype float32] [--exact-ops]
                                       [--in-place]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import PeakRSS, tree_cpu_s  # noqa: E402


# (file suffix, function) -> part of a diff; cumulative times from one profiled run
PARTS = {
    "HF references: golden, dtype, TP (forward + hooks)": [("reference/hf.py", "step")],
    "engine step (ranks' forward + hooks + transfer)": [("engines/impl/adapter.py", "step")],
    "unsharding": [("unshard.py", "unshard")],
    # the engine's points (compare) and the noise floor's references (row_rel_errs), which pipeline.steps calls
    "statistics (float64 errors, worst rows)": [("metrics.py", "compare"), ("metrics.py", "row_errors")],
    "gain (the local pass: engine and references)": [("measure/gain.py", "gain_of")],
    "judging": [("judge/verdict.py", "judge")],
}


def breakdown(fn) -> dict:
    """Seconds per part of one ``fn()`` under cProfile (``PARTS``), and ``total``."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(fn)
    total = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, prim calls, tottime, cumtime, callers)
    out = {}
    for part, keys in PARTS.items():
        out[part] = sum(v[3] for (f, _, name), v in stats.items() if any(f.endswith(s) and name == n for s, n in keys))
    out["total"] = total
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each side, alternating")
    ap.add_argument("--exact-ops", action="store_true", help="time tpcheck diff --exact-ops")
    ap.add_argument("--in-place", action="store_true", help="also time the default with its statistics in place")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()

    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import run
    from tpcheck.pipeline.check import random_prompts
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.reference.cache import hf_capture
    from tpcheck.engines.pool import EnginePool
    from tpcheck.reference.reductions import Reductions
    log = sys.stderr
    print(f"checkpoint {a.preset} (written once, cached)...", file=log, flush=True)
    model_dir = str(cached_checkpoint(a.preset))
    pool = EnginePool()
    try:
        llm = pool.get(model_dir, a.tp, a.dtype)
        golden, ref = hf_capture(model_dir, "float64"), hf_capture(model_dir, a.dtype)
        prompt = random_prompts(llm.cfg.vocab_size, 1, a.seq_len, 0)[0]
        ids = torch.tensor([prompt])

        tp_ref = Reductions(a.tp)  # the noise floor's TP reference (tpcheck.reference.reductions): a 4th pass at tp > 1

        def bare():
            with torch.no_grad():
                golden.model(ids)
                ref.model(ids)
                if tp_ref.emulated:
                    ref.reductions = tp_ref  # HFCapture's row-parallel rounding, no point captured
                    try:
                        ref.model(ids)
                    finally:
                        ref.reductions = None
            llm.logits(prompt)

        def mode(**kw):  # one verdict mode of tpcheck diff on the same engine and prompt
            kw.setdefault("exact_ops", a.exact_ops)
            return lambda: run(DiffOptions(model=model_dir, tp=a.tp, dtype=a.dtype, prompts=[prompt], **kw), pool=pool)
        # the default: the propagated and the local pass; --no-isolate: the propagated pass alone (the default
        # before the local pass); --exact-ops: the default and the op checks
        diff, propagated, exact = mode(), mode(isolate=False), mode(exact_ops=True)

        sides = {"bare forwards": bare, "tpcheck diff": diff, "--no-isolate": propagated,
                 "--local-rows 0": mode(local_rows=0)}  # the local pass on every row: the default before
        if not a.exact_ops:  # the third verdict mode, timed beside the others
            sides["--exact-ops"] = exact
        if a.in_place:  # the default with every point's statistics computed in the main thread (one worker)
            sides["in place"] = in_place(diff)
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        peak: dict[str, int] = {name: 0 for name in sides}
        for i in range(a.repeats):
            for name, fn in sides.items():
                with PeakRSS() as mem:
                    c, t = tree_cpu_s(os.getpid()), time.perf_counter()
                    out = fn()
                    times[name].append(time.perf_counter() - t)
                    cpu[name].append(tree_cpu_s(os.getpid()) - c)
                peak[name] = max(peak[name], mem.peak)
            print(f"run {i + 1}/{a.repeats}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), file=log)
        assert out.passed, out.summary()
        figures = {name: {"seconds": statistics.median(t), "min_seconds": min(t), "all_seconds": t,
                          "cpu_seconds": statistics.median(cpu[name]), "all_cpu_seconds": cpu[name],
                          "peak_rss_gib": peak[name] / 2**30} for name, t in times.items()}
        parts = breakdown(in_place(diff))  # cProfile sees the main thread: the statistics computed there
    finally:
        pool.close()
    report(a, figures, parts)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "figures": figures, "breakdown": parts}, f, indent=1)
    return 0


def in_place(fn):
    """``fn`` run with ``tpcheck.measure.ahead`` at one worker: each point's statistics in the main thread, as
    before they were computed ahead."""
    from tpcheck.measure import ahead  # imported where main imports tpcheck (after its first message)

    def run_in_place():
        workers, ahead.WORKERS = ahead.WORKERS, 1
        try:
            return fn()
        finally:
            ahead.WORKERS = workers
    return run_in_place


def report(a, figures: dict, parts: dict) -> None:
    """Print the sides' medians and ratios, and where one diff's time goes."""
    b, d = figures["bare forwards"], figures["tpcheck diff"]
    print(f"\n{a.preset}, tp {a.tp}, {a.dtype}, 1 prompt x {a.seq_len} tokens, {os.cpu_count()} CPU cores")
    print(f"{'':16s}{'median s':>10s}{'min s':>8s}{'peak RSS GiB':>14s}{'median CPU s':>14s}")
    for name, f in figures.items():
        print(f"{name:16s}{f['seconds']:10.2f}{f['min_seconds']:8.2f}{f['peak_rss_gib']:14.2f}"
              f"{f['cpu_seconds']:14.2f}")
    n = figures["--no-isolate"]
    every = figures["--local-rows 0"]
    pairs = [("diff / bare", d, b), ("no-iso / bare", n, b), ("diff / no-iso", d, n), ("all-rows / bare", every, b)]
    if "--exact-ops" in figures:
        pairs.append(("exact / bare", figures["--exact-ops"], b))
    if "in place" in figures:
        pairs += [("in place / bare", figures["in place"], b), ("diff / in place", d, figures["in place"])]
    for name, x, y in pairs:
        print(f"{name:16s}{x['seconds'] / y['seconds']:9.2f}x{x['min_seconds'] / y['min_seconds']:7.2f}x"
              f"{x['peak_rss_gib'] / y['peak_rss_gib']:13.2f}x{x['cpu_seconds'] / y['cpu_seconds']:13.2f}x")
    total = parts["total"]
    print(f"\nwhere one diff's {total:.2f}s go (cProfile, cumulative, its statistics in place; the parts overlap where "
          "they nest):")
    for name, secs in ((n, v) for n, v in parts.items() if n != "total"):
        print(f"  {name:44s}{secs:7.2f}s {100 * secs / total:5.1f}%")


if __name__ == "__main__":
    sys.exit(main())
