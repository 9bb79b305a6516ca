"""The impl runs the SGLang-format tests write in SGLang's layout, and ``tpcheck compare`` of a dump as JSON."""
import json

import tpcheck
from tpcheck.cli.app import main

PROMPTS = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]


def tp2_dumps(root, d, engines, fault: str, **options) -> None:
    """impl at tp 2, ``PROMPTS``, 2 decode steps: tpcheck's dumps ``root/clean`` and ``root/fault`` (``fault``
    injected in the ranks)."""
    for name, inject in (("clean", []), ("fault", [fault])):
        tpcheck.diff(model=d, tp=2, prompts=PROMPTS, decode_steps=2, inject=inject, pool=engines,
                     dump=str(root / name), **options)


def compare(dump, d, out, *extra) -> tuple[int, dict]:
    """``tpcheck compare DUMP --model D --json OUT``: its exit code and its JSON."""
    rc = main(["compare", str(dump), "--model", str(d), "--json", str(out), *extra])
    return rc, json.loads(out.read_text())
