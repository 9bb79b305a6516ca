"""Residual-stream magnitudes per layer (``layers.N.out``) of a preset, as a trained model's are reported: the
sink channel at token 0, the largest other entry, the sink channel at every other token and the median |x|,
measured from HF float64 on random prompts (one per seed, 3-64 tokens, plus greedy decode steps); then the
same prompts and tokens in float16 and bfloat16: every captured point finite (MLP products included), the sink
at token 0, and the largest |value| of any point against float16's 65504.

    python benchmarks/depth_stats.py [--preset deep-sink] [--seeds 8] [--decode 4] [--json reports/depth.json]

Each cell is ``min..max`` over the seeds. The sink channel is the recipe's (``tpcheck.inputs.models.sink_recipe``) for a
preset drawn with it, else the channel of token 0's largest |x| at the middle layer."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_checkpoint_args, check_json_arg, make_log, print_table, resolve_checkpoint  # noqa: E402

from tpcheck.inputs.models.checkpoints import SINKS, sink_channels  # noqa: E402
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache  # noqa: E402


def prompts(vocab: int, seeds: int, min_len: int = 3, max_len: int = 64) -> list[list[int]]:
    """One random prompt per seed: uniform token ids, of ``min_len`` then ``max_len`` tokens, then a random
    length in between."""
    out = []
    for s in range(seeds):
        rng = random.Random(f"depth-stats-{s}")
        n = (min_len, max_len)[s] if s < 2 else rng.randint(min_len, max_len)
        out.append([rng.randrange(vocab) for _ in range(n)])
    return out


def run(model, prompt: list[int], decode: int, tokens: list[int] | None = None) -> tuple[list[dict], list[int]]:
    """The points of the prefill and ``decode`` one-token steps (greedy on this model's logits, or the given
    ``tokens``) of one prompt: a list of per-step point dicts, and the decoded tokens."""
    cap, cache = HFCapture(model), new_cache(model)
    steps = [cap.step([prompt], [cache], [0])]
    out: list[int] = []
    for i in range(decode):
        nxt = tokens[i] if tokens is not None else int(steps[-1]["logits"][-1].argmax())
        out.append(nxt)
        steps.append(cap.step([[nxt]], [cache], [len(prompt) + i]))
    return steps, out


def layer_stats(steps: list[dict], layers: int, sink: int) -> list[dict]:
    """Per layer: |x| of the sink channel at token 0, the largest |x| elsewhere (any token, any channel), the
    sink channel's largest |x| at the other tokens and their largest |x| in any channel (decode steps
    included), the median |x| of the prefill."""
    out = []
    for i in range(layers):
        x = steps[0][f"layers.{i}.out"].double().abs()
        rest = x.clone()
        rest[0, sink] = 0
        later = torch.cat([x[1:]] + [s[f"layers.{i}.out"].double().abs() for s in steps[1:]])
        out.append(dict(sink0=float(x[0, sink]), other=float(rest.max()), sink_rest=float(later[:, sink].max()),
                        rest_max=float(later.max()), median=float(x.median())))
    return out


def low_precision(model, prompt, tokens, layers: int, sink: int) -> list[dict]:
    """Per layer: the sink at token 0, whether every point of every step is finite, the largest |value| of
    any point and of the MLP's product ``silu(gate) * up`` (``mlp.act``)."""
    steps, _ = run(model, prompt, len(tokens), tokens)
    out = []
    for i in range(layers):
        names = [n for n in steps[0] if n.startswith(f"layers.{i}.")]
        finite = all(bool(torch.isfinite(s[n]).all()) for s in steps for n in names)
        peak = max(float(s[n].double().abs().max()) for s in steps for n in names)
        act = max(float(s[f"layers.{i}.mlp.act"].double().abs().max()) for s in steps)
        out.append(dict(sink0=float(steps[0][f"layers.{i}.out"][0, sink]), finite=finite, peak=peak, act=act))
    return out


def _span(values, fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(min(values))}..{fmt.format(max(values))}"


def table(stats: list[list[dict]], low: dict, layers: int, sink: int) -> tuple[list[str], list[list[str]]]:
    """The printed table: one row per layer, each cell ``min..max`` over the prompts."""
    header = ["layer", f"|x| ch {sink} tok 0", "largest other |x|", f"ch {sink} other tokens", "other tokens' largest",
              "median |x|"]
    header += [f"{dt} ch {sink} tok 0" for dt in low] + [f"{dt} finite, peak, mlp.act peak" for dt in low]
    rows = []
    for i in range(layers):
        col = [[s[i][k] for s in stats] for k in ("sink0", "other", "sink_rest", "rest_max", "median")]
        row = [str(i)] + [_span(c, f) for c, f in zip(col, ("{:.0f}", "{:.0f}", "{:.1f}", "{:.1f}", "{:.2f}"))]
        row += [_span([abs(r[i]["sink0"]) for r in low[dt]], "{:.0f}") for dt in low]
        row += [f"{all(r[i]['finite'] for r in low[dt])}, {max(r[i]['peak'] for r in low[dt]):.3g}, "
                f"{max(r[i]['act'] for r in low[dt]):.3g}" for dt in low]
        rows.append(row)
    return header, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap, "weight seed")
    ap.set_defaults(preset="deep-sink")
    ap.add_argument("--seeds", type=int, default=8, help="random prompts (one per seed)")
    ap.add_argument("--decode", type=int, default=4, help="greedy decode steps after each prefill")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="low-precision dtypes checked")
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = ap.parse_args()
    check_json_arg(ap, args)
    log = make_log("depth_stats")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    t0 = time.perf_counter()
    d = resolve_checkpoint(ap, args, log)
    ref = load_hf_model(d, "float64")
    cfg = ref.config
    n = cfg.num_hidden_layers
    ps = prompts(cfg.vocab_size, args.seeds)
    runs = [run(ref, p, args.decode) for p in ps]
    if args.preset in SINKS and not args.ckpt_dir:
        sink = sink_channels(cfg.hidden_size)["S"]
    else:
        sink = int(runs[0][0][0][f"layers.{n // 2}.out"][0].abs().argmax())
    stats = [layer_stats(steps, n, sink) for steps, _ in runs]
    log(f"float64: {len(ps)} prompts of {min(map(len, ps))}-{max(map(len, ps))} tokens, {args.decode} decode "
        f"steps ({time.perf_counter() - t0:.1f}s)")
    low = {}
    for dt in args.dtypes.split(","):
        m = load_hf_model(d, dt)
        low[dt] = [low_precision(m, p, toks, n, sink) for p, (_, toks) in zip(ps, runs)]
        log(f"{dt} done ({time.perf_counter() - t0:.1f}s)")
    header, rows = table(stats, low, n, sink)
    print(f"{args.preset} (weight seed {args.seed}): {len(ps)} prompts of {min(map(len, ps))}-{max(map(len, ps))} "
          f"tokens + {args.decode} decode steps; min..max over prompts; sink channel {sink}")
    print_table(header, rows)
    print(f"total {time.perf_counter() - t0:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, seed=args.seed, sink=sink, lengths=list(map(len, ps)),
                           float64=stats, low=low), f, indent=1)


if __name__ == "__main__":
    main()
