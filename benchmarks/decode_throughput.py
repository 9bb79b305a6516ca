"""Greedy generation throughput on CPU: impl (tp 1) vs Hugging Face ``Qwen2ForCausalLM.generate``.

Same checkpoint, same seeded prompts (lengths uniform in ``[--min-len, --max-len]``), float32, greedy,
exactly ``--new-tokens`` new tokens per prompt (impl: ``ignore_eos=True``; HF: ``min_new_tokens =
max_new_tokens``). HF batches are left-padded (pad id 0) with an attention mask. Both sides use the same
number of torch threads: the impl worker process is set to ``--threads`` through ``LLM.call`` (its driver
process idles in a pipe wait during each step, apart from scheduling and the argmax over the logits), and
the HF model runs in this process with ``torch.set_num_threads(--threads)``. One untimed warm-up run per
side first (short prompts, a few tokens, every batch size). Timed runs alternate impl / HF per batch size,
``--repeats`` times (default 2; fresh prompts of the same lengths each time, so impl's prefix cache never
hits); the fastest run of each side counts.

Per run: wall time of the whole ``generate`` call, time to the first new token (prefill), and the decode
rest; new tokens/s end to end (B*N / total) and in decode (B*(N-1) / decode time). At batch 1 the greedy
tokens of both sides must match (a mismatch is tolerated and reported only where HF's top-2 logit gap is
within float noise).

    python benchmarks/decode_throughput.py                                  # qwen2.5-0.5b, 32 tokens, batch 1,16
    python benchmarks/decode_throughput.py --preset small --new-tokens 64 --batch 1,4,16 --json /tmp/t.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


AIMS = {1: 1.0, 16: 2.0}  # the project's throughput aims, impl / HF end to end, by batch size


def log(msg: str) -> None:
    print(f"[decode_throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# runs inside the impl worker through ``LLM.call("decode_throughput:set_threads", n)``
def set_threads(runner, n: int) -> int:
    import torch
    torch.set_num_threads(n)
    return torch.get_num_threads()


def resolve_checkpoint(args) -> Path:
    from tpcheck.checkpoints import resolve_checkpoint as resolve
    log(f"checkpoint {args.ckpt_dir or args.preset} (written once on first use, ~15 s for qwen2.5-0.5b) ...")
    return resolve(args.preset, seed=args.seed, ckpt_dir=args.ckpt_dir, root=args.cache_root)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int, repeat: int = 0) -> list[list[int]]:
    """``n`` prompts, lengths uniform in ``[lo, hi]`` from ``seed``; each ``repeat`` has the same lengths but fresh
    token ids, so a repeated run cannot hit impl's prefix cache with the blocks of an earlier one."""
    import torch
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    if repeat:
        g.manual_seed(seed * 7919 + repeat)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


class StepTimes:
    """HF streamer: ``put`` is called with the prompt, then once per generated token (all rows)."""

    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_impl(llm, prompts, n_new: int) -> dict:
    from impl import SamplingParams
    pids = [p.pid for p in llm.executor.procs]
    stamps = []
    call = llm.executor.call

    def timed_call(method, *a, **kw):  # wraps only this instance's executor: impl itself is untouched
        out = call(method, *a, **kw)
        if method == "step":
            stamps.append(time.perf_counter())
        return out

    llm.executor.call = timed_call
    try:
        w0, c0 = sum(proc_cpu_s(p) for p in pids), time.process_time()
        t0 = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
        t1 = time.perf_counter()
        driver_cpu, worker_cpu = time.process_time() - c0, sum(proc_cpu_s(p) for p in pids) - w0
    finally:
        del llm.executor.call
    # the first step(s) prefill every prompt (all are admitted at once when they fit); the first new token
    # of every sequence exists after the step that prefilled the last of them
    prefill_steps = len(stamps) - (n_new - 1)
    t_first = stamps[prefill_steps - 1] if prefill_steps >= 1 else stamps[0]
    return dict(tokens=out, total_s=t1 - t0, first_s=t_first - t0, steps=len(stamps), prefill_steps=prefill_steps,
                cpu_s=driver_cpu + worker_cpu, driver_cpu_s=driver_cpu)


