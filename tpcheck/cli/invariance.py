"""``tpcheck invariance``: the same probe request through impl under two or more schedules, every captured point
compared bit for bit, the first point where they part named with its ulps and how the difference grows after
(``tpcheck.pipeline.invariance``).

    tpcheck invariance --preset tiny --batch 1,8                   # alone vs beside 7 others: report, exit 0
    tpcheck invariance --preset tiny --batch 1,4,16 --batch-invariant --require bitwise   # a gate: exit 1 at a break
    tpcheck invariance --preset tiny --tp 1,2 --prefix-cache --chunk 5 --json inv.json
    tpcheck invariance --dumps runs/alone runs/batched --require bitwise   # any engine's dumps of the same requests
"""
from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path

from tpcheck.cli.exit_codes import verdict
from tpcheck.cli.paths import check_output_paths
from tpcheck.inputs.arg_types import int_list, name_list, regex

DTYPES = ["float32", "bfloat16", "float16"]


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``invariance`` sub-command to a ``tpcheck`` argparse ``subparsers``."""
    p = subparsers.add_parser(
        "invariance", help="the same request under two or more schedules, compared bit for bit point by point",
        description="Run one probe request through impl alone and under other schedules (beside companion prompts "
                    "of other lengths at a batch slot, at another TP size, on a prefix-cache hit, in prefill "
                    "chunks), capture every point of the probe as tpcheck diff does, and compare each schedule with "
                    "the first bit for bit: the first differing point (step, layer, point, token, element), its "
                    "size in ulps of the point's dtype, and how it grows after. Declaring nothing reports (exit 0); "
                    "--require bitwise or --ulps N makes it a gate (exit 1 at the first break). Exit 2 bad input, "
                    "3 the engine failed. --dumps compares two or more dumps of the same requests that any engine "
                    "wrote under its own schedules instead (requests matched by their token ids).")
    p.add_argument("--dumps", type=Path, nargs="+", metavar="DUMP_DIR", default=None,
                   help="compare these dumps (tpcheck diff --dump, the vLLM TPCHECK_DUMP plugin, a DumpWriter) with "
                        "the first, bit for bit, instead of running impl: requests matched by their prompt tokens, "
                        "compared on the positions both computed (takes --points, --require / --ulps, --json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory")
    src.add_argument("--preset", default="tiny", help="synthetic checkpoint when --model is not given (default: tiny)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--tp", type=lambda t: int_list(t, 1), default=[1], help="TP sizes, e.g. 1,2 (default 1)")
    p.add_argument("--batch", type=lambda t: int_list(t, 1), default=None,
                   help="batch sizes: the probe alone (1) or beside b-1 companions (default 1,8)")
    p.add_argument("--slot", type=int, default=None, help="the probe's batch slot (default: the middle one)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="also a prefix-cache hit: the probe starts on another request's KV blocks")
    p.add_argument("--chunk", type=lambda t: int_list(t, 1), default=[],
                   help="also chunked prefills of these sizes, e.g. 4,7")
    p.add_argument("--prompt-len", type=int, default=20, help="the probe's prompt length (default 20)")
    p.add_argument("--decode-steps", type=int, default=4, help="the probe's decode steps (default 4)")
    p.add_argument("--seed", type=int, default=0, help="draws the probe, its decode tokens and the companions")
    p.add_argument("--block-size", type=int, default=16, help="impl's KV-cache block size (default 16)")
    p.add_argument("--points", type=regex, default=None, help="compare only the points this regex fullmatches")
    p.add_argument("--inject", type=name_list, default=[], help="faults to inject (tpcheck faults list)")
    p.add_argument("--inject-layer", type=int, default=None, help="only this decoder layer gets the faults")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run impl in its batch-invariant mode (impl.batch_invariant)")
    gate = p.add_mutually_exclusive_group()
    gate.add_argument("--require", choices=["bitwise"], default=None,
                      help="declare bitwise invariance: exit 1 at the first differing point")
    gate.add_argument("--ulps", type=float, default=None, metavar="N",
                      help="declare invariance within N ulps: exit 1 at the first point past it")
    p.add_argument("--json", type=Path, help="write the verdict, each schedule's first break and growth, every row")
    p.set_defaults(handler=lambda a, argv: check_output_paths(a.json) or run(a, argv))
    return p


def options(a):
    """The ``InvarianceOptions`` of parsed arguments ``a``."""
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.invariance import InvarianceOptions
    engine = DiffOptions(model=None if a.model is None else str(a.model), preset=a.preset, dtype=a.dtype,
                         block_size=a.block_size, points=a.points, inject=tuple(a.inject),
                         inject_layer=a.inject_layer)
    return InvarianceOptions(engine, tps=tuple(a.tp), batches=tuple(a.batch or [1, 8]), slot=a.slot,
                             prefix_cache=a.prefix_cache, chunks=tuple(a.chunk), prompt_len=a.prompt_len,
                             decode_steps=a.decode_steps, seed=a.seed, batch_invariant=a.batch_invariant,
                             ulps=_declared(a))


def _declared(a) -> float | None:
    """The declared invariance: 0 ulps (``--require bitwise``), ``--ulps N``, or None (report only)."""
    if a.ulps is not None and not (math.isfinite(a.ulps) and a.ulps >= 0):
        raise ValueError(f"--ulps must be a finite number >= 0, got {a.ulps}")
    return 0.0 if a.require == "bitwise" else a.ulps


LIVE_ONLY = ("model", "batch", "slot", "prefix_cache", "chunk", "inject", "inject_layer", "batch_invariant")


def refuse_live_flags(a) -> None:
    """``--dumps`` compares what the engine ran: a flag that would choose a schedule or an engine is refused
    (ValueError naming it), never silently ignored."""
    given = [n for n in LIVE_ONLY if getattr(a, n) not in (None, False, [])]
    given += ["tp"] * (a.tp != [1]) + ["preset"] * (a.preset != "tiny") + ["dtype"] * (a.dtype != "float32")
    given += [n for n, d in (("prompt_len", 20), ("decode_steps", 4), ("seed", 0), ("block_size", 16))
              if getattr(a, n) != d]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise ValueError(f"--dumps compares the schedules the engine ran and recorded: {flags} "
                         f"{'does' if len(given) == 1 else 'do'} not apply")


def run(a, argv: list[str]) -> int:
    """Run, print the summary, write ``--json``; exit 0 (held, or nothing declared), 1 (a declared invariance
    broke)."""
    from tpcheck.pipeline.invariance import run as run_invariance
    if a.dumps is not None:
        from tpcheck.pipeline.invariance_dumps import run_dumps
        refuse_live_flags(a)
        r = run_dumps(a.dumps, _declared(a), a.points)
    else:
        r = run_invariance(options(a))
    print(r.summary())
    if a.json:
        r.to_json(a.json, command=shlex.join(["tpcheck", *argv]))
        print(f"wrote {a.json}")
    return verdict(r.passed)
