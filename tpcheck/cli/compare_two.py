"""``tpcheck compare BASELINE TARGET``: two dumps, each judged against the golden (``--model``), else compared
with each other (``tpcheck.engines.sglang_dump.pair``: both sides' unit roundoff as the floor)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_args(cp) -> None:
    """``compare``'s second dump and the options of other tools' dump formats."""
    cp.add_argument("target", type=Path, nargs="?", metavar="TARGET", help="a second dump: the two compared (no "
                    "--model; docs/sglang.md), or each judged against the golden")
    cp.add_argument("--format", choices=["auto", "tpcheck", "sglang"], default="auto",
                    help="the dump's format: tpcheck's, or SGLang's (its dumper's files, vLLM's and Megatron's ports "
                         "too, or its older forward-hook Pass files: docs/sglang.md); auto: told from the files "
                         "(default)")
    cp.add_argument("--name-rules", type=Path, action="append", default=[], metavar="FILE.toml",
                    help="--format sglang: rules mapping dumped names to points, before the shipped ones")
    cp.add_argument("--allow-unmapped", action="store_true", help="--format sglang: list the names no rule maps "
                    "and compare the rest (default: exit 2)")


def run(a, argv: list[str], compare_one) -> int:
    """Two dumps: each judged against the golden (--model, the worse exit code), else one against the other."""
    if a.model is not None:
        codes = []
        for which, d in (("baseline", a.dump_dir), ("target", a.target)):
            print(f"==== {which}: {d}")
            one = argparse.Namespace(**{**vars(a), "dump_dir": d, "target": None})
            one.json, one.csv, one.parquet, one.html = (_suffixed(p, which) for p in (a.json, a.csv, a.parquet, a.html))
            codes.append(compare_one(one, argv))
        print(f"\nbaseline: exit {codes[0]}; target: exit {codes[1]}")
        return max(codes)
    from tpcheck.engines.sglang_dump import pair  # torch and the readers: loaded when a command runs, not at --help
    if any(x is not None for x in (a.json, a.csv, a.parquet, a.html)):
        raise ValueError("two dumps without --model: the report is printed (no --json, --csv, --parquet, --html)")
    base, target = (pair.read_side(d, a.name_rules, a.allow_unmapped) for d in (a.dump_dir, a.target))
    text, code = pair.report(pair.compare_sides(base, target), base, target)
    print(text)
    return code


def _suffixed(path: Path | None, which: str) -> Path | None:
    """``out.json`` -> ``out.baseline.json``: each side's outputs beside the other's."""
    return None if path is None else path.with_name(f"{path.stem}.{which}{path.suffix}")
