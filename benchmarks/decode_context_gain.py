"""Where a decode step's ``attn.context`` gain comes from, in a tp 1 dump of Gemma 3 (vLLM's plugin, or tpcheck's own).

The local pass judges a decode step's context against the golden recomputed on the engine's recorded layer input
(and the keys and values of the earlier positions, each from that position's recorded input). This benchmark redoes
that golden for one layer in float64 and then attention, in float64, on each mix of the golden's and the engine's
q, k and v of the dump's first request, so a context gain is split by input: the engine's q alone (k and v the
golden's), its k alone, its v alone; the same for Hugging Face bfloat16's q, k and v on the same layer input (what
the references compute), with HF's rotation as it is (its cos / sin tables rounded to bfloat16, shared by q and k)
and in float32; and the gain's spread under rounding alone: the golden's k (or q) given independent errors, uniform
within one bfloat16 ulp of each element (what any correct kernel's rounding may be), ``--draws`` times.

    python benchmarks/decode_context_gain.py --dump DIR --model DIR --layers 1,11 [--draws 200] [--json F]

Measured on the zero-code chats dump of ``vllm_floor_dump.py --chats 6 --tp 1 --dtype bfloat16`` (docs/gemma3.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import make_log  # noqa: E402


def layer_model(model: str, layer: int, dtype: torch.dtype):
    """Gemma 3's text model with ``layer``'s weights alone loaded (vocabulary cut: the embedding is not read), in
    ``dtype``; its RoPE ``inv_freq`` kept in float32, as Hugging Face keeps it."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.gemma3 import modeling_gemma3 as m
    cfg = AutoConfig.from_pretrained(model)
    if cfg.model_type != "gemma3_text":
        raise SystemExit(f"{model}: model_type {cfg.model_type!r}; this benchmark reads Gemma 3 (gemma3_text) only")
    cfg.num_hidden_layers, cfg.vocab_size, cfg._attn_implementation = layer + 1, 8, "eager"
    mod = m.Gemma3TextModel(cfg)
    keep = {k: v.clone() for k, v in mod.rotary_emb.named_buffers()}
    mod = mod.to(dtype)
    for k, v in keep.items():
        setattr(mod.rotary_emb, k, v)
    files = sorted(Path(model).glob("*.safetensors"))
    state = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            state |= {k.removeprefix("model."): st.get_tensor(k).to(dtype) for k in st.keys()
                      if k.startswith(f"model.layers.{layer}.")}
    if not state:
        raise SystemExit(f"{model}: no tensor model.layers.{layer}.* in its safetensors")
    mod.load_state_dict(state, strict=False)
    return mod, cfg


def qkv(mod, cfg, layer: int, x: torch.Tensor, dtype: torch.dtype, rope32: bool = False):
    """q and k after RoPE, and v, of ``layer`` on the rows ``x`` (positions 0..n-1), as ``[n, heads * head_dim]``
    float64. ``rope32``: the rotation in float32 (tables and products), rounded to ``dtype`` after."""
    from transformers.models.gemma3 import modeling_gemma3 as m
    n, hd = x.shape[0], cfg.head_dim
    pos = torch.arange(n)[None]
    x = x.to(dtype)[None]
    a, lt = mod.layers[layer].self_attn, cfg.layer_types[layer]
    h = mod.layers[layer].input_layernorm(x)
    q = a.q_norm(a.q_proj(h).view(1, n, -1, hd).transpose(1, 2))
    k = a.k_norm(a.k_proj(h).view(1, n, -1, hd).transpose(1, 2))
    if rope32:
        cos, sin = mod.rotary_emb(x.float(), pos, lt)
        q, k = (t.to(dtype) for t in m.apply_rotary_pos_emb(q.float(), k.float(), cos, sin))
    else:
        cos, sin = mod.rotary_emb(x, pos, lt)
        q, k = m.apply_rotary_pos_emb(q, k, cos, sin)
    flat = lambda t: t[0].transpose(0, 1).reshape(n, -1).double()  # noqa: E731
    return flat(q), flat(k), a.v_proj(h)[0].double()


def attention(cfg, q, k, v, p: int) -> torch.Tensor:
    """Row ``p``'s context over positions ``0..p`` (every position: the run is shorter than the sliding window,
    checked by the caller), float64, the KV heads shared by their groups of query heads."""
    H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qh = q[p].view(H, hd)
    kk, vv = k[:p + 1].view(p + 1, kvh, hd), v[:p + 1].view(p + 1, kvh, hd)
    group = torch.arange(H) // (H // kvh)
    w = torch.softmax(torch.einsum("hd,jhd->hj", qh, kk[:, group]) * cfg.query_pre_attn_scalar ** -0.5, -1)
    return torch.einsum("hj,jhd->hd", w, vv[:, group]).reshape(-1)


def gain(x: torch.Tensor, g: torch.Tensor) -> float:
    """The error's component along the golden, ``<x - g, g> / <g, g>``: the projection, not tpcheck's ``gain``
    column (``tpcheck.measure.gain``: a robust per-element estimate of the same scale, with its noise terms); the
    two differ on one decode row (layer 1, step 2 of the chats dump: +0.0104 here, +0.0062 in tpcheck's table)."""
    return float(((x - g) @ g) / (g @ g))


