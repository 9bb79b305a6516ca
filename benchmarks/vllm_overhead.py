"""vLLM under tpcheck: time to verdict of ``tpcheck diff --engine vllm`` vs ``--engine impl`` on the same preset,
and vLLM's generate throughput with the ``TPCHECK_DUMP`` plugin off, on (every point) and on with a
``TPCHECK_DUMP_POINTS`` selection, each written off the step (the default) and inside it
(``TPCHECK_DUMP_QUEUE_MB=0``): until ``generate`` returns, and until the last file is on disk. Runs in vLLM's own environment (``docs/vllm.md``)::

    .venv-vllm/bin/python benchmarks/vllm_overhead.py [--preset small-hd32] [--repeats 3] [--tokens 32]
    .venv-vllm/bin/python benchmarks/vllm_overhead.py --per-kind    # each point kind dumped alone
    .venv-vllm/bin/python benchmarks/vllm_overhead.py --verdict-only --preset small-gemma3   # time to verdict alone

Every measurement is a fresh process (vLLM's start is in the time to verdict, not in the throughput: a
warm-up ``generate`` runs before the timed one), the variants interleaved so a load change on the machine hits
them alike; each figure is the median with the min..max over the repeats."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dir_bytes, kinds_of, make_log, print_table  # noqa: E402

log = make_log("vllm_overhead")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

GENERATE = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    ckpt, tp, n, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    llm = LLM(model=ckpt, tensor_parallel_size=tp, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=512, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * b + 3 * j) % 200 + 3 for j in range(seq)]) for b in range(batch)]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0

    def flush(worker):  # a dump's files are written off the step: wait until the last one is on disk
        dump = getattr(worker, "_tpcheck_dump", None)
        if dump is not None:
            dump.cap.writer.flush()
    llm.collective_rpc(flush)
    written = time.perf_counter() - t0
    print("RESULT", json.dumps({"s": dt, "written": written, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
    """)


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


def time_to_verdict(ckpt: Path, engine: str, tp: int, steps: int, seq: int) -> float:
    cmd = [sys.executable, "-m", "tpcheck", "diff", "--engine", engine, "--model", str(ckpt), "--tp", str(tp),
           "--decode-steps", str(steps), "--seq-len", str(seq), "--quiet"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **ENV))
    dt = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {run.returncode}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return dt


def generate(ckpt: Path, tp: int, tokens: int, batch: int, seq: int, dump: str | None,
             points: str | None) -> tuple[float, float]:
    """Generated tokens per second of one fresh vLLM process (dump: the TPCHECK_DUMP directory, or None): until
    ``generate`` returns, and until the dump's last file is written (its writer threads flushed)."""
    r = generate_run(ckpt, tp, tokens, batch, seq, dump, points)
    return r["tokens"] / r["s"], r["tokens"] / r["written"]


