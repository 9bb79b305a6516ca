"""Does vLLM's CPU build run pipeline parallelism? One greedy ``generate`` at ``pipeline_parallel_size`` stages
(eager, as ``tpcheck diff --engine vllm`` runs it), as vLLM ships, then with the one missing step done by hand.
Runs in vLLM's own environment (``docs/vllm.md``), on a checkpoint directory (``tpcheck make-checkpoint``)::

    .venv-vllm/bin/python benchmarks/vllm_pp.py --model /tmp/small-hd32 [--pp 2] [--prompt-ids 1,2,3,4]

Each variant runs in a fresh process (a failed vLLM engine leaves its workers' state behind). Prints, per
variant, the generated token ids or the error vLLM raised, and the seconds it took. ``allocated``: before the
first step, each later stage's receive buffers (``model_runner.intermediate_tensors``, ``hidden_states`` and
``residual``) are made as the GPU runner's warm-up makes them; the CPU runner's ``warming_up_model`` returns
early in eager mode (``CompilationMode.NONE``), so a later stage meets ``assert self.intermediate_tensors is not
None`` in ``sync_and_gather_intermediate_tensors`` on its first step."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _alloc(worker) -> str | list[str]:
    """Run in each vLLM worker: a later stage's receive buffers, as ``GPUModelRunner._dummy_run`` makes them."""
    from vllm.distributed import get_pp_group
    r = worker.model_runner
    if get_pp_group().is_first_rank:
        return "first stage"
    r.intermediate_tensors = r.model.make_empty_intermediate_tensors(
        batch_size=r.max_num_tokens, dtype=r.model_config.dtype, device=r.device)
    return sorted(r.intermediate_tensors.tensors)


def _variant(model: str, pp: int, prompt: list[int], tokens: int, allocate: bool) -> dict:
    """One ``generate`` in this process; its tokens or vLLM's error."""
    from vllm import LLM, SamplingParams
    t0 = time.monotonic()
    try:
        llm = LLM(model=model, tensor_parallel_size=1, pipeline_parallel_size=pp, dtype="float32",
                  enforce_eager=True, max_model_len=256, skip_tokenizer_init=True, seed=0)
        buffers = llm.collective_rpc(_alloc) if allocate else None
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=tokens, temperature=0))
        return {"tokens": list(out[0].outputs[0].token_ids), "buffers": buffers,
                "seconds": round(time.monotonic() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - what vLLM raises is the finding
        return {"error": f"{type(e).__name__}: {e}".strip(), "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (tpcheck make-checkpoint --preset small-hd32)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--prompt-ids", default="1,2,3,4", help="prompt token ids (default 1,2,3,4)")
    ap.add_argument("--tokens", type=int, default=4, help="greedy tokens to generate (default 4)")
    ap.add_argument("--variant", choices=("as-shipped", "allocated"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    prompt = [int(x) for x in a.prompt_ids.split(",")]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(a.pp)))
    if a.variant:  # one variant, in this (fresh) process: its result as the last line
        print(json.dumps(_variant(a.model, a.pp, prompt, a.tokens, a.variant == "allocated")), flush=True)
        return 0
    rc = 0
    for variant in ("as-shipped", "allocated"):
        p = subprocess.run([sys.executable, __file__, "--model", a.model, "--pp", str(a.pp), "--prompt-ids",
                            a.prompt_ids, "--tokens", str(a.tokens), "--variant", variant],
                           capture_output=True, text=True, timeout=900)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": f"exit {p.returncode}, no result: "
                                                      + (p.stderr.strip().splitlines() or ["?"])[-1]}
        if "error" in result:  # the engine's error; a worker's own, where one logged it, says why
            rc = 1
            worker = [ln.split("] ", 1)[-1].strip() for ln in p.stderr.splitlines() if "ERROR" in ln and "assert" in ln]
            if worker:
                result["worker"] = worker[0]
        print(f"pp={a.pp} {variant}: {json.dumps(result)}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
