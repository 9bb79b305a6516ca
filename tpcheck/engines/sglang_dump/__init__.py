"""Dumps written by SGLang's dumper (and vLLM's and Megatron's ports of it), read into tpcheck's dump model and
judged by ``tpcheck compare --format sglang DUMP_DIR --model CKPT`` exactly as tpcheck's own dumps are.

    files.py     one file: its ``key=value___...pt`` name parsed, its contents loaded safely (weights_only)
    dims.py      the dims annotation (``t h[tp]``, ``s[cp:zigzag]``, ``h[tp:partial]``; older ``h(tp)``)
    assemble.py  one point of one step from every rank's file: non-tp axes unsharded, tp as a placement
    rules.py     dumped names -> canonical points (``rules.toml`` shipped; ``--name-rules FILE`` extends it)
    batches.py   each step's requests from the auxiliary ``input_ids`` / ``positions`` / ``seq_lens`` dumps
    reader.py    ``read_sglang_dump``: all of it as a ``tpcheck.engines.dump.replay.Dump``
    writer.py    the format written from a tpcheck dump (tests, demos)

User guide: docs/sglang.md."""
from __future__ import annotations

import re
from pathlib import Path

FORMATS = ("auto", "tpcheck", "sglang")
_TPCHECK_DIR = re.compile(r"(rank|stage)\d+")
_OLD_LAYOUT = re.compile(r"TP\d+_PP\d+_Rank\d+_pid\d+")


def sniff_format(root: str | Path) -> str:
    """``"tpcheck"`` (``rank{r}/`` or ``stage{s}/`` directories), ``"sglang"`` (``key=value___...pt`` files, here
    or in one experiment directory below), ``"sglang-passes"`` (SGLang's older
    ``TP{t}_PP{p}_Rank{r}_pid{pid}/Pass{n}.pt`` forward-hook dumps), else ``"tpcheck"`` (whose reader then says
    what is missing)."""
    root = Path(root)
    if not root.is_dir():
        return "tpcheck"
    entries = list(root.iterdir())
    if any(d.is_dir() and _TPCHECK_DIR.fullmatch(d.name) for d in entries):
        return "tpcheck"
    if any(d.is_dir() and _OLD_LAYOUT.fullmatch(d.name) for d in entries):
        return "sglang-passes"
    if any(p.suffix == ".pt" and "=" in p.stem for p in entries):
        return "sglang"
    if any(d.is_dir() and any(p.suffix == ".pt" and "=" in p.stem for p in d.iterdir()) for d in entries):
        return "sglang"
    return "tpcheck"
