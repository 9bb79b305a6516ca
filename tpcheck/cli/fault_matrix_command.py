"""``tpcheck faults matrix`` on the command line: the matrix (``tpcheck.cli.fault_matrix``) or, with ``--depth``,
the depth axis (``tpcheck.cli.fault_depth``), printed and judged."""
from __future__ import annotations

import argparse
from pathlib import Path

from tpcheck.cli.exit_codes import verdict
from tpcheck.cli.fault_depth import add_arguments
from tpcheck.cli.paths import check_output_paths
from tpcheck.inputs.arg_types import add_device_argument

# the first line of tpcheck.cli.fault_matrix's docstring: that module (impl, torch, pandas) loads with the run
DESCRIPTION = "The sensitivity table: every fault on the smallest configuration where it shows, plus clean runs."


# ---- command line: tpcheck faults matrix -----------------------------------------------------------------

def register(subparsers) -> argparse.ArgumentParser:
    """Add ``matrix`` to the ``tpcheck faults`` sub-commands."""
    p = subparsers.add_parser("matrix", help="each fault on the smallest configuration where it shows, plus clean runs",
                              description=DESCRIPTION)
    p.add_argument("--faults", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated fault names (default: all; tpcheck faults list)")
    p.add_argument("--no-clean", action="store_true", help="skip the clean runs")
    add_device_argument(p, "the engines, goldens and references")
    add_arguments(p)
    p.add_argument("--json", type=Path, help="write every row as JSON")
    p.set_defaults(handler=lambda a, argv: check_output_paths(a.json) or run(a))
    return p


def run(args, pool=None, ckpt=None) -> int:
    """``tpcheck faults matrix``: print the table; 0 when every fault is detected at its expected origin and
    no clean run alarms, 1 otherwise. (``pool`` / ``ckpt``: engines and checkpoints to reuse, for tests.)"""
    from tpcheck.cli.fault_depth import run_depth
    from tpcheck.cli.fault_matrix import format_table, run_matrix
    from tpcheck.engines.impl.faults import get_fault
    from tpcheck.result.documents import write_json  # strict JSON, schema_version, kind "fault_matrix", run meta
    for n in args.faults or []:
        get_fault(n)  # ValueError (exit 2) before any engine starts
    if (args.preset or args.tp or args.dtype) and not args.depth:
        raise ValueError("--preset, --tp and --dtype apply to --depth only")
    from impl import CacheConfig
    from tpcheck.engines.pool import EnginePool
    own = pool is None
    if own:  # the engines' device (a GPU asked for and absent: exit 2 before any run)
        pool = EnginePool(device=getattr(args, "device", "auto"), cache=CacheConfig(max_num_seqs=16))
    try:
        if args.depth:
            df = run_depth(args.faults, pool=pool, ckpt=ckpt, presets=args.preset, tps=args.tp, dtypes=args.dtype)
        else:
            df = run_matrix(args.faults, pool=pool, ckpt=ckpt, clean=not args.no_clean)
    finally:
        if own:
            pool.close()
    print(format_table(df))
    print("config: preset, TP size, dtype, prefill only or decode steps and KV block size, prompt lengths; "
          "by: the check that flagged the origin; excess: the origin's error over its threshold (invariance faults: "
          "its ulps; clean runs: the closest any point came; memory: the "
          "largest rank's tensor bytes over 1.15 x its share + 64 KiB)")
    ok = bool(df["ok"].all())
    faults_df, clean_df = df[df["fault"] != "(clean)"], df[df["fault"] == "(clean)"]
    print(f"\n{'PASS' if ok else 'FAIL'}: {int(faults_df['ok'].sum())}/{len(faults_df)} faults found at their "
          f"expected origin; {int((~clean_df['ok'].astype(bool)).sum())}/{len(clean_df)} clean runs alarmed")
    for _, r in df[~df["ok"].astype(bool) | (df["check"] == "memory")].iterrows():
        print(f"  {r.fault} ({r.config}): {r.note}")
    if args.json:
        write_json(args.json, "fault_matrix", {"passed": ok, "rows": df.to_dict(orient="records")},
                   meta={"args": {k: v for k, v in vars(args).items()
                                  if k not in ("cmd", "action", "json", "debug")}})
        print(f"wrote {args.json}")
    return verdict(ok)
