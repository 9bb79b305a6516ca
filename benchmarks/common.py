"""What the benchmark scripts share: progress logs, the checkpoint options and their resolution, /proc readers
(memory from ``/proc/<pid>/status``, CPU time from ``/proc/<pid>/stat``), a polling thread for peaks, and
the table printer. Prompts come from ``tpcheck.pipeline.check.random_prompts``.

Each script puts its own folder first on ``sys.path`` before ``from common import ...``, so this module is
found however the script is run (``python benchmarks/X.py``, or ``runpy.run_path``)."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def make_log(name: str):
    """``log(msg)``: one time-stamped progress line on stderr, prefixed with the benchmark's name."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


# ---- checkpoint options ----------------------------------------------------------------------------------
def add_checkpoint_args(ap, seed_help: str = "checkpoint seed") -> None:
    """``--preset`` (default qwen2.5-0.5b), ``--ckpt-dir``, ``--cache-root``, ``--seed``."""
    from tpcheck.inputs.models.checkpoints import preset_names
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=preset_names(), help="checkpoint preset")
    ap.add_argument("--ckpt-dir", help="checkpoint directory to reuse (written there once if missing/empty)")
    ap.add_argument("--cache-root", help="cache root for the preset checkpoint (default $TPCHECK_CACHE or "
                                         "~/.cache/tpcheck/checkpoints)")
    ap.add_argument("--seed", type=int, default=0, help=seed_help)


def add_variants_arg(ap) -> None:
    """``--variants``: impl patched to round otherwise than Hugging Face (``tpcheck.engines.impl.variants``)."""
    ap.add_argument("--variants", default="", help="impl only: correct variants patched into its ranks for every "
                    "run (tpcheck.engines.impl.variants, comma-separated: rank_order_allreduce, sequential_k)")


def check_variants_arg(ap, args) -> list[str]:
    """``args.variants`` as a list, refused (exit 2) for another engine than impl or a variant that is not judged
    as rounding to nearest."""
    from tpcheck.engines.impl.variants import ROUND_TO_NEAREST  # tpcheck: loaded once a script uses the option
    names = [v for v in args.variants.split(",") if v]
    if names and args.engine != "impl":
        ap.error("--variants patches impl's ranks: --engine impl only")
    if unknown := sorted(set(names) - set(ROUND_TO_NEAREST)):  # judged as rounding to nearest
        ap.error(f"--variants: {unknown} not one of {', '.join(ROUND_TO_NEAREST)}")
    return names


def add_json_arg(ap) -> None:
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def check_json_arg(ap, args) -> None:
    """``ap.error`` before any work when ``--json``'s directory does not exist."""
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: directory {Path(args.json).resolve().parent} does not exist")


def resolve_checkpoint(ap, args, log, dtype: str = "float32") -> Path:
    """The checkpoint of ``--ckpt-dir`` / ``--preset`` (``tpcheck.inputs.models.checkpoints.resolve_checkpoint``: written once
    on first use); a bad ``--ckpt-dir`` is ``ap.error``."""
    from tpcheck.inputs.models.checkpoints import resolve_checkpoint as resolve
    t0 = time.perf_counter()
    log(f"checkpoint {args.ckpt_dir or args.preset} (written once on first use, ~15 s for qwen2.5-0.5b) ...")
    try:
        d = resolve(args.preset, seed=args.seed, dtype=dtype, ckpt_dir=args.ckpt_dir, root=args.cache_root)
    except (FileExistsError, NotADirectoryError, ValueError) as e:
        ap.error(f"--ckpt-dir: {e}")
    log(f"checkpoint at {d} ({time.perf_counter() - t0:.1f}s)")
    return d


# ---- /proc ---------------------------------------------------------------------------------------------
def read_status(pid: int | str = "self", keys=STATUS_KEYS) -> dict[str, int]:
    """The memory lines ``keys`` of ``/proc/<pid>/status`` in bytes (missing keys are absent)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                out[key] = int(rest.split()[0]) * 1024  # kB
    return out


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` plus all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            total += read_status(p, ("VmRSS",)).get("VmRSS", 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime) of ``pid`` plus all its live descendants (TP workers): on a shared machine a
    side's CPU time moves far less than its wall time when other jobs take the cores."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            total += proc_cpu_s(p)
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Poller(threading.Thread):
    """Calls ``sample()`` every ``interval_s`` from when it starts until ``stop()``, which samples once more;
    as a context manager, for the ``with`` block."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self._stop_evt = threading.Event()

    def sample(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.sample()
            self._stop_evt.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()
        self.sample()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class PeakRSS(Poller):
    """The peak summed RSS (``peak``, bytes) of this process and its descendants (TP workers) while it runs."""

    def __init__(self, interval_s: float = 0.02):
        super().__init__(interval_s)
        self.peak = tree_rss_bytes(os.getpid())

    def sample(self) -> None:
        self.peak = max(self.peak, tree_rss_bytes(os.getpid()))


# ---- output --------------------------------------------------------------------------------------------
def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Right-aligned columns two spaces apart, each as wide as its widest cell."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    for line in (header, *rows):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


# ---- dumps -----------------------------------------------------------------------------------------------
def dir_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (a dump: every rank's files)."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def kinds_of(cfg) -> dict[str, list[str]]:
    """The model's point kinds (``tpcheck.capture.points.kind_of``) and each kind's points, in execution order."""
    from tpcheck.capture.points import kind_of, model_point_names
    out: dict[str, list[str]] = {}
    for name in model_point_names(cfg, False):
        out.setdefault(kind_of(name).name, []).append(name)
    return out
