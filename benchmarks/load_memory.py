"""Per-rank memory cost of loading a checkpoint into impl's TP workers.

For each TP size, starts the worker processes (``impl.executor.Executor``), samples every rank's
``/proc/<pid>/status`` before the load (torch imported, process group up), then runs the load
(``_load``: build the rank's model shard and read its slices from safetensors) while a thread polls
``/proc/<pid>/status`` every ``--interval-ms`` for the peak VmRSS / RssAnon / RssFile, and reads VmHWM
after. Reports per rank: baseline, peak, growth, final, growth / checkpoint size, next to the checkpoint's
size on disk and the expected per-rank share (sharded tensors / tp + replicated ones).

RssAnon is the rank's own memory (parameters, temporaries). RssFile counts pages of the mmapped
safetensors file that the rank touched while the file is open: they are clean page cache shared with other
processes (and reclaimable), but VmRSS / VmHWM include them. The script also predicts, from the file
header, which 4 KiB pages of the file each rank's slices touch, to explain RssFile.

    python benchmarks/load_memory.py                       # qwen2.5-0.5b, tp 1 and 2
    python benchmarks/load_memory.py --preset small --tp 1,2,4 --json /tmp/mem.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import MiB, Poller, add_checkpoint_args, add_json_arg, check_json_arg, make_log, print_table  # noqa: E402
from common import read_status, resolve_checkpoint  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
log = make_log("load_memory")


# ---- /proc sampling -------------------------------------------------------------------------------------
def reset_hwm(pid: int) -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/pid/clear_refs``); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler(Poller):
    """Polls the status of some pids; keeps the per-pid maximum of each key."""

    def __init__(self, pids: list[int], interval_s: float):
        super().__init__(interval_s)
        self.pids = pids
        self.peak = {p: {} for p in pids}
        self.samples = 0

    def sample(self) -> None:
        for p in self.pids:
            try:
                s = read_status(p)
            except (OSError, ValueError):
                continue
            pk = self.peak[p]
            for k, v in s.items():
                pk[k] = max(pk.get(k, 0), v)
        self.samples += 1


# ---- what a rank should hold (impl.shard_plan) -------------------------------------------------------------
def safetensors_headers(model_dir: Path) -> list[tuple[Path, int, dict]]:
    """(file, byte offset of the data section, header) of every safetensors file."""
    out = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        out.append((f, 8 + n, header))
    return out


def rank_slice(name: str, shape: list[int], plan, rank: int) -> tuple[str, int, int, int]:
    """The slice of tensor ``name`` rank ``rank`` reads, from its ``impl.shard_plan.ShardPlan``: (kind, dim,
    start, length). kind: 'shard' (split over tp), 'replicate' (every rank reads all), 'kv' (KV heads:
    split or replicated)."""
    tp = plan.tp
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # padded vocab rows; the last rank's are short
        start = rank * plan.vocab_rows
        return "shard", 0, start, max(0, min(start + plan.vocab_rows, shape[0]) - start)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "shard", 1, rank * (shape[1] // tp), shape[1] // tp
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        return "shard", 0, rank * (shape[0] // tp), shape[0] // tp
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        per_head = shape[0] // plan.total_kv_heads
        return "kv", 0, plan.kv_head_of(rank) * per_head, plan.kv_heads * per_head
    return "replicate", 0, 0, shape[0]


def _pages(lo: int, shape: list[int], item: int, dim: int, start: int, length: int):
    """The file pages (``PAGE``) a slice of the tensor whose data starts at byte ``lo`` touches."""
    import numpy as np
    row_bytes = item * math.prod(shape[1:]) if len(shape) > 1 else item
    if dim == 0 or len(shape) == 1:
        a, b = lo + start * row_bytes, lo + (start + length) * row_bytes
        return np.arange(a // PAGE, (b - 1) // PAGE + 1) if b > a else None
    # a column slice: `length` items out of every row
    rowstarts = lo + np.arange(shape[0], dtype=np.int64) * row_bytes + start * item
    first, last = rowstarts // PAGE, (rowstarts + length * item - 1) // PAGE
    span = int((last - first).max()) + 1
    pages = (first[:, None] + np.arange(span)[None, :])
    return pages[pages <= last[:, None]]


def expected_share(model_dir: Path, plan, rank: int, tied: bool) -> dict:
    """Bytes rank ``rank`` should hold (``ShardPlan.tensor_elements``), and the file pages its slice reads
    touch, from the headers alone."""
    import numpy as np
    total = sharded = replicated = held = pages_touched = rowpar_full = 0
    for _f, base, header in safetensors_headers(model_dir):
        touched = []
        for name, meta in header.items():
            item, shape = ITEMSIZE[meta["dtype"]], meta["shape"]
            nbytes = item * math.prod(shape)
            total += nbytes
            if (tied and name == "lm_head.weight") or name.endswith(".rotary_emb.inv_freq"):
                continue
            kind, dim, start, length = rank_slice(name, shape, plan, rank)
            held += plan.tensor_elements(name, shape, tied) * item
            if kind == "replicate":
                replicated += nbytes
            else:
                sharded += nbytes
            if dim == 1 and len(shape) > 1:
                rowpar_full += nbytes
            pages = _pages(base + meta["data_offsets"][0], shape, item, dim, start, length)
            if pages is not None:
                touched.append(pages)
        if touched:
            pages_touched += len(np.unique(np.concatenate(touched)))
    return dict(checkpoint_bytes=total, sharded_bytes=sharded, replicated_bytes=replicated,
                expected_param_bytes=held, predicted_file_pages_bytes=pages_touched * PAGE,
                rowparallel_tensor_bytes=rowpar_full)


# runs inside each rank via impl's ``runner.call("load_memory:param_bytes")`` seam
def param_bytes(runner) -> int:
    seen, n = set(), 0
    for p in runner.model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            n += p.untyped_storage().nbytes()
    return n


# ---- one TP size ---------------------------------------------------------------------------------------
def measure(model_dir: Path, tp: int, dtype: str, interval_s: float, kv_blocks: int, block_size: int) -> list[dict]:
    from impl.executor import Executor
    t0 = time.perf_counter()
    log(f"tp={tp}: starting {tp} worker process(es) ...")
    ex = Executor(tp, device="cpu")
    try:
        pids = [p.pid for p in ex.procs]
        time.sleep(0.5)  # let the workers settle after init
        base = {p: read_status(p) for p in pids}
        hwm_reset = all(reset_hwm(p) for p in pids)
        log(f"tp={tp}: workers up in {time.perf_counter() - t0:.1f}s (pids {pids}); "
            f"baseline RSS {', '.join(format(base[p]['VmRSS'] / MiB, '.0f') for p in pids)} MiB; loading ...")
        t1 = time.perf_counter()
        with Sampler(pids, interval_s) as sampler:
            ex.call("_load", str(model_dir), dtype, "cpu")
        load_s = time.perf_counter() - t1
        after = {p: read_status(p) for p in pids}
        if kv_blocks:
            ex.call("allocate_kv_cache", kv_blocks, block_size)
        # the spawned workers inherited this script's sys.path, whose first entry is benchmarks/
        held = ex.call("call", f"{Path(__file__).stem}:param_bytes")
        final = {p: read_status(p) for p in pids}
        log(f"tp={tp}: loaded in {load_s:.1f}s ({sampler.samples} samples)")
    finally:
        ex.shutdown()
    rows = []
    for rank, p in enumerate(pids):
        b, pk, a, fi = base[p], sampler.peak[p], after[p], final[p]
        peak_rss = max(pk.get("VmRSS", 0), a.get("VmHWM", 0) if hwm_reset else 0)
        rows.append(dict(
            tp=tp, rank=rank, pid=p, load_s=load_s, hwm_reset=hwm_reset,
            base_rss=b["VmRSS"], base_anon=b.get("RssAnon"), base_file=b.get("RssFile"),
            peak_rss=peak_rss, peak_rss_sampled=pk.get("VmRSS"), vmhwm_after=a.get("VmHWM"),
            peak_anon=pk.get("RssAnon"), peak_file=pk.get("RssFile"),
            after_rss=a["VmRSS"], after_anon=a.get("RssAnon"), after_file=a.get("RssFile"),
            final_rss=fi["VmRSS"], final_anon=fi.get("RssAnon"), final_file=fi.get("RssFile"),
            param_bytes=held[rank],
        ))
    return rows


def parse_args(argv):
    from tpcheck.inputs.arg_types import positive_ints
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--tp", type=positive_ints, default=[1, 2], help="TP sizes, comma-separated (default 1,2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="checkpoint dtype, also the load dtype")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="/proc polling interval (default 20)")
    ap.add_argument("--kv-blocks", type=int, default=1,
                    help="KV blocks allocated after the load, as LLM(num_kv_blocks=...) would (default 1; 0: none)")
    add_json_arg(ap)
    args = ap.parse_args(argv)
    if args.interval_ms <= 0:
        ap.error("--interval-ms must be > 0")
    if args.kv_blocks < 0:
        ap.error("--kv-blocks must be >= 0")
    if not Path("/proc/self/status").is_file():
        ap.error("needs Linux /proc")
    check_json_arg(ap, args)
    return ap, args


def shard_plans(ap, model_dir: Path, tps: list[int]) -> tuple[dict, bool]:
    """``impl.shard_plan`` of the checkpoint at every TP size (``ap.error`` for one it cannot split), and
    whether its embeddings are tied."""
    from impl.config import ConfigError, load_config
    from impl.shard_plan import shard_plan
    cfg = load_config(model_dir)
    plans = {}
    for tp in tps:
        try:
            plans[tp] = shard_plan(cfg, tp)
        except ConfigError as e:
            ap.error(f"--tp {tp}: {e}")
    return plans, cfg.tie_word_embeddings


def add_ratios(rows: list[dict], ckpt_bytes: int) -> None:
    """Growth figures of every row, in place (also what the JSON gets)."""
    for r in rows:
        growth, anon_growth = r["peak_rss"] - r["base_rss"], r["peak_anon"] - r["base_anon"]
        r.update(growth=growth, growth_over_ckpt=growth / ckpt_bytes, final_growth=r["final_rss"] - r["base_rss"],
                 anon_growth=anon_growth, anon_growth_over_ckpt=anon_growth / ckpt_bytes,
                 file_growth=r["peak_file"] - r["base_file"], ckpt_file_bytes=ckpt_bytes)


def print_rows(args, model_dir: Path, rows: list[dict], ckpt_bytes: int) -> None:
    m = lambda x: "-" if x is None else f"{x / MiB:,.0f}"  # noqa: E731
    print(f"# load_memory: preset {args.preset}, {args.dtype}, checkpoint {model_dir}")
    print(f"# checkpoint on disk: {ckpt_bytes / MiB:,.0f} MiB in "
          f"{len(list(model_dir.glob('*.safetensors')))} safetensors file(s); page {PAGE} B; "
          f"polled every {args.interval_ms:g} ms; VmHWM reset before load: {rows[0]['hwm_reset']}")
    print("# MiB. growth = peak - baseline (during load). anon = RssAnon (the rank's own memory); "
          "file = RssFile (mmapped checkpoint pages, shared page cache)")
    print()
    hdr = ["tp", "rank", "base RSS", "peak RSS", "growth", "growth/ckpt", "final RSS", "final growth",
           "expected share", "params held", "peak anon", "anon growth", "anon growth/ckpt",
           "peak file", "file growth", "predicted file pages", "load s"]
    print_table(hdr, [[str(r["tp"]), str(r["rank"]), m(r["base_rss"]), m(r["peak_rss"]), m(r["growth"]),
                       f"{r['growth_over_ckpt']:.3f}", m(r["final_rss"]), m(r["final_growth"]),
                       m(r["expected_param_bytes"]), m(r["param_bytes"]), m(r["peak_anon"]), m(r["anon_growth"]),
                       f"{r['anon_growth_over_ckpt']:.3f}", m(r["peak_file"]), m(r["file_growth"]),
                       m(r["predicted_file_pages_bytes"]), f"{r['load_s']:.1f}"] for r in rows])
    print()


def print_ratios(by_tp: dict[int, list[dict]], ckpt_bytes: int) -> None:
    print("# ratios")
    for tp, rs in by_tp.items():
        g = max(r["growth"] for r in rs)
        a = max(r["anon_growth"] for r in rs)
        exp = max(r["expected_param_bytes"] for r in rs)
        print(f"tp={tp}: max per-rank growth {g / MiB:,.0f} MiB = {g / ckpt_bytes:.3f} x checkpoint "
              f"(expected share {exp / ckpt_bytes:.3f}); anon growth {a / ckpt_bytes:.3f} x checkpoint; "
              f"growth/expected {g / exp:.2f}, anon growth/expected {a / exp:.2f}")
    if 1 in by_tp:
        g1 = max(r["growth"] for r in by_tp[1])
        a1 = max(r["anon_growth"] for r in by_tp[1])
        for tp, rs in by_tp.items():
            if tp > 1:
                print(f"tp={tp} vs tp=1: per-rank growth ratio {max(r['growth'] for r in rs) / g1:.3f}, "
                      f"anon growth ratio {max(r['anon_growth'] for r in rs) / a1:.3f} (ideal ~{1 / tp:.3f})")
    print()


def verdict_line(r: dict) -> str:
    """Whether rank ``r`` stays within its expected share by peak RSS and by RssAnon, and why not."""
    tp, exp = r["tp"], r["expected_param_bytes"]
    ok_anon = r["anon_growth"] <= 1.15 * exp + 64 * MiB
    ok_rss = r["growth"] <= 1.15 * exp + 64 * MiB
    file_pred = r["predicted_file_pages_bytes"]
    line = (f"tp={tp} rank {r['rank']}: growth {r['growth'] / MiB:,.0f} MiB vs expected share "
            f"{exp / MiB:,.0f} MiB -> {'OK' if ok_rss else 'ABOVE the share'} by peak RSS; "
            f"anon growth {r['anon_growth'] / MiB:,.0f} MiB -> {'OK' if ok_anon else 'ABOVE the share'} "
            f"by RssAnon")
    if not ok_rss:
        line += (f". The excess is RssFile: {r['file_growth'] / MiB:,.0f} MiB of mmapped checkpoint pages "
                 f"mapped while the file is open (predicted from the slices this rank reads: "
                 f"{file_pred / MiB:,.0f} MiB = {file_pred / r['checkpoint_bytes']:.3f} of the file")
        if tp > 1 and r["rowparallel_tensor_bytes"]:
            line += (f"; the column slices of the row-parallel o_proj/down_proj weights "
                     f"({r['rowparallel_tensor_bytes'] / MiB:,.0f} MiB) touch every page of those tensors, "
                     f"since a row's slice is shorter than a page or straddles them")
        line += f"); after the load the file is unmapped: final RssFile {r['final_file'] / MiB:,.0f} MiB"
    return line


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    model_dir = resolve_checkpoint(ap, args, log, args.dtype)
    plans, tied = shard_plans(ap, model_dir, args.tp)
    ckpt_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    t_all = time.perf_counter()
    rows = []
    for tp in args.tp:
        for r in measure(model_dir, tp, args.dtype, args.interval_ms / 1000, args.kv_blocks, 16):
            r.update(expected_share(model_dir, plans[tp], r["rank"], tied))
            rows.append(r)
    total_s = time.perf_counter() - t_all

    add_ratios(rows, ckpt_bytes)
    print_rows(args, model_dir, rows, ckpt_bytes)
    by_tp: dict[int, list[dict]] = {}
    for r in rows:
        by_tp.setdefault(r["tp"], []).append(r)
    print_ratios(by_tp, ckpt_bytes)
    print("# verdict")
    verdict = [verdict_line(r) for rs in by_tp.values() for r in rs]
    for line in verdict:
        print(line)
    print(f"# total {total_s:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            preset=args.preset, dtype=args.dtype, checkpoint=str(model_dir), checkpoint_bytes=ckpt_bytes,
            page_bytes=PAGE, interval_ms=args.interval_ms, rows=rows, verdict=verdict, total_s=total_s,
        ), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
