"""The live local pass of ``--engine vllm`` against its propagated pass alone, with depth: each vLLM fault
(``tpcheck.engines.vllm.worker.VLLM_FAULTS``) seeded inside rank 1 at one decoder layer (the first, the middle, the
last), one diff with both passes (the local pass is on by default), one vLLM started for all of them, after a
clean run (its origin, how many rows failed and of which kinds). Per faulty run: the
origin found, and the excess at the fault's own point in the local pass and in the propagated pass (what the
verdict was before the local pass). In bfloat16 on a CPU whose vLLM kernels truncate to bfloat16, the origin is
that truncation (``layers.0.attn.q_rope`` by the gain: README "A dump's local pass"); the fault's point is read
apart from it, and so is the first failure past the truncation-like gains (``past_truncation``).

With ``--dump``, each run also writes its dump (``tpcheck diff --dump``'s wrapper) and ``tpcheck compare``'s
default verdict on it is reported beside the live one: the dump's origin and the excess at the fault's point in the
dump's local pass (the golden forced onto the engine's recorded inputs).

    .venv-vllm/bin/python benchmarks/vllm_local_pass.py [--preset deep-sink] [--tp 2] [--dtype bfloat16]
        [--faults o-proj-partial,down-proj-partial,...] [--layers 0,12,23] [--dump]
    .venv-vllm/bin/python benchmarks/vllm_local_pass.py --model ~/.cache/tpcheck/gemma-3-270m --layers 9 \
        --prompt-text "The capital of France is a city of many bridges"   # the trained checkpoint, real text
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import make_log, print_table  # noqa: E402
from dump_local_pass import compare_dump, excess_at, origin  # noqa: E402

from tpcheck.engines.dump.dumping import DumpingAdapter  # noqa: E402

from tpcheck.engines.pool import EnginePool  # noqa: E402
from tpcheck.engines.vllm.adapter import start  # noqa: E402
from tpcheck.inputs.models.checkpoints import cached_checkpoint  # noqa: E402
from tpcheck.options import DiffOptions  # noqa: E402
from tpcheck.pipeline.diff import compare  # noqa: E402
from tpcheck.pipeline.plan import RunPlan  # noqa: E402
from tpcheck.result.meta import RunOrigin  # noqa: E402
from tpcheck.result.origin import truncation_like  # noqa: E402

log = make_log("vllm_local_pass")
PROMPT = [[3, 9, 27, 81, 5, 15, 45, 11, 33, 99, 7, 21]]  # 12 tokens, the depth matrix's first prompt
POINT = {"o-proj-partial": "attn.out", "down-proj-partial": "mlp.out", "qkv-head-swap": "attn.q",
         "k-rope-shift": "attn.k_rope", "gate-up-up-zero": "mlp.up"}  # where each fault first shows


def past_truncation(r, dtype: str) -> str:
    """The first failing row (by step, then execution order) that did not fail by a truncation-like gain alone
    (``tpcheck.result.origin.truncation_like``): where the fault shows past vLLM's bfloat16 truncation. Reporting
    only: the verdict's origin is the first failing row of any kind."""
    t = r.table
    alone = (t["rel_err"] <= t["threshold"]) & \
        pd.Series([truncation_like(g, dtype, se) for g, se in zip(t["gain"], t["gain_se"])], index=t.index)
    bad = t[~t["passed"] & ~alone].sort_values(["step", "order"])
    return "-" if bad.empty else f"{bad.iloc[0]['point']} ({bad.iloc[0]['mode']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deep-sink")
    ap.add_argument("--model", help="a checkpoint directory instead of --preset (e.g. the public Gemma 3 270M)")
    ap.add_argument("--prompt-text", help="the prompt as text, tokenized by --model's tokenizer (bos first), "
                                          "instead of the fixed 12 token ids")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--faults", default=",".join(POINT))
    ap.add_argument("--layers", default="0,12,23")
    ap.add_argument("--dump", action="store_true", help="also dump each run and judge the dump as tpcheck compare")
    a = ap.parse_args()
    model = str(Path(a.model).expanduser()) if a.model else str(cached_checkpoint(a.preset))
    prompts = PROMPT
    if a.prompt_text:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
        prompts = [[tok.bos_token_id] + tok.encode(a.prompt_text, add_special_tokens=False)]
    opts = DiffOptions.of(model=model, tp=a.tp, dtype=a.dtype, prompts=prompts, isolate=True)  # both passes, always
    pool = EnginePool()
    rows, tmp = [], tempfile.TemporaryDirectory(prefix="vllm-local-pass-")

    def diff(adapter, name: str, point: str | None):
        """The live result, and with --dump the dump's columns: its origin and its local excess at ``point``."""
        if not a.dump:
            return compare(adapter, opts, origin=RunOrigin(tp=a.tp, engine="vllm", command="vllm_local_pass")), []
        d = Path(tmp.name) / name
        wrapper = DumpingAdapter(adapter, d, a.dtype, "vllm", model=model)
        r = compare(wrapper, opts, origin=RunOrigin(tp=a.tp, engine="vllm", command="vllm_local_pass"))
        for w in wrapper.writers:  # every queued step on disk before it is read
            w.close()
        dumped, _, _ = compare_dump(d, model, a.dtype, a.tp, None)
        return r, [origin(dumped), "-" if point is None else f"{excess_at(dumped, point, 'isolated'):.3g}"]

    try:
        adapter = start(pool, RunPlan.of(opts))
        clean, extra = diff(adapter, "clean", None)
        bad = clean.table[~clean.table["passed"]]
        rows.append(["(none)", "-", origin(clean), past_truncation(clean, a.dtype), f"{len(bad)} rows failed",
                     ", ".join(sorted(set(bad["kind"])))] + extra)
        log(f"clean: {rows[-1][2:]}")
        for fault in a.faults.split(","):
            for layer in [int(x) for x in a.layers.split(",")]:
                t0 = time.monotonic()
                adapter.faults = [(fault, layer, 1)]
                point = f"layers.{layer}.{POINT[fault]}"
                r, extra = diff(adapter, f"{fault}-{layer}", point)
                rows.append([fault, str(layer), origin(r), past_truncation(r, a.dtype),
                             f"{excess_at(r, point, 'isolated'):.3g}", f"{excess_at(r, point, 'propagated'):.3g}"]
                            + extra)
                log(f"{fault} layer {layer}: {rows[-1][2:]} ({time.monotonic() - t0:.0f} s)")
        adapter.faults = []
    finally:
        pool.close()
        tmp.cleanup()
    print(f"{a.model or a.preset} tp {a.tp} {a.dtype}, one prompt of {len(prompts[0])} tokens, prefill; fault inside "
          "rank 1")
    print_table(["fault", "layer", "origin", "past truncation", "local excess", "propagated excess"]
                + (["dump origin", "dump local excess"] if a.dump else []), rows)


if __name__ == "__main__":
    main()
