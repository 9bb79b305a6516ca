"""What a dump costs impl's own ``generate``, on the device it serves on.

impl's serving path (``tpcheck.engines.impl.adapter.generate_dumped``: every rank's hooks capture each scheduler step, a
thread of each rank's writer writes it) against the same ``generate`` with no dump, for a batch of prompts and
``--new-tokens`` greedy tokens each: the dump of every point and of a selection (``--points``, default the logits
and each layer's ``out``: what a dump's local pass needs; the selection of ``vllm_overhead.py``), each written by the
ranks' writer threads (the default) and inside the step (``queue_mb=0``). Each side's time runs until
``generate_dumped`` returns, every file written. On a CUDA device a hook's copy is queued
(``tpcheck.capture.copies.queued_host_copy``), so the forward does not wait for it. The sides alternate (off, every
point, selection, off, ...); tokens/s of the medians, the time ratio against the dump off with its spread (each
repeat's dumped time over that repeat's time with the dump off). The dump goes to a temporary directory (``--dir``
to choose its disk), removed after each run.

    python benchmarks/dump_generate.py [--preset qwen2.5-0.5b] [--tp 1] [--device cuda] [--batch 8] [--prompt-len 64]
                                       [--new-tokens 32] [--repeats 3] [--points REGEX] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_json_arg, check_json_arg, dir_bytes, make_log  # noqa: E402

SELECTION = r"logits|layers\.\d+\.out"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (NCCL: one GPU per rank)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=8, help="prompts, all admitted at once")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating")
    ap.add_argument("--points", default=SELECTION, help="the selection's regex (TPCHECK_DUMP_POINTS)")
    ap.add_argument("--dir", help="where the dumps are written (default: the system's temporary directory)")
    add_json_arg(ap)
    a = ap.parse_args()
    check_json_arg(ap, a)
    log = make_log("dump_generate")

    from impl import SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped, get_llm
    from tpcheck.capture.core import QUEUE_MB
    import inspect
    queued = "queue_mb" in inspect.signature(generate_dumped).parameters
    from tpcheck.engines.pool import EnginePool
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.pipeline.check import random_prompts
    log(f"checkpoint {a.preset} (written once, cached) ...")
    model_dir = str(cached_checkpoint(a.preset))
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="dump_generate-", dir=a.dir))
    pool = EnginePool(device=a.device)
    try:
        llm = get_llm(pool, model_dir, a.tp, a.dtype, num_kv_blocks=None)
        prompts = random_prompts(llm.cfg.vocab_size, a.batch, a.prompt_len, 0)
        # (points: None = no dump, "" = every point; queue MiB: 0 = written inside the step)
        runs = {"off": (None, 0), "every point": ("", QUEUE_MB), "every, in step": ("", 0),
                "selection": (a.points, QUEUE_MB), "sel., in step": (a.points, 0)}
        if not queued:  # an older tree (PYTHONPATH=OLD, side by side): its one way, inside the step
            runs = {k: v for k, v in runs.items() if "in step" not in k}
        n = 0

        def timed(run: tuple[str | None, int]) -> tuple[float, int, list]:
            nonlocal n
            points, queue = run
            t = time.perf_counter()
            if points is None:
                out = llm.generate(prompts, params)
                return time.perf_counter() - t, 0, out
            root = tmp / f"d{n}"
            n += 1
            kw = {"queue_mb": queue} if queued else {}
            out = generate_dumped(llm, prompts, params, root, points=points or None, **kw)
            secs = time.perf_counter() - t
            size = dir_bytes(root)
            shutil.rmtree(root)
            return secs, size, out

        log(f"warm-up on {a.device}, tp {a.tp} ...")
        ref = timed(runs["off"])[2]
        for run in runs.values():
            assert timed(run)[2] == ref, "a dump changed the tokens"  # greedy: the same tokens, dump on or off
        secs: dict[str, list[float]] = {name: [] for name in runs}
        size: dict[str, int] = {}
        for i in range(a.repeats):
            for name, run in runs.items():
                s, size[name], _ = timed(run)
                secs[name].append(s)
            log(f"run {i + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in secs.items()))
    finally:
        pool.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(a, secs, size)
    return 0


def report(a, secs: dict[str, list[float]], size: dict[str, int]) -> None:
    """Print each side's median seconds, tokens/s, time against the dump off (with the per-repeat spread) and MiB;
    with ``--json``, write them."""
    tokens = a.batch * a.new_tokens
    figures = {}
    for name, v in secs.items():
        ratios = [x / o for x, o in zip(v, secs["off"])]
        figures[name] = {"seconds": statistics.median(v), "all_seconds": v, "tokens_per_s": tokens / statistics.median(v),
                         "time_ratio": statistics.median(v) / statistics.median(secs["off"]),
                         "ratio_min": min(ratios), "ratio_max": max(ratios), "dump_mib": size[name] / 2**20}
    print(f"\nimpl generate, {a.preset}, tp {a.tp}, {a.device}, {a.dtype}, {a.batch} prompts x {a.prompt_len} tokens, "
          f"{a.new_tokens} new tokens each, {os.cpu_count()} CPU cores; medians of {a.repeats}, sides alternating")
    print(f"{'dump':14s}{'s':>8s}{'tok/s':>9s}{'time vs off':>13s}{'min..max':>13s}{'MiB':>9s}")
    for name, f in figures.items():
        print(f"{name:14s}{f['seconds']:8.3f}{f['tokens_per_s']:9.1f}{f['time_ratio']:12.2f}x"
              f"{f['ratio_min']:8.2f}..{f['ratio_max']:.2f}{f['dump_mib']:9.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "figures": figures}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
