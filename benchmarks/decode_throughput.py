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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_checkpoint_args, add_json_arg, check_json_arg, make_log, print_table, proc_cpu_s  # noqa: E402
from common import resolve_checkpoint  # noqa: E402

AIMS = {1: 1.0, 16: 2.0}  # the project's throughput aims, impl / HF end to end, by batch size
log = make_log("decode_throughput")


# runs inside the impl worker through ``LLM.call("decode_throughput:set_threads", n)``
def set_threads(runner, n: int) -> int:
    import torch
    torch.set_num_threads(n)
    return torch.get_num_threads()


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int, repeat: int = 0) -> list[list[int]]:
    """``n`` prompts, lengths uniform in ``[lo, hi]`` from ``seed``, token ids ``tpcheck.pipeline.check.random_prompts``;
    each ``repeat`` has the same lengths but fresh token ids, so a repeated run cannot hit impl's prefix cache
    with the blocks of an earlier one."""
    import torch

    from tpcheck.pipeline.check import random_prompts
    lens = torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [p[:k] for p, k in zip(random_prompts(vocab, n, hi, seed * 7919 + repeat), lens)]


class StepTimes:
    """HF streamer: ``put`` is called with the prompt, then once per generated token (all rows)."""

    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


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


def parse_args(argv):
    from tpcheck.inputs.arg_types import positive_ints
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap, seed_help="checkpoint and prompt seed")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    ap.add_argument("--batch", type=positive_ints, default=[1, 16], help="batch sizes (default 1,16)")
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt (default 16)")
    ap.add_argument("--max-len", type=int, default=128, help="longest prompt (default 128)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads on both sides (default: all cores)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per side and batch (fresh prompts of the same lengths each); the fastest counts")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    if args.new_tokens < 1:
        ap.error("--new-tokens must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    check_json_arg(ap, args)
    return ap, args


def cross_check(check: dict, res: dict, prompts, model, llm) -> bool:
    """Greedy tokens of one repeat, impl vs HF, into ``check``; True for a batch-1 mismatch beyond float noise."""
    it, ht = res["impl"]["tokens"], res["hf"]["tokens"]
    b = len(prompts)
    check["rows_equal"] += sum(it[i] == ht[i] for i in range(b))
    check["rows"] += b
    if b == 1 and it[0] != ht[0] and "first" not in check:
        mism = [j for j, (x, y) in enumerate(zip(it[0], ht[0])) if x != y]
        info = first_mismatch_gap(model, llm, prompts[0], ht[0], it[0])
        tiny = (info["hf_top2_gap"] <= 1e-3 * max(1.0, info["max_abs_logit"])
                and info["max_abs_logit_diff"] <= 1e-3 * max(1.0, info["max_abs_logit"]))
        check.update(mismatch_positions=mism, first=info, within_noise=tiny)
        return not tiny
    return False


def side_row(b: int, side: str, r: dict, n_new: int) -> dict:
    """The reported figures of one side's best run at batch ``b``."""
    dec_s = r["total_s"] - r["first_s"]
    return dict(
        batch=b, side=side, prompt_tokens=r["prompt_tokens"], new_tokens=n_new,
        total_s=r["total_s"], first_token_s=r["first_s"], decode_s=dec_s, steps=r["steps"],
        cpu_s=r["cpu_s"], driver_cpu_s=r["driver_cpu_s"], tok_per_cpu_s=b * n_new / r["cpu_s"],
        tok_per_s=b * n_new / r["total_s"],
        decode_tok_per_s=(b * (n_new - 1) / dec_s) if n_new > 1 and dec_s > 0 else None,
        loadavg_1m_before=r["loadavg_1m_before"], loadavg_1m_after=r["loadavg_1m_after"])


def machine_floor(model, threads: int) -> dict:
    """What one decode step cannot beat on this machine: every weight matrix is read once per step (the
    embedding only where it is the tied LM head), at the read bandwidth of a 1 GiB ``sum``; and its FLOPs at a
    2048^3 float32 matmul's rate. Both best of 3 with ``threads`` torch threads, in this process."""
    import torch
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    w = model.get_input_embeddings().weight  # a decode step reads B rows of it, unless it is the LM head too
    emb, emb_bytes = (0, 0) if tied else (w.numel(), w.numel() * w.element_size())
    read = sum(p.numel() * p.element_size() for p in model.parameters()) - emb_bytes
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - emb
    x = torch.ones(2**28)  # 1 GiB of float32
    a = torch.randn(2048, 2048)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)
    bw = x.numel() * 4 / best(lambda: float(x.sum()))
    flops = 2 * 2048**3 / best(lambda: a @ a)
    return dict(weight_bytes=read, matmul_params=matmul_params, read_gb_s=bw / 1e9, matmul_gflop_s=flops / 1e9,
                threads=threads)


