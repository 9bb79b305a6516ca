"""False alarms of a clean engine, one prompt per run: what a user of a real engine sees when they run tpcheck on
the prompts they care about (short ones included). Each run is judged twice from its own table: by the noise
floor alone (``rel_err <= threshold``) and by the verdict (the inherited rule of ``tpcheck.measure.own_input``
included).

    python benchmarks/engine_floor.py [--engine vllm] [--variants rank_order_allreduce,sequential_k] [--preset deep-sink] [--tp 1,2] [--dtype float32,bfloat16]
        [--prompts 20] [--max-len 40] [--pairs 2] [--pair-len 400] [--decode 2] [--seed 0] [--json reports/engine_floor.json]

Prompts: ``--prompts`` random token-id prompts (seeded), of lengths 1, 2, 3 and then spread up to ``--max-len``,
one per run; then ``--pairs`` runs of two prompts each (one batch, different lengths), the longer of the last
pair ``--pair-len`` tokens.
One engine per (tp, dtype), reused for every prompt (``tpcheck.engines.pool.EnginePool``). Per configuration it
prints the runs, the false alarms under each rule, the closest point (its excess), how many points passed as
inherited (and their largest raw excess), and the runs whose replicas somewhere differ by more than the threshold
(each replica is judged against the golden; where the spread itself was judged, these runs failed)."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run
from tpcheck.engines.pool import EnginePool
from tpcheck.inputs.arg_types import add_device_argument, device_name
from tpcheck.engines.impl import variants
from tpcheck.inputs.models.checkpoints import cached_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_variants_arg, check_json_arg, check_variants_arg, make_log, print_table  # noqa: E402


def prompts(n: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts: lengths 1, 2, 3, then evenly spread up to ``max_len``."""
    rng = random.Random(f"engine-floor-{seed}")
    lens = [1, 2, 3][:n] + [round(3 + (max_len - 3) * (i + 1) / max(1, n - 3)) for i in range(max(0, n - 3))]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lens]


def pairs(n: int, max_len: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """``n`` two-prompt batches: the longer prompt spread up to ``max_len``, the shorter a third of it."""
    rng = random.Random(f"engine-floor-pairs-{seed}")
    lens = [(round(max_len * (i + 1) / n), max(1, round(max_len * (i + 1) / n / 3))) for i in range(n)]
    return [[[rng.randrange(vocab) for _ in range(k)] for k in pair] for pair in lens]


def add_prompt_args(ap: argparse.ArgumentParser, dtype: str, pairs_default: int) -> None:
    """The preset, tp, dtype and prompt options this script and ``vllm_floor_dump.py`` share."""
    ap.add_argument("--preset", default="deep-sink")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--dtype", default=dtype)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=pairs_default)
    ap.add_argument("--pair-len", type=int, default=400)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="prompt seed: another seed draws other tokens at the same lengths")
    ap.add_argument("--json")


def batches_of(a) -> tuple[str, list[list[list[int]]]]:
    """The preset's checkpoint and the runs' batches: one prompt each, then the pairs."""
    ckpt = cached_checkpoint(a.preset)
    vocab = json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"]
    return ckpt, [[p] for p in prompts(a.prompts, a.max_len, vocab, a.seed)] + pairs(a.pairs, a.pair_len, vocab, a.seed)


def judge_run(r) -> dict:
    """One run's figures: the floor alone and the verdict; the closest point; the inherited points."""
    t = r.table
    worst = t[["rel_err", "replica_rel_err"]].max(axis=1)  # every replica's error (tpcheck.judge.verdict)
    raw = worst / t["threshold"]
    inh = t[t["inherited"]]
    return {"floor_alone_fails": bool((raw > 1).any() | (t["note"] != "").any()), "passed": bool(r.passed),
            "closest": float(t["excess"].max()), "closest_at": str(t.loc[t["excess"].idxmax(), "point"]),
            "inherited": int(len(inh)),
            "inherited_raw": float(raw[t["inherited"]].max()) if len(inh) else 0.0,
            # replicas further apart than the threshold: a failure while the spread itself was judged
            "spread_beyond": int((t["rank_spread"] > t["threshold"]).sum()),
            "origin": (r.first_divergence or {}).get("point", "-")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="impl")
    add_variants_arg(ap)
    add_device_argument(ap, "the engines (and the golden and references, unless --golden-device)")
    ap.add_argument("--golden-device", type=device_name, default=None, help="the golden's and references' device "
                    "(tpcheck diff --golden-device; cpu: the figures measured before they could run on a GPU)")
    add_prompt_args(ap, "float32,bfloat16", 0)
    a = ap.parse_args(argv)
    check_json_arg(ap, a)
    names = check_variants_arg(ap, a)
    log = make_log("engine_floor")
    ckpt, batches = batches_of(a)
    pool, rows, runs = EnginePool(device=a.device), [], []
    t0 = time.monotonic()
    try:
        for tp in (int(x) for x in a.tp.split(",")):
            for dtype in a.dtype.split(","):
                res = []
                for b in batches:
                    if names:  # patched again for each run: a diff leaves the engine as it found it
                        pool.get(str(ckpt), tp, dtype).call(variants.apply, names)
                    r = run(DiffOptions(model=str(ckpt), tp=tp, dtype=dtype, prompts=b, decode_steps=a.decode,
                                        engine=a.engine, golden_device=a.golden_device), pool=pool)
                    if names:
                        pool.get(str(ckpt), tp, dtype).reload()
                    lens = "+".join(str(len(p)) for p in b)
                    res.append({"tp": tp, "dtype": dtype, "len": lens, **judge_run(r)})
                    log(f"{a.engine} tp={tp} {dtype} {lens} tokens: {'PASS' if r.passed else 'FAIL'} "
                        f"closest {res[-1]['closest']:.3g}x at {res[-1]['closest_at']}, "
                        f"{res[-1]['inherited']} inherited")
                runs += res
                worst = max(res, key=lambda x: x["closest"])
                rows.append([f"{a.engine} {a.preset}" + (f" +{'+'.join(names)}" if names else ""), str(tp), dtype,
                             str(len(res)),
                             str(sum(x["floor_alone_fails"] for x in res)), str(sum(not x["passed"] for x in res)),
                             f"{worst['closest']:.3g}x ({worst['len']} tok)", str(sum(x["inherited"] for x in res)),
                             f"{max(x['inherited_raw'] for x in res):.3g}x",
                             str(sum(x["spread_beyond"] > 0 for x in res))])
    finally:
        pool.close()
    print_table(["engine", "tp", "dtype", "runs", "floor alone: fail", "verdict: fail", "closest",
                 "inherited points", "their worst raw excess", "runs with replicas apart > threshold"], rows)
    print(f"total {time.monotonic() - t0:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
