"""``torchrun -m tpcheck.engines.hf_tp``: Hugging Face TP ranks that greedy-decode prompts and dump their points
(``tpcheck.capture.dump``), any number of nodes; then ``tpcheck compare DIR --model CKPT``."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from impl.config import load_config
from impl.distributed import close_tp, init_tp
from impl.env import env_number
from tpcheck.capture.dump import DumpWriter
from tpcheck.engines.hf_tp.adapter import check_layout
from tpcheck.engines.hf_tp.ranks import HFTPRank, greedy_dump
from tpcheck.inputs.arg_types import int_list


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: load with tp_plan, greedy-decode the prompts, dump every step."""
    ap = argparse.ArgumentParser(prog="torchrun ... -m tpcheck.engines.hf_tp",
                                 description="one rank of Hugging Face tp_plan, dumping its points per step "
                                             "(then: tpcheck compare DIR --model CKPT)")
    ap.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    ap.add_argument("--dump", required=True, help="dump directory (shared by every rank; new or empty)")
    ap.add_argument("--prompt-ids", type=int_list, action="append", required=True, metavar="IDS",
                    help="comma-separated token ids; repeat for more prompts")
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        ap.error("run under torchrun (WORLD_SIZE is not set); for a single process use tpcheck diff --engine hf-tp")
    tp = env_number("WORLD_SIZE", integer=True, minimum=1)
    check_layout(load_config(a.model), tp)
    init_tp(env_number("RANK", integer=True), tp, None, device=a.device)
    try:
        rank = HFTPRank(a.model, a.dtype, a.device)
        writer = DumpWriter(a.dump, rank.rank, tp, a.dtype, "hf-tp", model=a.model)
        out = greedy_dump(rank, a.prompt_ids, a.decode_steps, writer)
        if rank.rank == 0:
            print(f"dumped {a.decode_steps + 1} step(s) of {tp} rank(s) to {a.dump}; generated {out}")
    finally:
        close_tp()
    return 0


if __name__ == "__main__":
    sys.exit(main())
