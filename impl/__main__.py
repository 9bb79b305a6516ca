"""``python -m impl generate|logits``: run the engine from the shell (also under torchrun)."""
from __future__ import annotations

import argparse
import json
import sys

from impl.env import env_number


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m impl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "logits"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (llama, mistral, qwen2, "
                       "qwen3, qwen2_moe, qwen3_moe, mixtral)")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1, help="expert-parallel groups of the tp ranks (MoE models; "
                       "tp %% ep == 0)")
        p.add_argument("--pp", type=int, default=1, help="pipeline stages of --tp ranks each (pp x tp processes)")
        p.add_argument("--pp-partition", default=None, help="layers per pipeline stage, e.g. 3,3,2 (default: "
                       "vLLM's split)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--prompt-ids", type=_ids, action="append", default=[], help="token ids, e.g. 1,2,3 (repeatable)")
        p.add_argument("--prompt", action="append", default=[], help="prompt text (needs a tokenizer in --model)")
        p.add_argument("--batch-invariant", action="store_true", help="each request's numbers bit for bit the "
                       "same whatever else is batched with it (fixed-shape GEMMs, attention per sequence)")
    g = sub.choices["generate"]
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    a = ap.parse_args(argv)
    prompts = a.prompt_ids + a.prompt
    if not prompts:
        ap.error("give at least one --prompt-ids or --prompt")

    from impl import LLM, SamplingParams
    rank0 = (env_number("RANK", integer=True) or 0) == 0
    try:
        kw = dict(block_size=a.block_size, num_kv_blocks=a.num_kv_blocks) if a.cmd == "generate" else {}
        pp = a.pp
        if a.pp_partition is not None:
            pp = a.pp_partition
            if a.pp != 1 and len(a.pp_partition.split(",")) != a.pp:
                raise ValueError(f"--pp-partition {a.pp_partition} names {len(a.pp_partition.split(','))} stages, "
                                 f"--pp is {a.pp}")
        with LLM(a.model, tp_size=a.tp, dtype=a.dtype, ep_size=a.ep, pp_size=pp, **kw) as llm:
            if a.batch_invariant:
                llm.set_batch_invariant(True)
            if a.cmd == "logits":
                for p in prompts:
                    out = llm.logits(p)
                    if rank0:
                        print(json.dumps({"prompt": p, "argmax": out.argmax(-1).tolist(),
                                          "last_logits_top5": out[-1].topk(5).indices.tolist()}))
                return 0
            sp = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                max_tokens=a.max_new_tokens, seed=a.seed, ignore_eos=a.ignore_eos)
            outs = llm.generate(prompts, sp, progress=sys.stderr.isatty() or len(prompts) * a.max_new_tokens > 256)
            for p, out in zip(prompts, outs):
                row = {"prompt": p, "token_ids": out}
                if isinstance(p, str):
                    row["text"] = llm.tokenizer().decode(out)
                print(json.dumps(row))
        return 0
    except (ValueError, RuntimeError) as e:
        print(f"impl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
