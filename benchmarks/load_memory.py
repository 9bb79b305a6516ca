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
import os
import struct
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def log(msg: str) -> None:
    print(f"[load_memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- /proc sampling -------------------------------------------------------------------------------------
def read_status(pid: int) -> dict[str, int]:
    """The memory lines of ``/proc/<pid>/status`` in bytes (missing keys are absent)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(rest.split()[0]) * 1024  # kB
    return out


def reset_hwm(pid: int) -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/pid/clear_refs``); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Polls the status of some pids; keeps the per-pid maximum of each key."""

    def __init__(self, pids: list[int], interval_s: float):
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.peak = {p: {} for p in pids}
        self.samples = 0
        self._stop_evt = threading.Event()

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

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.sample()
            self._stop_evt.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()
        self.sample()


# ---- checkpoint ------------------------------------------------------------------------------------------
def resolve_checkpoint(args) -> Path:
    from tpcheck.checkpoints import resolve_checkpoint as resolve
    t0 = time.perf_counter()
    log(f"checkpoint {args.ckpt_dir or args.preset} (written once on first use, ~15 s for qwen2.5-0.5b) ...")
    d = resolve(args.preset, seed=args.seed, dtype=args.dtype, ckpt_dir=args.ckpt_dir, root=args.cache_root)
    log(f"checkpoint at {d} ({time.perf_counter() - t0:.1f}s)")
    return d


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


def _pad_vocab(v: int, tp: int) -> int:  # vLLM: round up to 64, then to a multiple of tp
    vp = -(-v // 64) * 64
    return -(-vp // tp) * tp


def rank_plan(name: str, shape: list[int], tp: int, rank: int, cfg: dict):
    """How rank ``rank`` reads tensor ``name``: (kind, dim, start, length, local_bytes_factor) or None.

    kind: 'shard' (split over tp), 'replicate' (every rank reads all), 'kv' (KV heads: split or replicated)."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = _pad_vocab(shape[0], tp) // tp
        start = rank * rows
        return "shard", 0, start, max(0, min(start + rows, shape[0]) - start), rows
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        cols = shape[1] // tp
        return "shard", 1, rank * cols, cols, shape[0]
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        rows = shape[0] // tp
        return "shard", 0, rank * rows, rows, rows
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        k = cfg["num_key_value_heads"]
        if tp <= k:
            rows = shape[0] // tp
            return "kv", 0, rank * rows, rows, rows
        rows = shape[0] // k
        return "kv", 0, (rank // (tp // k)) * rows, rows, rows
    return "replicate", 0, 0, shape[0], shape[0]


def expected_share(model_dir: Path, tp: int, rank: int) -> dict:
    """Bytes rank ``rank`` should hold, and the file pages its slice reads touch, from the headers alone."""
    import numpy as np
    cfg = json.loads((model_dir / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", False)
    total = sharded = replicated = held = 0
    pages_touched = 0
    rowpar_full = 0
    for f, base, header in safetensors_headers(model_dir):
        touched = []
        for name, meta in header.items():
            item = ITEMSIZE[meta["dtype"]]
            shape = meta["shape"]
            nbytes = item * int(np.prod(shape)) if shape else item
            total += nbytes
            if (tied and name == "lm_head.weight") or name.endswith(".rotary_emb.inv_freq"):
                continue
            kind, dim, start, length, local_rows = rank_plan(name, shape, tp, rank, cfg)
            row_bytes = item * int(np.prod(shape[1:])) if len(shape) > 1 else item
            if kind == "replicate":
                replicated += nbytes
                held += nbytes
            else:
                sharded += nbytes
                # bytes of the rank's parameter: dim 0 splits hold local_rows rows; dim 1 splits hold all rows
                held += local_rows * row_bytes if dim == 0 else shape[0] * length * item
            lo = base + meta["data_offsets"][0]
            if dim == 0 or len(shape) == 1:
                a, b = lo + start * row_bytes, lo + (start + length) * row_bytes
                if b > a:
                    touched.append(np.arange(a // PAGE, (b - 1) // PAGE + 1))
            else:  # a column slice: `length` items out of every row
                rowstarts = lo + np.arange(shape[0], dtype=np.int64) * row_bytes + start * item
                first, last = rowstarts // PAGE, (rowstarts + length * item - 1) // PAGE
                span = int((last - first).max()) + 1
                pages = (first[:, None] + np.arange(span)[None, :])
                touched.append(pages[pages <= last[:, None]])
                rowpar_full += nbytes
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
        sampler = Sampler(pids, interval_s)
        sampler.start()
        t1 = time.perf_counter()
        try:
            ex.call("_load", str(model_dir), dtype, "cpu")
        finally:
            sampler.stop()
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




def main(argv=None) -> int:
    from tpcheck.cli import positive_ints
    from tpcheck.checkpoints import preset_names
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=preset_names(), help="checkpoint preset")
    ap.add_argument("--tp", type=positive_ints, default=[1, 2], help="TP sizes, comma-separated (default 1,2)")
    ap.add_argument("--ckpt-dir", help="checkpoint directory to reuse (written there once if missing/empty)")
    ap.add_argument("--cache-root", help="cache root for the preset checkpoint (default $TPCHECK_CACHE or "
                                         "~/.cache/tpcheck/checkpoints)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="checkpoint dtype, also the load dtype")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="/proc polling interval (default 20)")
    ap.add_argument("--kv-blocks", type=int, default=1,
                    help="KV blocks allocated after the load, as LLM(num_kv_blocks=...) would (default 1; 0: none)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.interval_ms <= 0:
        ap.error("--interval-ms must be > 0")
    if args.kv_blocks < 0:
        ap.error("--kv-blocks must be >= 0")
    if not Path("/proc/self/status").is_file():
        ap.error("needs Linux /proc")
    if args.json:
        jp = Path(args.json)
        if jp.parent and not jp.parent.exists():
            ap.error(f"--json: directory {jp.parent} does not exist")

    try:
        model_dir = resolve_checkpoint(args)
    except (FileExistsError, NotADirectoryError, ValueError) as e:
        ap.error(f"--ckpt-dir: {e}")
    from impl.config import load_config
    cfg = load_config(model_dir)
    for tp in args.tp:
        try:
            cfg.check_tp(tp)
        except ValueError as e:
            ap.error(f"--tp {tp}: {e}")
    ckpt_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    t_all = time.perf_counter()
    rows = []
    for tp in args.tp:
        for r in measure(model_dir, tp, args.dtype, args.interval_ms / 1000, args.kv_blocks, 16):
            r.update(expected_share(model_dir, tp, r["rank"]))
            rows.append(r)
    total_s = time.perf_counter() - t_all

    # ---- report -------------------------------------------------------------------------------------
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
    table = []
    for r in rows:
        growth = r["peak_rss"] - r["base_rss"]
        anon_growth = r["peak_anon"] - r["base_anon"]
        r.update(growth=growth, growth_over_ckpt=growth / ckpt_bytes, final_growth=r["final_rss"] - r["base_rss"],
                 anon_growth=anon_growth, anon_growth_over_ckpt=anon_growth / ckpt_bytes,
                 file_growth=r["peak_file"] - r["base_file"], ckpt_file_bytes=ckpt_bytes)
        table.append([str(r["tp"]), str(r["rank"]), m(r["base_rss"]), m(r["peak_rss"]), m(growth),
                      f"{growth / ckpt_bytes:.3f}", m(r["final_rss"]), m(r["final_growth"]),
                      m(r["expected_param_bytes"]), m(r["param_bytes"]), m(r["peak_anon"]), m(anon_growth),
                      f"{anon_growth / ckpt_bytes:.3f}", m(r["peak_file"]), m(r["file_growth"]),
                      m(r["predicted_file_pages_bytes"]), f"{r['load_s']:.1f}"])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(hdr)]
    print("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths)))
    print()

    # ---- ratios and verdict ---------------------------------------------------------------------------
    print("# ratios")
    by_tp = {}
    for r in rows:
        by_tp.setdefault(r["tp"], []).append(r)
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
    print("# verdict")
    verdict = []
    for tp, rs in by_tp.items():
        for r in rs:
            exp = r["expected_param_bytes"]
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
            print(line)
            verdict.append(line)
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
