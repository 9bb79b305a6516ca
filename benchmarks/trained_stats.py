"""Per-layer statistics of a model's activations that decide its noise floor, as trained models have them: where the
massive activations sit (the residual stream's largest |x| against its RMS, and its channel), how much attention
goes to the first token (the sink), and how much the row-parallel linears' outputs cancel (the share of
``o_proj`` / ``down_proj`` output elements whose dot product has a condition number ``sum|w x| / |y|`` of at least
``4 sqrt(n)``: ``tpcheck.measure.own_input``'s "cancelling" elements). HF in float32, eager attention, one forward a
prompt; each cell is the median over the prompts (max|x| and its channel: the maximum and the channel that held it
most often).

    python benchmarks/trained_stats.py --model ~/.cache/tpcheck/gemma-3-270m [--prompts 8] [--json reports/stats.json]
    python benchmarks/trained_stats.py --preset small-gemma3     # a synthetic preset, random prompts

What it is for: a synthetic preset meant to stand in for a trained model (``gemma3-trained``) is judged by these
numbers at mid depth next to the trained checkpoint's."""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_log  # noqa: E402
from trained_matrix import LONG_TEXT, TEXTS  # noqa: E402

KAPPA_MIN = 4.0  # as tpcheck.measure.own_input


def prompts_for(model_dir: str, vocab: int, n: int, real: bool) -> list[list[int]]:
    """``n`` prompts of 8..64 tokens: real text through the checkpoint's tokenizer (``<bos>`` first), or random ids."""
    rng = random.Random("trained-stats")
    lens = [8 + (56 * i) // max(n - 1, 1) for i in range(n)]
    if not real:
        return [[rng.randrange(vocab) for _ in range(k)] for k in lens]
    from transformers import AutoTokenizer  # only where the checkpoint has a tokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i, k in enumerate(lens):
        ids = [tok.bos_token_id] + tok.encode(TEXTS[(7 * i) % len(TEXTS)] + " " + LONG_TEXT, add_special_tokens=False)
        out.append(ids[:k])
    return out


@torch.no_grad()
def layer_stats(model, ids: list[int]) -> list[dict]:
    """One forward: per decoder layer, the residual stream's max|x| / RMS / argmax channel, the attention on token 0
    (mean over heads and the queries after it), the share of cancelling o_proj / down_proj outputs."""
    layers = model.model.layers
    cancel: dict[tuple[int, str], float] = {}

    def kappa_hook(i: int, name: str):
        def hook(mod, args, out):
            x = args[0].float()
            mag = x.abs() @ mod.weight.float().abs().T
            k = mag / out.float().abs().clamp_min(1e-30)
            cancel[(i, name)] = float((k >= KAPPA_MIN * math.sqrt(x.shape[-1])).float().mean())
        return hook

    outs: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        # each layer's own output (HF's last hidden state is the final norm's, not the last layer's)
        handles.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach())))
        handles.append(layer.self_attn.o_proj.register_forward_hook(kappa_hook(i, "o_proj")))
        handles.append(layer.mlp.down_proj.register_forward_hook(kappa_hook(i, "down_proj")))
    try:
        out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for i in range(len(layers)):
        h = outs[i][0].float()  # after layer i
        rms = float(h.pow(2).mean().sqrt())
        flat = h.abs().argmax()
        att = out.attentions[i][0].float()  # [heads, q, k]
        sink = float(att[:, 1:, 0].mean()) if att.shape[1] > 1 else float("nan")
        rows.append({"layer": i, "max_abs": float(h.abs().max()), "rms": rms, "max_over_rms": float(h.abs().max()) / rms,
                     "channel": int(flat % h.shape[-1]), "token": int(flat // h.shape[-1]), "sink": sink,
                     "cancel_o_proj": cancel[(i, "o_proj")], "cancel_down_proj": cancel[(i, "down_proj")]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory (real text prompts where it has a tokenizer)")
    src.add_argument("--preset", help="a synthetic preset (random prompts)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--json", help="also write the table as JSON")
    args = ap.parse_args(argv)
    log = make_log("trained_stats")
    from impl.config import load_config
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.reference.hf import load_hf_model
    model_dir = args.model or str(cached_checkpoint(args.preset))
    cfg = load_config(model_dir)
    real = args.model is not None and (Path(model_dir) / "tokenizer.json").is_file()
    model = load_hf_model(model_dir, "float32", attn_implementation="eager")
    per_prompt = []
    for ids in prompts_for(model_dir, cfg.vocab_size, args.prompts, real):
        per_prompt.append(layer_stats(model, ids))
        log(f"{len(ids)} tokens done")
    table = []
    for i in range(cfg.num_layers):
        rs = [p[i] for p in per_prompt]
        med = {k: statistics.median(r[k] for r in rs if not math.isnan(r[k]))
               for k in ("rms", "max_over_rms", "sink", "cancel_o_proj", "cancel_down_proj")}
        table.append({"layer": i, "window": cfg.sliding_window(i), "max_abs": max(r["max_abs"] for r in rs),
                      "channel": Counter(r["channel"] for r in rs).most_common(1)[0][0],
                      "at_token0": sum(r["token"] == 0 for r in rs) / len(rs), **med})
    print(f"\n{model_dir}: {'real text' if real else 'random'} prompts, {args.prompts} of 8..64 tokens, HF float32")
    print(f"{'layer':>5} {'window':>6} {'max|x|':>9} {'rms':>8} {'max/rms':>8} {'channel':>7} {'@tok0':>6} "
          f"{'sink':>6} {'cancel o':>8} {'cancel d':>8}")
    for r in table:
        print(f"{r['layer']:>5} {str(r['window'] or '-'):>6} {r['max_abs']:>9.3g} {r['rms']:>8.3g} "
              f"{r['max_over_rms']:>8.3g} {r['channel']:>7} {r['at_token0']:>6.2f} {r['sink']:>6.3f} "
              f"{r['cancel_o_proj']:>8.3f} {r['cancel_down_proj']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
