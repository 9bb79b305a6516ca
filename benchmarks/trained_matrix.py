"""Clean runs and faults on a trained checkpoint (the public Gemma 3 270M, ``python -m tpcheck.inputs.models.public_checkpoint``):
how often a correct engine fails (false alarms), how close its worst point comes to its threshold, and what each
failure names. Real text prompts, tokenized by the checkpoint's own tokenizer (``<bos>`` first).

    python benchmarks/trained_matrix.py --model ~/.cache/tpcheck/gemma-3-270m --engine impl --tp 1,2,4 \\
        --dtype float32,bfloat16,float16 --one-prompt 20 --two-prompt 2 --json reports/trained-impl.json
    .venv-vllm/bin/python benchmarks/trained_matrix.py --model ... --engine vllm --tp 1,2 --dtype float32,bfloat16
    python benchmarks/trained_matrix.py --model ... --inject skip_o_proj_allreduce --inject-layer 9 --one-prompt 2
    python benchmarks/trained_matrix.py --model ... --catalog --inject-layer 9 --tp 2 --dtype bfloat16 [--dump]
    python benchmarks/trained_matrix.py --model ... --variants rank_order_allreduce,sequential_k --tp 4

One-prompt runs take prompts of 1..40 tokens spread over ``--one-prompt`` runs (the same prompts at every tp and
dtype); two-prompt runs pair a long prompt (up to ``--max-len`` tokens) with a short one. Each run: ``tpcheck.diff``
with its defaults (local pass included) and ``--decode-steps`` decode steps. Prints one line a run and a summary per
(tp, dtype): runs, failures, the closest figure (the worst excess over all passing runs) and each failure's origin.
With ``--inject`` every run is expected to fail: the summary gives the origin and its excess instead. ``--catalog``:
every per-layer fault of the catalog that can show in the run (``Fault.silent_because`` is None) injected into
``--inject-layer`` in turn, one line a fault: its expected origin, the origin found and its excess; ``--dump`` judges
each run through its dump instead (``tpcheck diff --dump DIR`` then ``tpcheck compare DIR``). ``--variants``: impl
patched to round otherwise than Hugging Face as real engines do (``tpcheck.engines.impl.variants``), each run a
correct engine that is not HF's twin."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_variants_arg, check_variants_arg, make_log  # noqa: E402

TEXTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Translate to German: The weather is nice today, so we are going for a walk in the park.",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "List three prime numbers greater than one hundred:",
    "<start_of_turn>user\nExplain tensor parallelism in one sentence.<end_of_turn>\n<start_of_turn>model\n",
    "The mitochondria is the powerhouse of the cell. In eukaryotic organisms, it is responsible for",
    "import torch\nx = torch.randn(4, 4)\ny = x @ x.T\nprint(",
    "Dear Sir or Madam, I am writing to inquire about the position advertised on your website last week,",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. The mission was called",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "<start_of_turn>user\nWhat are the main differences between a list and a tuple in Python? Please give "
    "an example of each.<end_of_turn>\n<start_of_turn>model\n",
    "Photosynthesis converts light energy into chemical energy. The overall equation is",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and arrows",
    "Rome was not built in a day, but",
]
LONG_TEXT = " ".join(TEXTS[i % len(TEXTS)] for i in range(60))  # enough tokens for any --max-len here


def one_prompt_lengths(n: int) -> list[int]:
    """``n`` prompt lengths spread over 1..40 (1 and 40 included when n >= 2)."""
    if n == 1:
        return [17]
    return sorted({round(1 + i * 39 / (n - 1)) for i in range(n)})


def prompts_of(tok, bos: int, n_one: int, n_two: int, max_len: int) -> list[list[list[int]]]:
    """The runs' prompts: ``n_one`` single prompts of 1..40 tokens (each a different text, cut or repeated to its
    length), then ``n_two`` pairs (a long prompt of up to ``max_len`` tokens and a short one)."""
    runs = []
    for i, n in enumerate(one_prompt_lengths(n_one)):
        ids = [bos] + tok.encode(TEXTS[i % len(TEXTS)] + " " + LONG_TEXT, add_special_tokens=False)
        runs.append([ids[:n]])
    long_ids = [bos] + tok.encode(LONG_TEXT, add_special_tokens=False)
    for j in range(n_two):
        n_long = max_len - j * max_len // max(2 * n_two, 1)
        short = [bos] + tok.encode(TEXTS[(3 * j + 5) % len(TEXTS)], add_special_tokens=False)
        runs.append([long_ids[:n_long], short])
    return runs


def judged_dump(args, pool, prompts, tp: int, dtype: str, inject: str | None):
    """``tpcheck diff --dump DIR`` of the run, then the dump judged as ``tpcheck compare DIR`` judges it."""
    import tempfile

    import tpcheck
    from tpcheck.engines.dump.stages import open_dump, stage_options
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.reference.reductions import Reductions
    from tpcheck.result.meta import RunOrigin
    with tempfile.TemporaryDirectory(prefix="trained-dump-") as d:
        kw = {} if inject is None else dict(inject=[inject], inject_layer=args.inject_layer)
        tpcheck.diff(model=args.model, tp=tp, dtype=dtype, prompts=prompts, decode_steps=args.decode_steps, pool=pool,
                     engine=args.engine, dump=d, **kw)
        dump, engine, stages = open_dump(Path(d), lambda n: Reductions(n, None))
        opts = DiffOptions(model=args.model, dtype=dump.dtype, prompts=engine.prompts,
                           decode_steps=engine.decode_steps, **stage_options(engine, stages, args.model))
        return compare(engine, opts, None, RunOrigin(tp=dump.tp, stages=stages, engine=dump.engine, dump=d,
                                                     command=f"tpcheck compare {d} --model {args.model}"))


def run_one(args, pool, prompts, tp: int, dtype: str, inject: str | None = None) -> dict:
    import tpcheck
    t0 = time.perf_counter()
    kw = dict(engine=args.engine)
    if inject:
        kw.update(inject=[inject], inject_layer=args.inject_layer)
    if args.variants:  # patched into the pooled engine before each run (patching twice is patching once); not
        from tpcheck.engines.impl import variants  # reloaded after: a reload of a 262k-vocabulary model's ranks
        pool.get(args.model, tp, dtype).call(variants.apply, args.variants)  # beside the old ones ran out of memory
    if args.dump:
        r = judged_dump(args, pool, prompts, tp, dtype, inject)
    else:
        r = tpcheck.diff(model=args.model, tp=tp, dtype=dtype, prompts=prompts, decode_steps=args.decode_steps,
                         pool=pool, **kw)
    w, fd = r.worst(), r.first_divergence
    over = r.meta.get("overflow")
    return {"tp": tp, "dtype": dtype, "lens": [len(p) for p in prompts], "passed": r.passed,
            "overflow": None if over is None else over["point"],
            "worst_point": None if w is None else w.point, "worst_excess": None if w is None else float(w.excess),
            "origin": None if fd is None else fd["point"], "origin_excess": None if fd is None else fd["excess"],
            "origin_step": None if fd is None else fd["step"], "gain": None if fd is None else fd["gain"],
            "gain_threshold": None if fd is None else fd["gain_threshold"],
            "allowances": r.meta.get("allowances"), "carried": carried(r),
            "seconds": round(time.perf_counter() - t0, 1), "summary": "" if r.passed else r.summary()}


def carried(r) -> dict:
    """The passing rows over their threshold (``rel_err`` or the gain) that passed all the same, as inherited (their
    op's own error within it) or by their op's own gain: how many, and the largest raw excess among them (what the
    row would have been judged by without that allowance)."""
    import numpy as np
    t = r.table
    raw = np.fmax(t["rel_err"] / t["threshold"], t["gain"].abs() / t["gain_threshold"])
    # a row the dtype could not hold (not finite in HF at the same dtype too: the verdict's overflow) is unjudged,
    # its excess NaN: not carried by any allowance
    over = t["passed"] & (raw > 1) & t["excess"].notna()
    # the passing rows closest to their threshold, each with its op's own error against the same threshold (NaN
    # where it was not computed: under half the threshold): how far that row was from failing
    near = t[t["passed"] & ~over].assign(raw=raw).nlargest(3, "raw")
    own = near["own_err"] / near["threshold"] if "own_err" in near else near["raw"] * float("nan")
    return {"rows": int(over.sum()), "raw_max": float(raw[over].max()) if over.any() else None,
            "closest": [{"point": p, "step": int(s), "mode": m, "excess": round(float(x), 4), "own": round(float(o), 4)}
                        for p, s, m, x, o in zip(near["point"], near["step"], near["mode"], near["raw"], own)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the converted checkpoint directory")
    ap.add_argument("--engine", default="impl", choices=["impl", "hf-tp", "vllm"])
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--dtype", default="float32,bfloat16,float16")
    ap.add_argument("--one-prompt", type=int, default=20, help="one-prompt runs (lengths 1..40)")
    ap.add_argument("--two-prompt", type=int, default=2, help="two-prompt runs (a long prompt and a short one)")
    ap.add_argument("--max-len", type=int, default=400, help="the longest prompt of the two-prompt runs")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--inject", help="a fault of the catalog (every run then expected to fail at its origin)")
    ap.add_argument("--inject-layer", type=int, default=None)
    ap.add_argument("--catalog", action="store_true", help="every per-layer fault that can show, at --inject-layer")
    ap.add_argument("--dump", action="store_true", help="judge each run through its dump (tpcheck compare)")
    ap.add_argument("--faults", help="with --catalog: only these faults (comma-separated)")
    ap.add_argument("--pick", help="only these runs, by index into the runs' list (e.g. 0,1,2: the shortest three "
                    "one-prompt runs), so that a long matrix can be made in parts")
    add_variants_arg(ap)
    ap.add_argument("--json", help="write every run as JSON")
    args = ap.parse_args(argv)
    args.variants = check_variants_arg(ap, args)
    log = make_log("trained_matrix")
    from transformers import AutoTokenizer  # submodule: loaded once arguments are checked

    from impl.config import load_config
    from tpcheck.engines.pool import EnginePool
    cfg = load_config(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    bos = cfg.hf.bos_token_id
    runs = prompts_of(tok, bos, args.one_prompt, args.two_prompt, args.max_len)
    if args.pick:
        picked = [int(i) for i in args.pick.split(",")]
        if bad := [i for i in picked if not 0 <= i < len(runs)]:
            ap.error(f"--pick {bad}: there are {len(runs)} runs (0..{len(runs) - 1})")
        runs = [runs[i] for i in picked]
    out: list[dict] = []
    pool = EnginePool()
    if args.catalog:
        try:
            return catalog(args, pool, cfg, runs, log)
        finally:
            pool.close()
    try:
        for tp in [int(x) for x in args.tp.split(",")]:
            pool.close()  # one TP size's ranks at a time: a 262k-vocab model's ranks hold ~3 GB each
            pool = EnginePool()
            for dtype in args.dtype.split(","):
                for prompts in runs:
                    row = run_one(args, pool, prompts, tp, dtype, args.inject)
                    out.append(row)
                    verdict = "pass" if row["passed"] else f"OVERFLOW from {row['overflow']} (HF too)" \
                        if row["overflow"] and row["origin"] is None else \
                        f"FAIL at {row['origin']} ({row['origin_excess']:.3g}x)"
                    log(f"{args.engine} tp {tp} {dtype} lens {row['lens']}: {verdict}; worst {row['worst_point']} "
                        f"{row['worst_excess'] or float('nan'):.3g}x; over their threshold, carried: {row['carried']['rows']} "
                        f"rows (raw {row['carried']['raw_max'] or 0:.3g}x) ({row['seconds']} s)")
                    if args.json:
                        Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        pool.close()
    print(f"\n{args.engine} on {args.model}" + (f", {args.inject} at layer {args.inject_layer}" if args.inject else ""))
    print(f"{'tp':>3} {'dtype':>9} {'runs':>5} {'fail':>5} {'overflow':>8} {'closest (pass)':>15}  "
          "failures (origin, excess)")
    for tp in sorted({r["tp"] for r in out}):
        for dtype in dict.fromkeys(r["dtype"] for r in out):
            rs = [r for r in out if r["tp"] == tp and r["dtype"] == dtype]
            if not rs:
                continue
            fails = [r for r in rs if not r["passed"] and r["origin"] is not None]
            over = [r for r in rs if r["origin"] is None and r.get("overflow")]
            closest = max((r["worst_excess"] for r in rs if r["origin"] is None and r["worst_excess"] is not None
                           and r["worst_excess"] == r["worst_excess"]), default=float("nan"))
            what = "; ".join(f"{r['origin']} {r['origin_excess']:.3g}x (lens {r['lens']})" for r in fails[:6])
            print(f"{tp:>3} {dtype:>9} {len(rs):>5} {len(fails):>5} {len(over):>8} {closest:>14.3g}x  {what}")
    return 0


def catalog(args, pool, cfg, runs, log) -> int:
    """Every per-layer fault that can show in each (tp, dtype) of the run, injected at ``--inject-layer``, on each of
    the runs' prompts: the expected origin, the one found and its excess."""
    from tpcheck.engines.impl.faults import FAULTS
    print(f"\n{'fault':<34} {'tp':>3} {'dtype':>9} {'lens':>10} {'expected':<26} {'found':<26} {'excess':>9}")
    for tp in [int(x) for x in args.tp.split(",")]:
        for dtype in args.dtype.split(","):
            for f in FAULTS.values():
                if args.faults and f.name not in args.faults.split(","):
                    continue
                for prompts in runs:
                    lens = [len(p) for p in prompts]
                    if not f.per_layer or f.check != "diff" or f.silent_because(
                            cfg, tp, dtype, args.decode_steps, False, prompt_lens=lens, layer=args.inject_layer):
                        continue
                    row = run_one(args, pool, prompts, tp, dtype, f.name)
                    want = f.origin(args.inject_layer)
                    ok = "" if row["origin"] == want else "  <- elsewhere"
                    exc = row["origin_excess"] if row["origin_excess"] is not None else float("nan")
                    print(f"{f.name:<34} {tp:>3} {dtype:>9} {str(lens):>10} {want:<26} {str(row['origin']):<26} "
                          f"{exc:>8.3g}x{ok}", flush=True)
                    log(f"{f.name}: {row['origin']} {exc:.3g}x ({row['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
