"""Clean runs of every mixture-of-experts preset under tensor and expert parallelism: ``tpcheck diff`` (both passes)
at each (tp, ep) layout x dtype with decode steps, and the routing the verdict saw: how many tokens picked other
experts than the float64 golden (``route_flips``, summed over layers, steps and both passes), how many of those
were near ties (legitimate), and how many rows the local pass left out of routed points for them.

    python benchmarks/moe_matrix.py [--presets tiny-qwen2-moe,...] [--dtypes float32,bfloat16] [--decode-steps 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
PRESETS = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-moe-ties"]


def run_one(pool, preset: str, tp: int, ep: int, dtype: str, steps: int) -> dict:
    t0 = time.monotonic()
    r = run(DiffOptions(preset=preset, tp=tp, ep=ep, dtype=dtype, decode_steps=steps), pool=pool)
    t = r.table
    ids = t[t["kind"] == "moe.topk_ids"]
    worst = r.worst()
    return {"preset": preset, "tp": tp, "ep": ep, "dtype": dtype, "passed": r.passed,
            "worst_excess": float(worst.excess), "worst_point": worst.point,
            "route_flips": int(ids["route_flips"].sum()), "near_ties": int(ids["near_ties"].sum()),
            "rows_excluded": int(t["rows_excluded"].fillna(0).sum()), "comparisons": len(t),
            "seconds": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    from impl import CacheConfig
    from tpcheck.engines.pool import EnginePool
    rows = []
    pool = EnginePool(cache=CacheConfig(max_num_seqs=16))
    try:
        for preset in a.presets.split(","):
            for tp, ep in LAYOUTS:
                for dtype in a.dtypes.split(","):
                    row = run_one(pool, preset, tp, ep, dtype, a.decode_steps)
                    rows.append(row)
                    print(f"{preset:15s} tp{tp} ep{ep} {dtype:9s} {'pass' if row['passed'] else 'FAIL'} "
                          f"worst {row['worst_excess']:.2f}x ({row['worst_point']}), flips {row['route_flips']} "
                          f"(near ties {row['near_ties']}), rows excluded {row['rows_excluded']}, "
                          f"{row['seconds']:.1f}s", flush=True)
    finally:
        pool.close()
    bad = [r for r in rows if not r["passed"]]
    illegit = sum(r["route_flips"] - r["near_ties"] for r in rows)
    print(f"\n{len(rows)} runs: {len(bad)} false alarm(s); worst {max(r['worst_excess'] for r in rows):.2f}x; "
          f"{sum(r['route_flips'] for r in rows)} route flips, {illegit} not a near tie")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