def print_floor(floor: dict, rows: list[dict], n_new: int) -> dict:
    """Per batch size: the step floor, each side's decode step against it, and the end-to-end ratio impl could
    reach at most if its decode steps ran at the floor (its prefill as measured)."""
    print(f"# decode step floor: {floor['weight_bytes'] / 1e9:.2f} GB of weights read per step at "
          f"{floor['read_gb_s']:.1f} GB/s; 2 x {floor['matmul_params'] / 1e6:.0f}M x batch FLOPs at "
          f"{floor['matmul_gflop_s']:.0f} GFLOP/s (2048^3 matmul); {floor['threads']} thread(s)")
    out = {}
    for b in sorted({r["batch"] for r in rows}):
        i = next(r for r in rows if r["batch"] == b and r["side"] == "impl")
        h = next(r for r in rows if r["batch"] == b and r["side"] == "hf")
        step = max(floor["weight_bytes"] / (floor["read_gb_s"] * 1e9),
                   2 * floor["matmul_params"] * b / (floor["matmul_gflop_s"] * 1e9))
        if n_new < 2:
            continue
        i_step, h_step = i["decode_s"] / (n_new - 1), h["decode_s"] / (n_new - 1)
        best_total = i["first_token_s"] + (n_new - 1) * step
        out[b] = dict(floor_step_s=step, impl_step_s=i_step, hf_step_s=h_step,
                      max_end_to_end=h["total_s"] / best_total)
        print(f"batch {b:>3}: floor {step * 1e3:.0f} ms/step; HF {h_step * 1e3:.0f} ms ({h_step / step:.2f}x the floor), "
              f"impl {i_step * 1e3:.0f} ms ({i_step / step:.2f}x); impl / HF end to end with decode at the floor: "
              f"at most {out[b]['max_end_to_end']:.2f}x")
    print()
    return out


def timed_batch(llm, model, args, b: int, prompts_by_repeat: list) -> tuple[list[dict], dict, bool]:
    """``--repeats`` timed runs per side at batch ``b``, alternating impl / HF: the rows of each side's fastest
    run, the correctness cross-check, and whether it failed."""
    best, check, failed = {}, dict(batch=b, rows_equal=0, rows=0), False
    for rep, prompts in enumerate(prompts_by_repeat):
        res = {}
        for side, fn in (("impl", lambda p=prompts: run_impl(llm, p, args.new_tokens)),
                         ("hf", lambda p=prompts: run_hf(model, p, args.new_tokens, args.threads))):
            la = os.getloadavg()[0]
            r = res[side] = fn()
            r["loadavg_1m_before"], r["loadavg_1m_after"] = la, os.getloadavg()[0]
            r["prompt_tokens"] = sum(len(p) for p in prompts)
            log(f"batch {b} {side} run {rep + 1}/{args.repeats}: {r['total_s']:.2f}s "
                f"(first token {r['first_s']:.2f}s); load avg {la:.2f} -> {r['loadavg_1m_after']:.2f}")
            if side not in best or r["total_s"] < best[side]["total_s"]:
                best[side] = r
        failed |= cross_check(check, res, prompts, model, llm)  # on every repeat
    return [side_row(b, side, best[side], args.new_tokens) for side in ("impl", "hf")], check, failed