def jitter(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with an independent error per element, uniform within one bfloat16 ulp (8 significant bits)."""
    ulp = torch.pow(2.0, torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
    return x + ulp * (torch.rand(x.shape, generator=gen, dtype=x.dtype) - 0.5)


def first_request(dump, layer: int, cfg):
    """The dump's first request: its steps, and per step the engine's layer input, q, k, v and context rows."""
    rid = dump.batches[0].ids[0]
    steps = [s for s, b in enumerate(dump.batches) if b.ids == [rid]]
    if dump.tp != 1:
        raise SystemExit(f"a tp {dump.tp} dump: this benchmark reads tp 1 dumps (one rank's tensors are the point)")
    rows = {n: [] for n in ("x", "q", "k", "v", "c")}
    kv = cfg.num_key_value_heads * cfg.head_dim
    for s in steps:
        pts = dump.points(s)
        try:
            got = {"x": pts[f"layers.{layer - 1}.out"], "q": pts[f"layers.{layer}.attn.q_rope"],
                   "k": pts[f"layers.{layer}.attn.k_rope"], "c": pts[f"layers.{layer}.attn.context"],
                   "v": pts[f"layers.{layer}.attn."]}
        except KeyError as e:
            raise SystemExit(f"step {s}: the dump has no point {e} (every point of layers {layer - 1} and {layer} "
                             "is needed)") from None
        for n, (_, tensors) in got.items():
            rows[n].append(tensors[0].double()[:, -kv:] if n == "v" else tensors[0].double())
    return steps, {n: torch.cat(t) for n, t in rows.items()}


def measure(dump, model: str, layer: int, draws: int) -> list[dict]:
    g64, cfg = layer_model(model, layer, torch.float64)
    steps, e = first_request(dump, layer, cfg)
    n = e["x"].shape[0]
    if cfg.layer_types[layer] == "sliding_attention" and n > cfg.sliding_window:
        raise SystemExit(f"{n} positions: over layer {layer}'s sliding window ({cfg.sliding_window})")
    with torch.no_grad():
        gq, gk, gv = qkv(g64, cfg, layer, e["x"], torch.float64)
        b16, _ = layer_model(model, layer, torch.bfloat16)
        hq, hk, hv = qkv(b16, cfg, layer, e["x"], torch.bfloat16)
        fq, fk, fv = qkv(b16, cfg, layer, e["x"], torch.bfloat16, rope32=True)
    out, gen = [], torch.Generator().manual_seed(0)
    starts = {s: dump.batches[s].starts[0] for s in steps}
    for i, s in enumerate(steps[1:], start=1):
        p = starts[s]
        g = attention(cfg, gq, gk, gv, p)
        mixes = {"engine, its op redone": (e["q"], e["k"], e["v"]), "engine q": (e["q"], gk, gv),
                 "engine k": (gq, e["k"], gv), "engine v": (gq, gk, e["v"]), "HF bf16": (hq, hk, hv),
                 "HF bf16 q": (hq, gk, gv), "HF bf16 k": (gq, hk, gv),
                 "HF bf16, rotation in fp32": (fq, fk, fv)}
        row = {"layer": layer, "step": s, "position": p, "engine (dumped)": gain(e["c"][n - len(steps) + i], g)}
        row |= {name: gain(attention(cfg, q, k, v, p), g) for name, (q, k, v) in mixes.items()}
        for name, x in (("k", gk), ("q", gq)):
            spread = torch.tensor([gain(attention(cfg, *((jitter(x, gen), gk) if name == "q" else (gq, jitter(x, gen))),
                                                     gv, p), g) for _ in range(draws)])
            row[f"one-ulp rounding of {name}: std"] = float(spread.std())
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True, help="a tp 1 dump of Gemma 3 (vLLM's plugin, or tpcheck diff --dump)")
    ap.add_argument("--model", required=True, help="the checkpoint the dump ran")
    ap.add_argument("--layers", default="1", help="layers (comma-separated, >= 1: the layer input is the previous "
                    "layer's out)")
    ap.add_argument("--draws", type=int, default=200, help="rounding draws per decode step")
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    log = make_log("decode_context_gain")
    from tpcheck.engines.dump.replay import read_dump
    dump = read_dump(args.dump)
    rows = []
    for layer in [int(x) for x in args.layers.split(",")]:
        if layer < 1:
            ap.error(f"--layers {layer}: layer 0's input is the embedding; give layers >= 1")
        log(f"layer {layer}")
        rows += measure(dump, args.model, layer, args.draws)
    keys = [k for k in rows[0] if k not in ("layer", "step", "position")]
    print("layer step " + " | ".join(keys))
    for r in rows:
        print(f"{r['layer']:>5} {r['step']:>4} " + " | ".join(f"{r[k]:.4f}" if "std" in k else f"{r[k]:+.4f}"
                                                          for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
