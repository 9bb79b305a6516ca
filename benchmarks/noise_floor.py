"""The TP-aware noise floor, measured: false alarms on clean runs and the fault catalog's sensitivity, each
judged two ways from the same run's table.

* one-device floor (the rule before the TP reference): ``rel_err <= k * ref_rel_err_hf + floor``, with
  ``ref_rel_err_hf`` HF at the dtype on one device, at the same step;
* TP-aware floor (the propagated pass): ``k * ref_rel_err + floor``, with ``ref_rel_err`` the larger of that,
  HF at the dtype with the row-parallel reductions emulated, and the references' worst row at earlier steps;
* now (``tpcheck diff``'s verdict): the TP-aware floor on both passes, the propagated one and the local one
  (each layer fed the golden input), the origin the first failing point over both.

Rows a structural check failed (shape, exact ops) fail under both rules, and so do rows whose replicas differ by more
than the rule's threshold (``rank_spread``: a rank holding other data).

    python benchmarks/noise_floor.py [--presets tiny,small-outliers] [--seeds 3] [--decode 0,4] [--no-faults]
        [--json reports/noise_floor.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import pandas as pd

from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run
from impl.config import load_config
from tpcheck.engines.impl.faults import FAULTS, get_fault
from tpcheck.pipeline.check import random_prompts
from tpcheck.inputs.models.checkpoints import PRESETS, cached_checkpoint
from tpcheck.cli.fault_matrix import expected_step, prompts_for, smallest_config
from tpcheck.measure.metrics import FLOOR, K_FACTOR
from tpcheck.engines.pool import EnginePool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run

OUTLIER_CASE = dict(preset="small-outliers", tp=2, dtype="bfloat16", decode_steps=4, prompt_lens=(24, 29),
                    block_size=8)


def verdicts(r) -> dict:
    """Origin and excess of a result under the one-device rule and the TP-aware rule (``r.table``)."""
    t = r.table[r.table["mode"] == "propagated"]
    dtype = r.meta["dtype"]
    ref = t["ref_rel_err_hf"].where(t["ref_rel_err_hf"].notna(), 0.0)
    thr = K_FACTOR[dtype] * ref + FLOOR[dtype]
    structural = t["note"].astype(str) != ""
    spread = t["rank_spread"].fillna(0.0)  # replicas judged against the same threshold (tpcheck.judge)
    old_fail = ~(t["rel_err"] <= thr) | (spread > thr) | structural
    old_excess = pd.concat([t["rel_err"] / thr, spread / thr], axis=1).max(axis=1, skipna=False)
    out = {}
    for rule, failing, excess in (("one_device", old_fail, old_excess), ("tp_aware", ~t["passed"], t["excess"])):
        if failing.any():
            i = failing.idxmax()  # the first failing row in execution order (the table is sorted)
            out[rule] = dict(origin=f"{t.loc[i, 'point']} @ step {t.loc[i, 'step']}", excess=float(excess[i]),
                             point=t.loc[i, "point"], step=int(t.loc[i, "step"]))
        else:
            out[rule] = dict(origin="-", excess=float(excess.max()), point=None, step=None)
    # the verdict tpcheck diff gives now: both passes (the local pass on by default), its origin and worst point
    fd = r.first_divergence
    out["now"] = dict(origin="-", excess=float(r.worst().excess), point=None, step=None) if fd is None else \
        dict(origin=f"{fd['point']} @ step {fd['step']} ({fd['mode']})", excess=fd["excess"], point=fd["point"],
             step=fd["step"])
    return out


def _tps(model_dir) -> list[int]:
    cfg, ok = load_config(model_dir), []
    for tp in (1, 2, 4):
        try:
            cfg.check_tp(tp)
            ok.append(tp)
        except Exception:
            pass
    return ok


def clean_runs(presets, seeds, decodes, pool) -> pd.DataFrame:
    rows = []
    for preset in presets:
        d = cached_checkpoint(preset)
        vocab = load_config(d).vocab_size
        for tp in _tps(d):
            for dtype in ("bfloat16", "float16"):
                for seed in range(seeds):
                    for steps in decodes:
                        r = run(DiffOptions(model=str(d), tp=tp, dtype=dtype, decode_steps=steps,
                                            prompts=random_prompts(vocab, 2, 24 + 5 * seed, seed)), pool=pool)
                        v = verdicts(r)
                        rows.append(dict(preset=preset, tp=tp, dtype=dtype, seed=seed, decode=steps,
                                         one_device=v["one_device"]["origin"],
                                         one_device_excess=v["one_device"]["excess"],
                                         tp_aware=v["tp_aware"]["origin"], tp_aware_excess=v["tp_aware"]["excess"],
                                         now=v["now"]["origin"], now_excess=v["now"]["excess"]))
                        print(f"clean {preset} tp={tp} {dtype} seed {seed} decode {steps}: one-device "
                              f"{v['one_device']['excess']:.2f}x, tp-aware {v['tp_aware']['excess']:.2f}x, "
                              f"both passes {v['now']['excess']:.2f}x", file=sys.stderr, flush=True)
    return pd.DataFrame(rows)


def _fault_run(name: str, config: dict, pool) -> dict:
    fault = get_fault(name)
    d = cached_checkpoint(config["preset"])
    r = run(DiffOptions(model=str(d), tp=config["tp"], dtype=config["dtype"], decode_steps=config["decode_steps"],
                        prompts=prompts_for(config, load_config(d).vocab_size), inject=(name,),
                        block_size=config["block_size"], exact_ops=True), pool=pool)
    v = verdicts(r)
    want = (fault.origin(None), expected_step(fault, config))
    at = lambda rule: (v[rule]["point"], v[rule]["step"]) == want  # noqa: E731
    return dict(fault=name, config=f"{config['preset']} tp={config['tp']} {config['dtype']}"
                + (f" decode {config['decode_steps']}" if config["decode_steps"] else ""),
                expected=f"{want[0]} @ step {want[1]}", one_device_excess=v["one_device"]["excess"],
                one_device_at_origin=at("one_device"), tp_aware_excess=v["tp_aware"]["excess"],
                tp_aware_at_origin=at("tp_aware"), tp_aware_origin=v["tp_aware"]["origin"])


def fault_runs(pool) -> pd.DataFrame:
    rows = []
    outlier_cfg = load_config(cached_checkpoint("small-outliers"))
    for name, fault in FAULTS.items():
        if fault.check == "memory":
            continue
        configs = [smallest_config(fault)]
        dt = "float32" if name == "allreduce_low_precision" else "bfloat16"  # its fault is bf16 under float32
        outlier = dict(OUTLIER_CASE, dtype=dt, decode_steps=OUTLIER_CASE["decode_steps"] if fault.decode_only
                       or fault.origin_step != "prefill" else 0)
        if fault.applies(outlier_cfg, 2, dt):
            configs.append(outlier)
        for c in configs:
            t0 = time.monotonic()
            row = _fault_run(name, c, pool)
            print(f"fault {name} on {row['config']}: one-device {row['one_device_excess']:.3g}x, tp-aware "
                  f"{row['tp_aware_excess']:.3g}x at {row['tp_aware_origin']} ({time.monotonic() - t0:.1f}s)",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(p for p in PRESETS if p != "qwen2.5-0.5b"))
    ap.add_argument("--seeds", type=int, default=3, help="prompt seeds per configuration (default 3)")
    ap.add_argument("--decode", default="0,4", help="decode lengths (default 0,4)")
    ap.add_argument("--no-clean", action="store_true")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--json", help="write both tables as JSON")
    a = ap.parse_args(argv)
    out: dict = {}
    t0 = time.monotonic()
    pool = EnginePool()
    try:
        if not a.no_clean:
            c = clean_runs([p for p in a.presets.split(",") if p], a.seeds, [int(x) for x in a.decode.split(",")], pool)
            out["clean"] = c.to_dict(orient="records")
            print(f"\nclean runs: {len(c)} (bfloat16/float16 x tp 1/2/4 where the layout allows x {a.seeds} seeds x "
                  f"decode {a.decode})")
            for rule in ("one_device", "tp_aware", "now"):
                bad = c[c[rule] != "-"]
                print(f"  {rule.replace('_', '-')} floor: {len(bad)} false alarm(s); worst excess "
                      f"{c[rule + '_excess'].max():.2f}x")
            print(c.groupby(["preset", "tp"]).agg(runs=("seed", "size"),
                                                  one_device_alarms=("one_device", lambda s: int((s != "-").sum())),
                                                  one_device_worst=("one_device_excess", "max"),
                                                  tp_aware_alarms=("tp_aware", lambda s: int((s != "-").sum())),
                                                  tp_aware_worst=("tp_aware_excess", "max"),
                                                  now_alarms=("now", lambda s: int((s != "-").sum())),
                                                  now_worst=("now_excess", "max")).to_string())
        if not a.no_faults:
            f = fault_runs(pool)
            out["faults"] = f.to_dict(orient="records")
            print("\nfault catalog: excess at the origin, one-device floor vs TP-aware floor")
            print(f.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
            print(f"  at the expected origin: one-device {int(f['one_device_at_origin'].sum())}/{len(f)}, "
                  f"tp-aware {int(f['tp_aware_at_origin'].sum())}/{len(f)}")
    finally:
        pool.close()
    print(f"({time.monotonic() - t0:.0f}s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