def generate_run(ckpt: Path, tp: int, tokens: int, batch: int, seq: int, dump: str | None,
                 points: str | None) -> dict:
    """``generate``'s one fresh vLLM process: ``{"s": until generate returns, "written": until the last file is
    written, "tokens": generated}``."""
    env = dict(os.environ, **ENV)
    env.pop("TPCHECK_DUMP", None)
    if dump is not None:
        env["TPCHECK_DUMP"] = dump
    if points is not None:
        env["TPCHECK_DUMP_POINTS"] = points
    run = subprocess.run([sys.executable, "-c", GENERATE, str(ckpt), str(tp), str(tokens), str(batch), str(seq)],
                         capture_output=True, text=True, env=env)
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode != 0 or not line:
        raise SystemExit(f"generate (dump={dump}): exit {run.returncode}\n{run.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def per_kind(a, ckpt: Path) -> None:
    """Each point kind dumped alone (``TPCHECK_DUMP_POINTS``: that kind's points of the model), one fresh process
    per run, the kinds and the dump off interleaved: bytes per token per layer (every rank's files over the positions
    the requests ran, ``batch x (seq + tokens - 1)``, and the layers that have the kind; the logits are the sampled
    rows only, so theirs is per position run, not per row written) and the time per hook per step ((seconds until
    written - the dump off's) / steps / the kind's hooks; ranks hook in parallel)."""
    import re
    import shutil
    from impl.config import load_config
    kinds = kinds_of(load_config(ckpt))
    secs: dict[str, list[float]] = {k: [] for k in ["off", *kinds]}
    size: dict[str, int] = {}
    os.environ["TPCHECK_DUMP_QUEUE_MB"] = "256"
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for kind in secs:
                dump = None if kind == "off" else f"{tmp}/{r}-{kind}"
                pts = None if kind == "off" else "|".join(re.escape(p) for p in kinds[kind])
                out = generate_run(ckpt, a.tp, a.tokens, a.batch, a.seq_len, dump, pts)
                secs[kind].append(out["written"])
                if dump is not None:
                    size[kind] = dir_bytes(Path(dump))
                    shutil.rmtree(dump)
                log(f"repeat {r}: {kind} {out['written']:.3f}s")
    off = statistics.median(secs["off"])
    positions = a.batch * (a.seq_len + a.tokens - 1)
    print(f"\n{a.preset}, tp {a.tp}, {a.batch} requests x {a.seq_len} tokens, {a.tokens} new tokens each ({a.tokens} steps), "
          f"{a.repeats} repeats; the dump off {off:.3f} s ({min(secs['off']):.3f}..{max(secs['off']):.3f})")
    rows = []
    for kind, names in kinds.items():
        extra = [1e3 * (t - off) / a.tokens / len(names) for t in secs[kind]]
        rows.append([kind, str(len(names)), f"{size[kind] / positions / len(names):.0f}",
                     f"{statistics.median(extra):.3f} ({min(extra):.3f}..{max(extra):.3f})"])
    print_table(["kind", "hooks", "bytes/token/layer", "ms/hook/step, median (min..max)"], rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "seconds": secs, "bytes": size, "positions": positions}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-hd32")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps of the diffs")
    ap.add_argument("--seq-len", type=int, default=32, help="prompt length (diffs and generate)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--batch", type=int, default=4, help="requests per generate")
    ap.add_argument("--points", default=r"logits|layers\.\d+\.out", help="the TPCHECK_DUMP_POINTS selection")
    ap.add_argument("--generate-only", action="store_true", help="skip the time-to-verdict diffs")
    ap.add_argument("--verdict-only", action="store_true", help="only the time-to-verdict diffs (no generate runs)")
    ap.add_argument("--per-kind", action="store_true", help="instead: each point kind dumped alone (bytes per token "
                                                            "per layer, time per hook)")
    ap.add_argument("--json", help="--per-kind: also write the figures here")
    a = ap.parse_args(argv)
    from tpcheck.engines.vllm.adapter import vllm_env
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    vllm_env(a.tp)  # what --engine vllm sets (OMP thread binding per rank, ...), for the generate runs too
    ckpt = cached_checkpoint(a.preset)
    if a.per_kind:
        per_kind(a, ckpt)
        return 0
    verdict: dict[str, list[float]] = {"impl": [], "vllm": []}
    names = ("off", "all points", "selection", "all points, in the step", "selection, in the step")
    gen: dict[str, list[float]] = {n: [] for n in names}
    written: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for engine in verdict if not a.generate_only else ():
                verdict[engine].append(time_to_verdict(ckpt, engine, a.tp, a.decode_steps, a.seq_len))
                log(f"repeat {r}: diff --engine {engine}: {verdict[engine][-1]:.1f}s")
            for name in gen if not a.verdict_only else ():
                dump = None if name == "off" else f"{tmp}/{len(gen[name])}-{names.index(name)}"
                pts = a.points if name.startswith("selection") else None
                os.environ["TPCHECK_DUMP_QUEUE_MB"] = "0" if name.endswith("in the step") else "256"
                rate, rate_written = generate(ckpt, a.tp, a.tokens, a.batch, a.seq_len, dump, pts)
                gen[name].append(rate)
                written[name].append(rate_written)
                log(f"repeat {r}: generate, dump {name}: {rate:.1f} tokens/s ({rate_written:.1f} until written)")
    print(f"\n{a.preset}, tp {a.tp}, {a.repeats} repeats: median (min..max)")
    if not a.generate_only:
        print_table(["diff (cold process, float32)", "time to verdict, s"],
                    [[f"--engine {e} ({a.seq_len} tokens x 2 prompts, {a.decode_steps} decode steps)", _median(v)]
                     for e, v in verdict.items()])
    if a.verdict_only:
        return 0
    off = statistics.median(gen["off"])
    print_table(["vLLM generate", "tokens/s", "vs off", "tokens/s until written", "vs off"],
                [[f"dump {name}" + (f" ({a.points})" if name.startswith("selection") else ""), _median(v),
                  f"{statistics.median(v) / off:.2f}x", _median(written[name]),
                  f"{statistics.median(written[name]) / off:.2f}x"] for name, v in gen.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
