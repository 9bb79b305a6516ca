"""The local pass on each prompt's last rows (``--local-rows``, ``tpcheck.pipeline.local_rows``) against the local
pass on every row, on prompts longer than the rows it keeps: every per-layer fault of the depth matrix
(``tpcheck.cli.fault_depth``) injected into the first, the middle and the last layer, each run both ways, the excess
at the fault's origin side by side; and clean runs of both, their closest point to its threshold.

    python benchmarks/local_rows_depth.py [--preset deep-sink] [--tp 2] [--dtype bfloat16] [--prompt-lens 103,60]
                                          [--local-rows 32] [--faults a,b] [--json out.json]

The depth matrix's own prompts (``fault_matrix.PREFILL`` / ``DECODE``: 12 + 17, 6 + 14 tokens) are no longer than
the default 32 rows, so there the local pass runs every row either way. The default lengths put a decode step of
the longer prompt on a block boundary (position 104, blocks of 8), where `slot_mapping_off_by_one_at_block_boundary`
shows."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deep-sink")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-lens", default="103,60")
    ap.add_argument("--local-rows", type=int, default=32)
    ap.add_argument("--faults", default=None, help="comma-separated (default: every per-layer diff fault)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()

    from impl import CacheConfig
    from impl.config import load_config
    from tpcheck.cli import fault_matrix as fm
    from tpcheck.cli.fault_depth import depth_configs, depth_layers, depth_row
    from tpcheck.engines.pool import EnginePool
    from tpcheck.engines.impl.faults import FAULTS, get_fault
    lens = tuple(int(x) for x in a.prompt_lens.split(","))
    names = [n for n in (a.faults.split(",") if a.faults else list(FAULTS))
             if get_fault(n).per_layer and get_fault(n).check == "diff"]
    ckpt = fm._resolver(None)
    cfg = load_config(ckpt(a.preset))
    pool = EnginePool(cache=CacheConfig(max_num_seqs=16))
    out, t0 = [], time.monotonic()
    try:
        for n in (None, *names):
            configs = [dict(preset=a.preset, tp=a.tp, dtype=a.dtype, **fm.PREFILL)] if n is None else \
                depth_configs(n, ckpt, [a.preset], [a.tp], [a.dtype])
            for c in configs:
                c = dict(c, prompt_lens=lens)
                layers = [None] if n is None else \
                    depth_layers(cfg.num_layers, lambda i, f=get_fault(n): f.shows_in_layer(cfg, i))
                for layer in layers:
                    pair = {}
                    for rows in (a.local_rows, 0):
                        cc = dict(c, local_rows=rows)
                        if n is None:
                            r = fm._diff(pool, ckpt, cc, [])
                            t = r.table
                            worst = (t["rel_err"] / t["threshold"]).max()
                            pair[rows] = {"passed": bool(r.passed), "closest": float(worst),
                                          "at": r.summary().splitlines()[0][-80:]}
                        else:
                            d = depth_row(n, cc, layer, pool, ckpt)
                            pair[rows] = {"ok": bool(d["ok"]), "excess": float(d["excess"]), "note": d["note"],
                                          "origin": d["origin"]}
                    row = {"fault": n or "(clean)", "layer": layer, "decode_steps": c["decode_steps"],
                           "sampled": pair[a.local_rows], "every_row": pair[0]}
                    out.append(row)
                    s, e = pair[a.local_rows], pair[0]
                    if n is None:
                        print(f"clean: last {a.local_rows} rows passed={s['passed']} closest {s['closest']:.3g}x; "
                              f"every row passed={e['passed']} closest {e['closest']:.3g}x", flush=True)
                    else:
                        print(f"{n:40s} layer {layer:3d}: last {a.local_rows} rows {s['excess']:9.3g}x ok={s['ok']}"
                              f"   every row {e['excess']:9.3g}x ok={e['ok']}   ({time.monotonic() - t0:.0f}s)",
                              flush=True)
    finally:
        pool.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": out}, f, indent=1)
    bad = [r for r in out if r["fault"] != "(clean)" and not r["sampled"]["ok"]]
    weak = [r for r in out if r["fault"] != "(clean)" and r["sampled"]["excess"] < 10]
    print(f"\n{len(out) - 1} fault runs x 2: not found at the origin with the last {a.local_rows} rows: {len(bad)}; "
          f"under 10x there: {len(weak)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