def run_hf(model, prompts, n_new: int, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    st = StepTimes()
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                             pad_token_id=0, streamer=st)
    t1, cpu = time.perf_counter(), time.process_time() - c0
    new = out[:, width:].tolist()
    # st.t[0]: the prompt handed to the streamer at the start; st.t[1]: the first new token
    t_first = st.t[1] if len(st.t) > 1 else t1
    return dict(tokens=new, total_s=t1 - t0, first_s=t_first - t0, steps=len(st.t) - 1, prefill_steps=1,
                cpu_s=cpu, driver_cpu_s=cpu)


def first_mismatch_gap(model, llm, prompt, hf_tok, impl_tok) -> dict:
    """At the first position where the sides differ: HF's top-2 logit gap and how far impl's logits are."""
    import torch
    j = next(i for i, (a, b) in enumerate(zip(hf_tok, impl_tok)) if a != b)
    ctx = prompt + hf_tok[:j]
    with torch.inference_mode():
        hf_logits = model(torch.tensor([ctx])).logits[0, -1].float()
    impl_logits = llm.logits(ctx)[-1].float()
    top = torch.topk(hf_logits, 2)
    diff = (impl_logits - hf_logits).abs()
    return dict(position=j, hf_token=hf_tok[j], impl_token=impl_tok[j], hf_top2=top.indices.tolist(),
                hf_top2_gap=float(top.values[0] - top.values[1]), max_abs_logit=float(hf_logits.abs().max()),
                max_abs_logit_diff=float(diff.max()))




