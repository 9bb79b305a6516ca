"""A dump's local pass against a live engine's: each fault injected into impl at one decoder layer (the first, the
middle, the last), run live (``tpcheck.diff``: both passes, the run dumped) and its dump compared
(``compare_engine`` on a ``DumpAdapter``: the golden and the references forced onto the recorded inputs). Per
run: the origin each found, and the excess at the fault's expected origin in each local pass and in the
propagated pass. Then the cost: the clean run's dump compared with and without the local pass.

    python benchmarks/dump_local_pass.py [--preset deep-sink] [--tp 2] [--dtype bfloat16]
        [--faults qkv_bias_missing,rope_skipped,skip_o_proj_allreduce] [--prompts 1|2] [--no-cost] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import make_log, print_table  # noqa: E402

import tpcheck  # noqa: E402
from impl.config import load_config  # noqa: E402
from tpcheck.engines.dump.replay import DumpAdapter, read_dump  # noqa: E402
from tpcheck.cli.fault_depth import depth_layers  # noqa: E402
from tpcheck.engines.pool import EnginePool  # noqa: E402
from tpcheck.inputs.models.checkpoints import cached_checkpoint  # noqa: E402
from tpcheck.engines.impl.faults import get_fault  # noqa: E402
from tpcheck.pipeline.diff import compare_engine  # noqa: E402
from tpcheck.reference.reductions import Reductions  # noqa: E402

log = make_log("dump_local_pass")
PROMPTS = [[3, 9, 27, 81, 5, 15, 45, 11, 33, 99, 7, 21], [2, 4, 8, 16, 32, 64, 128, 6, 12, 24, 48, 96, 19, 38, 76,
                                                          52, 104]]  # 12 and 17 tokens, as the depth matrix's


def excess_at(r, point: str, mode: str) -> float:
    """The largest excess of ``point`` in pass ``mode`` of result ``r`` (NaN where it has no such row)."""
    t = r.table[(r.table["point"] == point) & (r.table["mode"] == mode)]["excess"]
    return float(t.max()) if len(t) else float("nan")


def origin(r) -> str:
    fd = r.first_divergence
    return "-" if fd is None else f"{fd['point']} ({fd.get('mode')})"


def compare_dump(d: Path, model: str, dtype: str, tp: int, isolate: bool | None):
    """The dump at ``d`` judged (``isolate``: as ``tpcheck compare``'s), and the seconds and CPU seconds it took."""
    engine = DumpAdapter(read_dump(d), Reductions(tp))
    t0, c0 = time.monotonic(), time.process_time()
    r = compare_engine(engine, model, engine.prompts, dtype, engine.decode_steps, isolate)
    return r, time.monotonic() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deep-sink")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--faults", default="qkv_bias_missing,rope_skipped,skip_o_proj_allreduce")
    ap.add_argument("--prompts", type=int, default=2, choices=(1, 2), help="the first N of the two prompts")
    ap.add_argument("--no-cost", action="store_true", help="skip the clean run and its cost")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    model = str(cached_checkpoint(a.preset))
    layers = depth_layers(load_config(model).num_layers)
    rows, out = [], {"runs": []}
    pool = EnginePool()
    with tempfile.TemporaryDirectory() as tmp:
        run = lambda d, **kw: tpcheck.diff(model=model, tp=a.tp, dtype=a.dtype, prompts=PROMPTS[:a.prompts],  # noqa: E731
                                           pool=pool, dump=str(d), **kw)
        if not a.no_cost:
            log("clean run")
            run(Path(tmp) / "clean")
        for isolate in () if a.no_cost else (False, True):
            r, secs, cpu = compare_dump(Path(tmp) / "clean", model, a.dtype, a.tp, isolate)
            out[f"clean_isolate_{isolate}"] = {"passed": r.passed, "seconds": secs, "cpu_seconds": cpu}
            log(f"clean dump, local pass {isolate}: {'PASS' if r.passed else 'FAIL'}, {secs:.1f} s, {cpu:.1f} s CPU")
        for name in a.faults.split(","):
            for layer in layers:
                log(f"{name} at layer {layer}")
                d = Path(tmp) / f"{name}-{layer}"
                live = run(d, inject=[name], inject_layer=layer)
                dump, _, _ = compare_dump(d, model, a.dtype, a.tp, None)
                point = get_fault(name).origin(layer)
                fig = {"fault": name, "layer": layer, "expected": point,
                       "live_origin": origin(live), "dump_origin": origin(dump),
                       "live_local": excess_at(live, point, "isolated"), "dump_local": excess_at(dump, point, "isolated"),
                       "propagated": excess_at(dump, point, "propagated")}
                out["runs"].append(fig)
                log(json.dumps(fig))
                rows.append([name, str(layer), fig["live_origin"], fig["dump_origin"], f"{fig['live_local']:.3g}",
                             f"{fig['dump_local']:.3g}", f"{fig['propagated']:.3g}"])
    pool.close()
    print_table(["fault", "layer", "live origin", "dump origin", "live local", "dump local", "propagated"], rows)
    for isolate in () if a.no_cost else (False, True):
        c = out[f"clean_isolate_{isolate}"]
        print(f"clean dump, local pass {'on' if isolate else 'off'}: {'PASS' if c['passed'] else 'FAIL'}, "
              f"{c['seconds']:.1f} s, {c['cpu_seconds']:.1f} s CPU (this process)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
