"""The least a diff can cost here: the bare forwards, plus the work that no verdict of every point can skip.

``benchmarks/diff_overhead.py`` times what a diff costs; this times what it cannot cost less than, on the same
model, prompt and engine, from its parts measured alone:

* the bare forwards (as ``diff_overhead.py``'s bare side: the float64 golden, HF at the dtype, the same with the TP
  reductions emulated, the engine's ``logits``);
* the least statistics: one float64 pass over every compared element, ``x - g`` and each row's norm (the relative
  errors and nothing else: no maximum, no percentile, no gain), for each run held to the golden: the engine and
  the two noise-floor references, three passes (the reference's points stand in for the engine's: the same shapes);
* one host copy of every point of each run that is captured: the golden, the two references, the engine;
* with the local pass (the default): the forwards it adds, the two references over the last ``--local-rows``
  positions on a cache of the rest and the engine over as many tokens (its ``logits`` of the last positions alone:
  a stand-in, without the cached prefix), and the same statistics and copies over those rows.

Each part is timed alone ``--repeats`` times and its least CPU time kept (this process and its TP workers). The
floor is the ratio of CPU work: (bare + least extra) / bare. It bounds the wall-time ratio from below where the
bare forwards keep every core busy (printed: their cores in use): the extra work then has no idle core to hide in.
On a machine with idle cores the extra can overlap the forwards, and the floor says less.

    python benchmarks/diff_floor.py [--preset qwen2.5-0.5b] [--tp 2] [--seq-len 128] [--dtype float32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import tree_cpu_s  # noqa: E402


def least(fn, repeats: int) -> tuple[float, float]:
    """``(least CPU seconds, least wall seconds)`` of ``fn()`` over ``repeats`` runs (this process and its workers)."""
    cpu, wall = [], []
    for _ in range(repeats):
        c, t = tree_cpu_s(os.getpid()), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(tree_cpu_s(os.getpid()) - c)
    return min(cpu), min(wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--local-rows", type=int, default=32, help="the local pass's rows (the default's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if not 0 < a.local_rows < a.seq_len:
        ap.error("--local-rows must be between 0 and --seq-len, exclusive")

    from tpcheck.engines.pool import EnginePool
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.pipeline.check import random_prompts
    from tpcheck.reference.cache import hf_capture
    from tpcheck.reference.reductions import Reductions
    print(f"checkpoint {a.preset} (written once, cached)...", file=sys.stderr, flush=True)
    model_dir = str(cached_checkpoint(a.preset))
    pool = EnginePool()
    try:
        llm = pool.get(model_dir, a.tp, a.dtype)
        golden, ref = hf_capture(model_dir, "float64"), hf_capture(model_dir, a.dtype)
        prompt = random_prompts(llm.cfg.vocab_size, 1, a.seq_len, 0)[0]
        tp_ref = Reductions(a.tp)  # the noise floor's second reference, at tp > 1
        refs = [None] + ([tp_ref] if tp_ref.emulated else [])
        parts, points, elements = measure(a, llm, golden, ref, refs, prompt)
    finally:
        pool.close()
    report(a, parts, points, elements, len(refs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "parts": parts, "points": points, "elements": elements}, f, indent=1)
    return 0


def measure(a, llm, golden, ref, refs: list, prompt: list[int]) -> tuple[dict, int, int]:
    """Each part's ``(least CPU s, least wall s)`` (module docstring), the points compared and their elements."""
    from tpcheck.measure.golden_stats import as_rows
    from tpcheck.reference.hf import forward_one, new_cache
    split = a.seq_len - a.local_rows

    def reference(ids: list[int], start: int, cache, reductions) -> None:
        ref.reductions = reductions  # HFCapture's row-parallel rounding (None: one device); no point captured
        try:
            with torch.no_grad():
                forward_one(ref.model, ids, cache, start)
        finally:
            ref.reductions = None

    def bare() -> None:
        with torch.no_grad():
            forward_one(golden.model, prompt, new_cache(golden.model), 0)
        for red in refs:
            reference(prompt, 0, new_cache(ref.model), red)
        llm.logits(prompt)

    g_pts = golden.step([prompt], [new_cache(golden.model)], [0])
    r_pts = ref.step([prompt], [new_cache(ref.model)], [0])
    names = [n for n in g_pts if n in r_pts and g_pts[n].shape == r_pts[n].shape and
             g_pts[n].is_floating_point() and g_pts[n].dim() > 0]
    pairs = [(as_rows(r_pts[n]), as_rows(g_pts[n])) for n in names]
    local = [(x[-a.local_rows:], g[-a.local_rows:]) for x, g in pairs if x.shape[0] == a.seq_len]

    def sweeps(pts) -> None:  # x - g in float64 and each row's norm: the relative errors alone
        for x, g in pts:
            d = x.to(torch.float64, copy=True)
            torch.linalg.vector_norm(d.sub_(g), dim=-1)

    def copies(pts) -> None:
        for x, _ in pts:
            x.clone()

    bare()  # warm
    parts = {"bare forwards": least(bare, a.repeats),
             "one float64 pass": least(lambda: sweeps(pairs), a.repeats),
             "one copy of every point": least(lambda: copies(pairs), a.repeats),
             "one float64 pass, local rows": least(lambda: sweeps(local), a.repeats),
             "one copy, local rows": least(lambda: copies(local), a.repeats)}
    cpu = []
    for _ in range(a.repeats):  # the references over the last rows on a fresh cache of the rest (filled untimed)
        caches = []
        for red in refs:
            caches.append(new_cache(ref.model))
            reference(prompt[:split], 0, caches[-1], red)
        c = tree_cpu_s(os.getpid())
        for red, cache in zip(refs, caches):
            reference(prompt[split:], split, cache, red)
        llm.logits(prompt[split:])  # the engine's stand-in: as many tokens, without the cached prefix
        cpu.append(tree_cpu_s(os.getpid()) - c)
    parts["local-pass forwards"] = (min(cpu), float("nan"))
    return parts, len(names), sum(g.numel() for _, g in pairs)


def report(a, parts: dict, points: int, elements: int, references: int) -> None:
    """Each part's least CPU time, and the floors of the propagated pass and of the default against the aims."""
    runs = references + 1  # held to the golden: the engine and each noise-floor reference
    bare_cpu, bare_wall = parts["bare forwards"]
    cores = os.cpu_count() or 1
    print(f"\n{a.preset}, tp {a.tp}, {a.dtype}, 1 prompt x {a.seq_len} tokens, {points} points compared "
          f"({elements / 1e6:.1f}M elements a run), {cores} CPU cores; least of {a.repeats}")
    for name, (c, w) in parts.items():
        print(f"  {name:32s}{c:7.2f} CPU s" + (f"{w:7.2f} s" if w == w else ""))
    print(f"  the bare forwards keep {bare_cpu / bare_wall:.2f} of {cores} cores busy")
    no_iso = runs * parts["one float64 pass"][0] + (runs + 1) * parts["one copy of every point"][0]
    local = parts["local-pass forwards"][0] + runs * parts["one float64 pass, local rows"][0] + \
        (runs + 1) * parts["one copy, local rows"][0]
    for name, extra, aim in (("--no-isolate", no_iso, 1.1), ("default (with the local pass)", no_iso + local, 1.4)):
        print(f"{name:30s} least extra {extra:5.2f} CPU s: floor {(bare_cpu + extra) / bare_cpu:.2f}x the bare "
              f"forwards' work (the aim: {aim}x)")


if __name__ == "__main__":
    sys.exit(main())
