"""vLLM's clean matrix on quantized checkpoints: every (preset, tp, dtype, decode steps) of the arguments through
``tpcheck.diff(engine="vllm")`` (what ``tpcheck diff --engine vllm --preset P --tp T --dtype D --decode-steps S
--seq-len N`` runs), the decode lengths of one (preset, tp, dtype) on one vLLM engine (a pool: the same maximum
length, so the same engine). One row per run: the verdict, the point closest to its threshold (or the origin of a
failure) and its excess, and the seconds.

``--faults NAME:LAYER:RANK,...`` (``tpcheck.engines.vllm.worker.VLLM_FAULTS``, the quantization ones of
``tpcheck.engines.vllm.quant_faults``): each configuration's engine runs a clean diff, then one diff per fault
seeded in that rank (``VLLMAdapter.faults``, the Python API's); a fault a layer refuses (a per-tensor scale where
it needs channels) is shown with its error and ends that configuration. Run it in vLLM's virtual environment:

    python benchmarks/vllm_quant_matrix.py [--preset small-fp8,small-w8a8-tensor,small-w8a8] [--tp 1,2]
        [--dtype bfloat16,float16] [--decode-steps 0,2] [--seq-len 16] [--faults NAME:LAYER:RANK,...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _closest(result) -> tuple[str, float]:
    """(point (step) [by what], excess): the origin of a failure, flagged by the noise floor (rel_err over its
    threshold) or by the gain, else the point closest to its threshold."""
    fd = result.first_divergence
    if fd is not None:
        by = "noise floor" if fd["rel_err"] > fd["threshold"] else "gain"
        return f"{fd['point']} (step {fd['step']}) by {by}", fd["excess"]
    w = result.worst()
    return f"{w.point} (step {w.step})", float(w.excess)


def _faults(pool, preset: str, tp: int, dtype: str, steps: int, seq_len: int, faults: list[str]) -> list[str]:
    """A clean diff and one per fault on the configuration's engine: a table row each."""
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.pipeline.plan import RunPlan
    from tpcheck.result.meta import RunOrigin
    plan = RunPlan.resolve(DiffOptions.of(preset=preset, tp=tp, dtype=dtype, decode_steps=steps, seq_len=seq_len,
                                          engine="vllm"))
    adapter = plan.entry.start(pool, plan)
    rows = []
    for f in [None, *faults]:
        name, layer, rank = (None, None, None) if f is None else f.split(":")
        adapter.faults = [] if f is None else [(name, int(layer), int(rank))]
        t0 = time.time()
        try:
            r = compare(adapter, plan.opts, origin=RunOrigin(tp=tp, engine="vllm", command="vllm_quant_matrix"))
        except Exception as e:  # noqa: BLE001 - the layer's refusal, shown in the table
            rows.append(f"| {preset} | {tp} | {dtype} | {steps} | {f} | refused: {str(e).splitlines()[-1][:160]} | | |")
            print(rows[-1], flush=True)
            break
        finally:
            adapter.faults = []
        point, excess = _closest(r)
        rows.append(f"| {preset} | {tp} | {dtype} | {steps} | {f or 'clean'} | {'PASS' if r.passed else 'FAIL'} | "
                    f"{point} | {excess:.2f}x |")
        print(rows[-1], f"{time.time() - t0:.0f} s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-fp8,small-w8a8-tensor,small-w8a8")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--dtype", default="bfloat16,float16")
    ap.add_argument("--decode-steps", default="0,2")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--faults", default="", help="NAME:LAYER:RANK,... seeded one at a time after a clean diff")
    args = ap.parse_args()
    import tpcheck
    from tpcheck.engines.pool import EnginePool
    rows = []
    start = time.time()
    for preset in args.preset.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            # vLLM's CPU thread binding is per tp (the CPUs split into tp ranges): set afresh by --engine vllm
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            pool = EnginePool()
            try:
                for dtype in args.dtype.split(","):
                    for steps in (int(s) for s in args.decode_steps.split(",")):
                        if args.faults:
                            rows += _faults(pool, preset, tp, dtype, steps, args.seq_len, args.faults.split(","))
                            continue
                        t0 = time.time()
                        r = tpcheck.diff(preset=preset, tp=tp, dtype=dtype, decode_steps=steps,
                                         seq_len=args.seq_len, engine="vllm", pool=pool)
                        point, excess = _closest(r)
                        rows.append(f"| {preset} | {tp} | {dtype} | {steps} | {'PASS' if r.passed else 'FAIL'} | "
                                    f"{point} | {excess:.2f}x | {time.time() - t0:.0f} |")
                        print(rows[-1], flush=True)
            finally:
                pool.close()  # stops vLLM's workers
    print(f"\n{len(rows)} runs, {time.time() - start:.0f} s")
    print(f"| preset | tp | dtype | decode |{' fault |' if args.faults else ''} verdict | closest point (origin if failed) | "
          f"excess |{'' if args.faults else ' s |'}")
    print("|---" * 8 + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
