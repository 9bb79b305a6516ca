"""Real vLLM on the mixture-of-experts presets its CPU attention runs (head_dim 32: tiny-qwen3-moe, tiny-moe-ties):
a clean run per preset x tp x dtype (the verdict's default passes, 2 random prompts of ``--seq-len`` tokens,
``--decode-steps``), its closest point to its threshold and the routing it saw (``route_flips`` against the float64
golden, summed over layers and steps, and how many were near ties); then, on the same engine, rank ``tp - 1``'s
selection seeing expert 0 raised at layer 1 (``VLLM_FAULTS["route-expert-raised"]``): its origin and figure.
``--ep`` also starts vLLM with ``enable_expert_parallel`` at tp > 1 (a refusal or a crash is reported, not hidden).
One vLLM at a time; run it in the vLLM venv:

    .venv-vllm/bin/python benchmarks/vllm_moe.py [--presets tiny-qwen3-moe,tiny-moe-ties] [--tps 1,2]
        [--dtypes bfloat16,float32] [--decode-steps 2] [--seq-len 16] [--ep]
"""
from __future__ import annotations

import argparse
import json
import time

from tpcheck.inputs.models.checkpoints import cached_checkpoint
from tpcheck.inputs.models.presets import PRESETS
from tpcheck.inputs.prompts import random_prompts
from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import compare
from tpcheck.result.meta import RunOrigin


def one(adapter, ckpt: str, dtype: str, prompts: list[list[int]], a, faults=()) -> dict:
    adapter.faults = list(faults)
    try:
        r = compare(adapter, DiffOptions(model=ckpt, dtype=dtype, prompts=prompts, decode_steps=a.decode_steps),
                    origin=RunOrigin(tp=adapter.tp, engine="vllm", command="benchmarks/vllm_moe.py"))
    finally:
        adapter.faults = []
    t = r.table
    ids = t[t["point"].str.endswith("moe.topk_ids")]
    worst = r.worst()
    origin = next((line for line in r.summary().splitlines() if line.startswith("origin:")), "")
    return {"passed": r.passed, "closest": float(worst.excess), "closest_point": worst.point,
            "route_flips": int(ids["route_flips"].sum()), "near_ties": int(ids["near_ties"].sum()),
            "topk_rows": len(ids), "origin": origin}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny-qwen3-moe,tiny-moe-ties")
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--ep", action="store_true", help="vLLM's enable_expert_parallel at tp > 1")
    ap.add_argument("--no-fault", action="store_true", help="the clean runs only")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    from tpcheck.engines.vllm.adapter import VLLMAdapter
    rows = []
    for preset in a.presets.split(","):
        ckpt = str(cached_checkpoint(preset))
        prompts = random_prompts(PRESETS[preset]["vocab_size"], 2, a.seq_len, 0)  # `tpcheck diff --seq-len`'s
        for tp in map(int, a.tps.split(",")):
            for dtype in a.dtypes.split(","):
                kw = {"enable_expert_parallel": True} if a.ep and tp > 1 else {}
                row = {"preset": preset, "tp": tp, "dtype": dtype, "ep": bool(kw)}
                t0 = time.monotonic()
                try:
                    adapter = VLLMAdapter(ckpt, tp, dtype, **kw)
                except Exception as e:  # vLLM refused the layout: said, not hidden
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(row, flush=True)
                    rows.append(row)
                    continue
                try:
                    row["clean"] = one(adapter, ckpt, dtype, prompts, a)
                    if not a.no_fault:
                        row["fault"] = one(adapter, ckpt, dtype, prompts, a, [("route-expert-raised", 1, tp - 1)])
                except Exception as e:  # a worker that died in a step (vLLM's EP on CPU): said, and the next row runs
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                finally:
                    adapter.shutdown()
                row["seconds"] = round(time.monotonic() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    clean = [r["clean"] for r in rows if "clean" in r]
    failed = [r for r in rows if "error" in r]
    print(f"\n{len(clean)} clean runs: {sum(not c['passed'] for c in clean)} false alarm(s), "
          f"{sum(c['route_flips'] for c in clean)} route flips ({sum(c['near_ties'] for c in clean)} near ties); "
          f"{len(failed)} configuration(s) vLLM could not run")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(c["passed"] for c in clean) and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
