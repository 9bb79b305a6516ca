"""Seeded faults found through SGLang's dump formats as through tpcheck's own dump of the same run.

impl serves a continuous batch of staggered requests (4 prompts of 5, 11, 3 and 8 tokens, 6/3/8/5 new tokens, at
most 3 running: requests join at later steps) at each tp, clean and with each seeded fault, dumped by tpcheck
(``tpcheck.engines.impl.generate_dumped``); each dump is written again in SGLang's dumper layout and in its older
forward-hook layout (``tpcheck.engines.sglang_dump.writer``), and the three are judged by ``tpcheck compare``. Per
run: the verdict, the first divergence (step and point) and its excess through each format. A clean run must pass
in all three; a fault must be found at the same point and step with the same excess.

    python benchmarks/sglang_dump_faults.py [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import add_json_arg, check_json_arg, make_log  # noqa: E402

CASES = (("tiny", 2, ("skip_o_proj_allreduce", "decode_position_off_by_one")),
         ("tiny", 4, ("skip_o_proj_allreduce", "decode_position_off_by_one")),
         ("tiny-qwen2-moe", 2, ("moe_experts_reduced_twice", "moe_shared_gate_reduced")),
         ("tiny-qwen2-moe", 4, ("moe_experts_reduced_twice", "moe_shared_gate_reduced")))
PROMPT_LENS, NEW_TOKENS = (5, 11, 3, 8), (6, 3, 8, 5)


def _judge(dump: Path, ckpt: Path, out: Path) -> dict:
    """``tpcheck compare`` of one dump: exit code, first divergence (step, point) and its excess."""
    from tpcheck.cli.app import main
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["compare", str(dump), "--model", str(ckpt), "--no-isolate", "--json", str(out)])
    fd = json.loads(out.read_text())["first_divergence"] if rc in (0, 1) else None
    return {"rc": rc, "origin": None if fd is None else f"{fd['point']} (step {fd['step']})",
            "excess": None if fd is None else fd["excess"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_arg(ap)
    a = ap.parse_args()
    check_json_arg(ap, a)
    log = make_log("sglang_dump_faults")
    from impl import LLM, CacheConfig, SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped
    from tpcheck.engines.sglang_dump.writer import FileSink, PassSink, passes_rules, write_from_dump
    from tpcheck.engines.impl import faults
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    prompts = [[(7 * k + t) % 200 + 3 for t in range(n)] for k, n in enumerate(PROMPT_LENS)]
    params = [SamplingParams(max_tokens=m) for m in NEW_TOKENS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset, tp, fault_names in CASES:
            ckpt = cached_checkpoint(preset)
            for fault in (None, *fault_names):
                log(f"{preset} tp {tp} {fault or 'clean'} ...")
                base = Path(tmp) / f"{preset}-{tp}-{fault or 'clean'}"
                with LLM(str(ckpt), tp_size=tp, block_size=4, num_kv_blocks=64,
                         cache=CacheConfig(max_num_seqs=3)) as llm:
                    if fault:
                        llm.call(faults.apply, [fault])
                    generate_dumped(llm, prompts, params, base / "tpcheck")
                write_from_dump(base / "tpcheck", str(ckpt), FileSink(base / "dumper", tp))
                write_from_dump(base / "tpcheck", str(ckpt), PassSink(base / "passes", tp), "none",
                                rules=passes_rules())
                row = {"preset": preset, "tp": tp, "fault": fault or "none (clean)"}
                for fmt in ("tpcheck", "dumper", "passes"):
                    row[fmt] = _judge(base / fmt, ckpt, base / f"{fmt}.json")
                rows.append(row)
                log("  " + "; ".join(f"{f}: rc {row[f]['rc']} {row[f]['origin']} {row[f]['excess']}"
                                     for f in ("tpcheck", "dumper", "passes")))
    print("| model | tp | fault | origin (tpcheck dump) | excess via tpcheck dump | via SGLang dumper files | "
          "via SGLang Pass files |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda j: "PASS" if j["rc"] == 0 else f"{j['excess']:.3g}x at {j['origin']}" if j["rc"] == 1 \
        else f"exit {j['rc']}"  # noqa: E731
    for r in rows:
        print(f"| {r['preset']} | {r['tp']} | {r['fault']} | {r['tpcheck']['origin'] or '-'} | {fmt(r['tpcheck'])} | "
              f"{fmt(r['dumper'])} | {fmt(r['passes'])} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