def measure(args, model_dir: Path, vocab: int) -> dict:
    """Both sides loaded, warmed up and timed at every batch size: rows, checks, failed, impl_threads."""
    import torch

    from impl import LLM
    from tpcheck.reference.hf import load_hf_model
    timed = {b: [make_prompts(b, args.min_len, args.max_len, vocab, args.seed * 1000 + b, rep)
                 for rep in range(args.repeats)] for b in args.batch}
    warm = {b: make_prompts(b, 8, 16, vocab, args.seed * 1000 + 500 + b) for b in args.batch}
    warm_tokens = min(args.new_tokens, 4)
    t0 = time.perf_counter()
    log(f"loading impl (tp 1, worker process) from {model_dir} ...")
    llm = LLM(model_dir, tp_size=1, dtype="float32")
    out = dict(rows=[], checks={}, failed=False)
    try:
        out["impl_threads"] = llm.call(f"{Path(__file__).stem}:set_threads", args.threads)[0]
        log(f"impl loaded in {time.perf_counter() - t0:.1f}s; worker threads {out['impl_threads']}")
        t0 = time.perf_counter()
        log("loading HF Qwen2ForCausalLM ...")
        model = load_hf_model(model_dir, "float32")
        log(f"HF loaded in {time.perf_counter() - t0:.1f}s; driver threads {torch.get_num_threads()}")
        out["floor"] = machine_floor(model, args.threads)
        t0 = time.perf_counter()
        for b in args.batch:
            run_impl(llm, warm[b], warm_tokens)
            run_hf(model, warm[b], warm_tokens, args.threads)
        log(f"warm-up (both sides, batches {args.batch}, {warm_tokens} tokens) {time.perf_counter() - t0:.1f}s")
        for b in args.batch:
            rows, out["checks"][b], failed = timed_batch(llm, model, args, b, timed[b])
            out["rows"] += rows
            out["failed"] |= failed
    finally:
        llm.close()
    return out


# ---- report ---------------------------------------------------------------------------------------------
def print_rows(args, rows: list[dict], impl_threads: int) -> None:
    import torch
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
    print_table(hdr, [[str(r["batch"]), r["side"], str(r["prompt_tokens"]), f"{r['total_s']:.2f}",
                       f"{r['first_token_s']:.2f}", f"{r['decode_s']:.2f}", f"{r['tok_per_s']:.2f}",
                       "-" if r["decode_tok_per_s"] is None else f"{r['decode_tok_per_s']:.2f}",
                       f"{r['cpu_s']:.1f}", f"{r['tok_per_cpu_s']:.2f}",
                       f"{r['loadavg_1m_before']:.1f}->{r['loadavg_1m_after']:.1f}"] for r in rows])
    print()


def print_ratios(batches: list[int], rows: list[dict]) -> dict:
    """impl / HF per batch size, against the aims; returns them."""
    print("# ratios impl / HF (> 1: impl faster)")
    ratios = {}
    for b in batches:
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
    return ratios


def print_checks(checks: dict) -> None:
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


def warn_if_busy(rows: list[dict]) -> float:
    """The highest load average seen; a warning when other processes competed for the cores."""
    busy = max(max(r["loadavg_1m_before"], r["loadavg_1m_after"]) for r in rows)
    if busy > (os.cpu_count() or 1) + 0.5:
        print(f"# WARNING: load average reached {busy:.1f} on {os.cpu_count()} cores: other processes competed for "
              f"the CPU, so wall times are inflated and noisy (OpenMP threads stall when descheduled); compare the "
              f"per-CPU-second ratios, rerun on an idle machine, or try --threads 1 --repeats 3")
    return busy


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    import torch

    from impl.config import load_config
    t_start = time.perf_counter()
    model_dir = resolve_checkpoint(ap, args, log)
    cfg = load_config(model_dir)
    if args.max_len + args.new_tokens > cfg.max_position:
        ap.error(f"--max-len {args.max_len} + --new-tokens {args.new_tokens} exceeds the model's "
                 f"{cfg.max_position} positions")
    torch.set_num_threads(args.threads)
    m = measure(args, model_dir, cfg.vocab_size)
    total_s = time.perf_counter() - t_start

    rows, checks = m["rows"], m["checks"]
    print_rows(args, rows, m["impl_threads"])
    ratios = print_ratios(args.batch, rows)
    floors = print_floor(m["floor"], rows, args.new_tokens)
    print_checks(checks)
    busy = warn_if_busy(rows)
    print(f"# total {total_s:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            preset=args.preset, loadavg_max=busy, checkpoint=str(model_dir), new_tokens=args.new_tokens,
            batches=args.batch, min_len=args.min_len, max_len=args.max_len,
            threads=dict(impl=m["impl_threads"], hf=torch.get_num_threads()), repeats=args.repeats, rows=rows,
            ratios={str(k): v for k, v in ratios.items()}, checks={str(k): v for k, v in checks.items()},
            floor=m["floor"], floor_by_batch={str(k): v for k, v in floors.items()},
            total_s=total_s), indent=2) + "\n")
        log(f"wrote {args.json}")
    if m["failed"]:
        print("FAIL: impl's greedy tokens differ from HF's at batch 1 beyond float noise", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