def main(argv=None) -> int:
    from tpcheck.cli import positive_ints
    from tpcheck.checkpoints import preset_names
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=preset_names(), help="checkpoint preset")
    ap.add_argument("--ckpt-dir", help="checkpoint directory to reuse (written there once if missing/empty)")
    ap.add_argument("--cache-root", help="cache root for the preset checkpoint")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint and prompt seed")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    ap.add_argument("--batch", type=positive_ints, default=[1, 16], help="batch sizes (default 1,16)")
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt (default 16)")
    ap.add_argument("--max-len", type=int, default=128, help="longest prompt (default 128)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads on both sides (default: all cores)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per side and batch (fresh prompts of the same lengths each); the fastest counts")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.new_tokens < 1:
        ap.error("--new-tokens must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: directory {Path(args.json).resolve().parent} does not exist")

    import torch
    from tpcheck.capture_hf import load_hf_model

    from impl import LLM
    from impl.config import load_config

    t_start = time.perf_counter()
    try:
        model_dir = resolve_checkpoint(args)
    except (FileExistsError, NotADirectoryError, ValueError) as e:
        ap.error(f"--ckpt-dir: {e}")
    cfg = load_config(model_dir)
    if args.max_len + args.new_tokens > cfg.max_position:
        ap.error(f"--max-len {args.max_len} + --new-tokens {args.new_tokens} exceeds the model's "
                 f"{cfg.max_position} positions")
    torch.set_num_threads(args.threads)
    timed = {(b, rep): make_prompts(b, args.min_len, args.max_len, cfg.vocab_size, args.seed * 1000 + b, rep)
             for b in args.batch for rep in range(args.repeats)}
    warm = {b: make_prompts(b, 8, 16, cfg.vocab_size, args.seed * 1000 + 500 + b) for b in args.batch}
    warm_tokens = min(args.new_tokens, 4)

    t0 = time.perf_counter()
    log(f"loading impl (tp 1, worker process) from {model_dir} ...")
    llm = LLM(model_dir, tp_size=1, dtype="float32")
    rows, checks, failed = [], {}, False
    try:
        impl_threads = llm.call(f"{Path(__file__).stem}:set_threads", args.threads)[0]
        log(f"impl loaded in {time.perf_counter() - t0:.1f}s; worker threads {impl_threads}")
        t0 = time.perf_counter()
        log("loading HF Qwen2ForCausalLM ...")
        model = load_hf_model(model_dir, "float32")
        log(f"HF loaded in {time.perf_counter() - t0:.1f}s; driver threads {torch.get_num_threads()}")

        t0 = time.perf_counter()
        for b in args.batch:
            run_impl(llm, warm[b], warm_tokens)
            run_hf(model, warm[b], warm_tokens, args.threads)
        log(f"warm-up (both sides, batches {args.batch}, {warm_tokens} tokens) {time.perf_counter() - t0:.1f}s")

        for b in args.batch:
            best, check = {}, dict(batch=b, rows_equal=0, rows=0)
            for rep in range(args.repeats):
                prompts = timed[b, rep]
                res = {}
                for side, fn in (("impl", lambda: run_impl(llm, prompts, args.new_tokens)),
                                 ("hf", lambda: run_hf(model, prompts, args.new_tokens, args.threads))):
                    la = os.getloadavg()[0]
                    r = res[side] = fn()
                    r["loadavg_1m_before"], r["loadavg_1m_after"] = la, os.getloadavg()[0]
                    r["prompt_tokens"] = sum(len(p) for p in prompts)
                    log(f"batch {b} {side} run {rep + 1}/{args.repeats}: {r['total_s']:.2f}s "
                        f"(first token {r['first_s']:.2f}s); load avg {la:.2f} -> {r['loadavg_1m_after']:.2f}")
                    if side not in best or r["total_s"] < best[side]["total_s"]:
                        best[side] = r
                # ---- correctness cross-check, on every repeat ----
                it, ht = res["impl"]["tokens"], res["hf"]["tokens"]
                check["rows_equal"] += sum(it[i] == ht[i] for i in range(b))
                check["rows"] += b
                if b == 1 and it[0] != ht[0] and "first" not in check:
                    mism = [j for j, (x, y) in enumerate(zip(it[0], ht[0])) if x != y]
                    info = first_mismatch_gap(model, llm, prompts[0], ht[0], it[0])
                    tiny = (info["hf_top2_gap"] <= 1e-3 * max(1.0, info["max_abs_logit"])
                            and info["max_abs_logit_diff"] <= 1e-3 * max(1.0, info["max_abs_logit"]))
                    check.update(mismatch_positions=mism, first=info, within_noise=tiny)
                    failed |= not tiny
            checks[b] = check
            for side in ("impl", "hf"):
                r = best[side]
                dec_s = r["total_s"] - r["first_s"]
                rows.append(dict(
                    batch=b, side=side, prompt_tokens=r["prompt_tokens"], new_tokens=args.new_tokens,
                    total_s=r["total_s"], first_token_s=r["first_s"], decode_s=dec_s, steps=r["steps"],
                    cpu_s=r["cpu_s"], driver_cpu_s=r["driver_cpu_s"], tok_per_cpu_s=b * args.new_tokens / r["cpu_s"],
                    tok_per_s=b * args.new_tokens / r["total_s"],
                    decode_tok_per_s=(b * (args.new_tokens - 1) / dec_s) if args.new_tokens > 1 and dec_s > 0 else None,
                    loadavg_1m_before=r["loadavg_1m_before"], loadavg_1m_after=r["loadavg_1m_after"]))
    finally:
        llm.close()
    total_s = time.perf_counter() - t_start

    # ---- report ---------------------------------------------------------------------------------------
    print(f"# decode_throughput: preset {args.preset}, float32, CPU, impl tp 1 vs HF generate; greedy, "
          f"{args.new_tokens} new tokens/prompt; prompt lengths uniform [{args.min_len}, {args.max_len}] (seeded)")
    print(f"# threads: impl worker {impl_threads}, HF (driver) {torch.get_num_threads()}, cores {os.cpu_count()}; "
          f"best of {args.repeats}; torch {torch.__version__}")
    print("# total = whole generate call; first = time to the first new token (prefill); "
          "tok/s = batch*new/total; decode tok/s = batch*(new-1)/(total-first)")
    print("# cpu s = CPU seconds used (impl: worker + driver; HF: this process); "
          "loadavg = 1-min load average before->after the run (> cores: other processes competed for the CPU)")
    print()
    hdr = ["batch", "side", "prompt tok", "total s", "first s", "decode s", "tok/s", "decode tok/s", "cpu s",
           "tok/cpu-s", "loadavg"]
    table = [[str(r["batch"]), r["side"], str(r["prompt_tokens"]), f"{r['total_s']:.2f}", f"{r['first_token_s']:.2f}",
              f"{r['decode_s']:.2f}", f"{r['tok_per_s']:.2f}",
              "-" if r["decode_tok_per_s"] is None else f"{r['decode_tok_per_s']:.2f}",
              f"{r['cpu_s']:.1f}", f"{r['tok_per_cpu_s']:.2f}",
              f"{r['loadavg_1m_before']:.1f}->{r['loadavg_1m_after']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(hdr)]
    print("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths)))
    print()
    print("# ratios impl / HF (> 1: impl faster)")
    ratios = {}
    for b in args.batch:
        i = next(r for r in rows if r["batch"] == b and r["side"] == "impl")
        h = next(r for r in rows if r["batch"] == b and r["side"] == "hf")
        rr = dict(tok_per_s=i["tok_per_s"] / h["tok_per_s"], prefill_speed=h["first_token_s"] / i["first_token_s"],
                  tok_per_cpu_s=i["tok_per_cpu_s"] / h["tok_per_cpu_s"],
                  decode_tok_per_s=(i["decode_tok_per_s"] / h["decode_tok_per_s"]
                                    if i["decode_tok_per_s"] and h["decode_tok_per_s"] else None))
        ratios[b] = rr
        aim = AIMS.get(b)
        dec = "-" if rr["decode_tok_per_s"] is None else f"{rr['decode_tok_per_s']:.2f}x"
        print(f"batch {b:>3}: end-to-end {rr['tok_per_s']:.2f}x, prefill {rr['prefill_speed']:.2f}x, decode {dec}, "
              f"per CPU-second {rr['tok_per_cpu_s']:.2f}x"
              + ("" if aim is None else f"   (aim >= {aim:g}x end-to-end: {'met' if rr['tok_per_s'] >= aim else 'NOT met'})"))
    print()
    print("# correctness (greedy tokens impl vs HF)")
    for b, c in checks.items():
        line = f"batch {b:>3}: {c['rows_equal']}/{c['rows']} sequences identical (all repeats)"
        if "first" in c:
            f = c["first"]
            line += (f"; mismatch at positions {c['mismatch_positions']}; first at {f['position']}: HF {f['hf_token']} "
                     f"vs impl {f['impl_token']}, HF top-2 gap {f['hf_top2_gap']:.3g}, max |impl-HF| logit "
                     f"{f['max_abs_logit_diff']:.3g} (max |logit| {f['max_abs_logit']:.3g}) -> "
                     f"{'within float noise (reported, not fatal)' if c['within_noise'] else 'NOT noise: FAIL'}")
        elif b > 1 and c["rows_equal"] < c["rows"]:
            line += " (informational: HF's padded batch differs numerically from its unpadded runs)"
        print(line)
    busy = max(max(r["loadavg_1m_before"], r["loadavg_1m_after"]) for r in rows)
    if busy > (os.cpu_count() or 1) + 0.5:
        print(f"# WARNING: load average reached {busy:.1f} on {os.cpu_count()} cores: other processes competed for "
              f"the CPU, so wall times are inflated and noisy (OpenMP threads stall when descheduled); compare the "
              f"per-CPU-second ratios, rerun on an idle machine, or try --threads 1 --repeats 3")
    print(f"# total {total_s:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            preset=args.preset, loadavg_max=busy, checkpoint=str(model_dir), new_tokens=args.new_tokens, batches=args.batch,
            min_len=args.min_len, max_len=args.max_len, threads=dict(impl=impl_threads, hf=torch.get_num_threads()),
            repeats=args.repeats, rows=rows, ratios={str(k): v for k, v in ratios.items()},
            checks={str(k): v for k, v in checks.items()}, total_s=total_s), indent=2) + "\n")
        log(f"wrote {args.json}")
    if failed:
        print("FAIL: impl's greedy tokens differ from HF's at batch 1 beyond float noise", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
