"""One probe request through a plain vLLM script under one schedule, for ``tpcheck invariance --dumps``: run it once
per schedule with ``TPCHECK_DUMP`` naming that schedule's directory, then compare the dumps (``docs/invariance.md``).

    TPCHECK_DUMP=runs/inv/alone python examples/vllm_invariance.py CKPT alone
    TPCHECK_DUMP=runs/inv/batch python examples/vllm_invariance.py CKPT batch
    tpcheck invariance --dumps runs/inv/alone runs/inv/batch

Schedules (the probe: 140 seeded token ids, 4 greedy decode steps; prefix caching off but where named):

* ``alone``: the probe alone;
* ``batch``: the probe at slot 3 of 8 requests (companions of 5 to 60 tokens, each decoding 1 to 5 steps, so the
  decode batch shrinks as they finish), in one ``generate``;
* ``prefix``: prefix caching on; a donor sharing the probe's first 128 tokens (one CPU KV block) runs first, so the
  probe starts on its block at position 128;
* ``chunk``: chunked prefill, at most 32 tokens a step;
* ``--tp N``: any of them at tp N. ``VLLM_BATCH_INVARIANT=1`` in the environment is vLLM's own batch-invariant mode.

Nothing of tpcheck here: the plugin records what vLLM ran."""
from __future__ import annotations

import argparse
import random

PROBE_LEN, DECODE, BLOCK = 140, 4, 128  # BLOCK: vLLM CPU's KV block (tokens)


def requests(vocab: int, schedule: str) -> list[tuple[list[int], int]]:
    """``(prompt, max_tokens)`` in the order they are given to vLLM."""
    rng = random.Random(0)
    probe = [rng.randrange(vocab) for _ in range(PROBE_LEN)]
    if schedule == "batch":
        crng = random.Random(1)
        others = [([crng.randrange(vocab) for _ in range(crng.randint(5, 60))], crng.randint(1, 5)) for _ in range(7)]
        return others[:3] + [(probe, DECODE + 1)] + others[3:]
    if schedule == "prefix":
        return [(probe[:BLOCK] + [rng.randrange(vocab) for _ in range(9)], 1), (probe, DECODE + 1)]
    return [(probe, DECODE + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("schedule", choices=["alone", "batch", "prefix", "chunk"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vocab", type=int, default=256, help="draw token ids below this (the checkpoint's vocab)")
    a = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    chunk = a.schedule == "chunk"
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, dtype=a.dtype, enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32 if chunk else 1024,
              enable_chunked_prefill=chunk, enable_prefix_caching=a.schedule == "prefix", seed=0)
    reqs = requests(a.vocab, a.schedule)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for _, n in reqs]
    prompts = [TokensPrompt(prompt_token_ids=t) for t, _ in reqs]
    if a.schedule == "prefix":  # the donor first, alone: its block is cached when the probe arrives
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
        prompts, params = prompts[1:], params[1:]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print("OUT", len(out.prompt_token_ids), list(out.outputs[0].token_ids))


if __name__ == "__main__":
    main()
