"""What a dump costs on impl, per point kind, and how fast ``tpcheck compare`` reads one back.

For one prompt of ``--seq-len`` tokens at ``--tp``, impl's own serving path (``generate_dumped``, one new token)
with a dump that keeps one point kind alone (``TPCHECK_DUMP_POINTS``-style regex: hooks only where that kind comes
from), against the same ``generate`` with no dump: the kind's **bytes per token per layer** (every rank's files,
over tokens x the layers that have the kind) and its **time per hook** ((dumped - bare) / the layers it hooks;
ranks hook in parallel). Then one dump of every point is compared as ``tpcheck compare`` does (``compare_engine``
on a ``DumpAdapter``: the golden and both references run, every point unsharded and measured): **points/s** and
**MB/s** of dump read, end to end. The sides alternate (bare, kind 1, kind 2, ..., bare, ...) so that a slow spell
of a shared machine hits all; medians, with the spread of the per-hook times (min-max over the repeats).

    python benchmarks/dump_cost.py [--preset small] [--tp 2] [--seq-len 128] [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_json_arg, dir_bytes, kinds_of  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating")
    add_json_arg(ap)
    a = ap.parse_args()

    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped, get_llm
    from tpcheck.engines.pool import EnginePool
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.pipeline.check import random_prompts
    model_dir = str(cached_checkpoint(a.preset))
    params = SamplingParams(max_tokens=1)
    tmp = Path(tempfile.mkdtemp(prefix="dump_cost-"))
    pool = EnginePool()
    try:
        llm = get_llm(pool, model_dir, a.tp, a.dtype)
        prompt = random_prompts(llm.cfg.vocab_size, 1, a.seq_len, 0)[0]
        kinds = kinds_of(llm.cfg)
        n = 0

        def dumped(points: str | None) -> tuple[float, int]:
            nonlocal n
            root = tmp / f"d{n}"
            n += 1
            t = time.perf_counter()
            generate_dumped(llm, [prompt], params, root, points=points)
            secs = time.perf_counter() - t
            size = dir_bytes(root)
            shutil.rmtree(root)
            return secs, size

        def bare() -> float:
            t = time.perf_counter()
            llm.generate([prompt], params)
            return time.perf_counter() - t

        bare()
        dumped(None)  # warm-up: the hooks' first installation
        base: list[float] = []
        per_kind: dict[str, dict] = {k: {"seconds": [], "bytes": 0} for k in kinds}
        for i in range(a.repeats):
            base.append(bare())
            for kind, names in kinds.items():
                secs, size = dumped("|".join(re.escape(p) for p in names))
                per_kind[kind]["seconds"].append(secs)
                per_kind[kind]["bytes"] = size
            print(f"run {i + 1}/{a.repeats} done", file=sys.stderr, flush=True)
        b = statistics.median(base)
        figures = {}
        for kind, f in per_kind.items():
            hooks = len(kinds[kind])  # one hook per layer that has the kind (ranks in parallel)
            extra = [s - b for s in f["seconds"]]
            figures[kind] = {"bytes_per_token_layer": f["bytes"] / a.seq_len / hooks, "hooks": hooks,
                             "ms_per_hook": 1e3 * statistics.median(extra) / hooks,
                             "ms_per_hook_min": 1e3 * min(extra) / hooks, "ms_per_hook_max": 1e3 * max(extra) / hooks}
        compare_fig = compare_rate(llm, model_dir, prompt, a, tmp / "all")
    finally:
        pool.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(a, b, figures, compare_fig)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "bare_seconds": b, "kinds": figures, "compare": compare_fig}, f, indent=1)
    return 0


def compare_rate(llm, model_dir: str, prompt: list[int], a, root: Path) -> dict:
    """A dump of every point, compared ``a.repeats`` times as ``tpcheck compare`` does: rows/s and MiB/s."""
    from impl import SamplingParams
    from tpcheck.engines.dump.replay import DumpAdapter, read_dump
    from tpcheck.engines.impl.adapter import generate_dumped
    from tpcheck.pipeline.diff import compare_engine
    from tpcheck.reference.reductions import Reductions
    generate_dumped(llm, [prompt], SamplingParams(max_tokens=1), root)
    size = dir_bytes(root)
    secs = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        r = compare_engine(DumpAdapter(read_dump(root), Reductions(a.tp)), model_dir, [prompt], a.dtype, 0)
        secs.append(time.perf_counter() - t)
    s = statistics.median(secs)
    return {"points": len(r.table), "dump_mib": size / 2**20, "points_per_s": len(r.table) / s,
            "mib_per_s": size / 2**20 / s, "seconds": s, "passed": bool(r.passed)}


def report(a, bare: float, figures: dict, cmp: dict) -> None:
    print(f"\n{a.preset}, tp {a.tp}, {a.dtype}, 1 prompt x {a.seq_len} tokens, {os.cpu_count()} CPU cores; "
          f"bare forward (generate, 1 new token) {bare:.3f} s, median of {a.repeats}")
    print(f"{'kind':18s}{'hooks':>6s}{'bytes/token/layer':>19s}{'ms/hook':>10s}{'min..max':>16s}")
    for kind, f in figures.items():
        print(f"{kind:18s}{f['hooks']:6d}{f['bytes_per_token_layer']:19.0f}{f['ms_per_hook']:10.2f}"
              f"{f['ms_per_hook_min']:8.2f}..{f['ms_per_hook_max']:.2f}")
    print(f"\ncompare of a dump of every point ({cmp['points']} rows, {cmp['dump_mib']:.1f} MiB, "
          f"{'PASS' if cmp['passed'] else 'FAIL'}): {cmp['seconds']:.2f} s, {cmp['points_per_s']:.0f} points/s, "
          f"{cmp['mib_per_s']:.1f} MiB/s (end to end: the golden and both references run too)")


if __name__ == "__main__":
    sys.exit(main())
