"""What a quantized checkpoint costs a diff, against the dense checkpoint of the same shape.

The float preset (``--base``, default ``small-hd32``: the shape of every quantized preset) and its quantization by each
``--schemes`` entry (``tpcheck make-checkpoint --quantize``'s schemes, written once into a temporary directory),
each diffed on the same engine pool, tp, dtype and prompts (``tpcheck.diff``: both passes; the golden and the
references are built per diff, the quantized ones read and dequantize the checkpoint). The checkpoints alternate
(dense, scheme 1, ..., dense, ...) so that a slow spell of a shared machine hits all; each row gives the median wall
seconds of ``--repeats`` runs and its ratio to the dense median. ``engine`` is impl's forward alone (``LLM.logits``
of one prompt, median of 5 after a warm-up): what the quantized linears cost the engine.

``--layer K`` times instead the integer GEMM of one INT8 linear (``impl.quant.Int8LinearMethod.apply``), K x K
weights, 32 tokens, one thread: the float64 GEMM on float64 copies it used, against ``impl.quant.exact_int_matmul``
on a float32 copy (the results checked equal), each the median of 10 after a warm-up.

    python benchmarks/quant_cost.py [--base small-hd32] [--schemes w8a8-int8,w8a8-fp8,...] [--tp 2] [--repeats 3]
    python benchmarks/quant_cost.py --layer 2048
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_json_arg, check_json_arg, make_log  # noqa: E402

SCHEMES = "w8a8-int8,w8a8-int8-tensor,w8a8-fp8,w8a8-fp8-tensor,gptq-w4g32,awq-w4g32,fp8-kv"


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def layer_gemm(k: int) -> None:
    """The ``--layer`` figures: one INT8 linear's integer GEMM, before and after."""
    import torch

    from impl.quant import exact_int_matmul
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (k, k), dtype=torch.int8, generator=g)
    qx = torch.randint(-128, 128, (32, k), generator=g).float()
    sides = {"float64 GEMM on float64 copies": lambda: qx.double() @ w.double().t(),
             "exact_int_matmul on a float32 copy": lambda: exact_int_matmul(qx, w.float())}
    want = sides["float64 GEMM on float64 copies"]()
    for name, fn in sides.items():
        if not torch.equal(fn(), want):
            raise AssertionError(f"{name}: not the exact integer sums")
        print(f"{name}: {_median_s(fn, 10) * 1e3:.1f} ms ({k} x {k} int8 weight, 32 tokens, 1 thread)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="small-hd32", help="float preset (the dense side and the quantizers' source)")
    ap.add_argument("--schemes", default=SCHEMES, help="comma-separated --quantize schemes")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed diffs of each checkpoint, alternating")
    ap.add_argument("--layer", type=int, metavar="K", help="time one INT8 linear's integer GEMM instead (K x K)")
    add_json_arg(ap)
    a = ap.parse_args()
    check_json_arg(ap, a)
    if a.layer:
        layer_gemm(a.layer)
        return 0
    log = make_log("quant_cost")

    import json
    import random

    import tpcheck
    from tpcheck.engines.pool import EnginePool
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.inputs.models.quantize_awq import quantize_any

    src = cached_checkpoint(a.base)
    tmp = tempfile.TemporaryDirectory(prefix="quant-cost-")
    models = {"dense": str(src)}
    for scheme in a.schemes.split(","):
        log(f"quantizing {a.base} with {scheme} ...")
        models[scheme] = str(quantize_any(src, os.path.join(tmp.name, scheme), scheme))
    pool = EnginePool()
    times: dict[str, list[float]] = {k: [] for k in models}
    engine: dict[str, float] = {}
    try:
        for name, d in models.items():  # warm: the workers, the engine's forward, one diff
            llm = pool.get(d, a.tp, a.dtype)
            ids = [random.Random(0).randrange(llm.cfg.vocab_size) for _ in range(32)]
            llm.logits(ids)
            engine[name] = _median_s(lambda llm=llm, ids=ids: llm.logits(ids), 5)
            tpcheck.diff(model=d, tp=a.tp, dtype=a.dtype, decode_steps=a.decode_steps, pool=pool)
        for r in range(a.repeats):
            for name, d in models.items():
                t = time.perf_counter()
                res = tpcheck.diff(model=d, tp=a.tp, dtype=a.dtype, decode_steps=a.decode_steps, pool=pool)
                times[name].append(time.perf_counter() - t)
                log(f"run {r + 1}/{a.repeats} {name}: {times[name][-1]:.2f}s, {'PASS' if res.passed else 'FAIL'}")
    finally:
        pool.close()
        tmp.cleanup()
    dense = statistics.median(times["dense"])
    rows = [{"checkpoint": n, "diff_s": statistics.median(t), "ratio": statistics.median(t) / dense,
             "engine_ms": engine[n] * 1e3, "engine_ratio": engine[n] / engine["dense"]} for n, t in times.items()]
    print(f"{a.base} tp {a.tp} {a.dtype}, {a.decode_steps} decode steps, median of {a.repeats}")
    print("| checkpoint | diff s (median) | vs dense | engine forward ms | vs dense |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['checkpoint']} | {r['diff_s']:.2f} | {r['ratio']:.2f}x | {r['engine_ms']:.1f} | "
              f"{r['engine_ratio']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
