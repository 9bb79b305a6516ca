"""Peak memory and time of the float64 golden: in memory (``from_pretrained``) vs layer-streamed
(``tpcheck.reference.streamed``), each variant in a fresh subprocess.

Each child imports torch, transformers and tpcheck, warms the code paths up on the ``tiny`` preset (lazy imports,
thread pools), then samples its baseline RSS: what an idle process that imported everything holds. It resets
VmHWM (``/proc/self/clear_refs``), builds the golden, reads VmHWM (the build's peak), resets it again, runs
``HFCapture.step`` as ``tpcheck diff`` does (a prefill of ``--batch`` prompts of ``--seq-len`` tokens, then
``--decode-steps`` greedy steps, ``with_kv=True``, each step's points dropped after it), and reads VmHWM again
(the steps' peak); a thread also samples RssAnon / RssFile every 5 ms. Growth = peak - baseline. Each child
hashes every point of every step: the parent checks that the two variants' points are bit-identical.

Figures: checkpoint size; one layer's float64 weight bytes; the largest matrix; the embedding; the LM-head
chunk; peak growth per variant; the activations (counted: the step's points + the KV cache; measured: the
in-memory steps' peak over its resident model); the ratio of the streamed peak to one layer's weights +
activations (goal <= 1.5); the streamed/in-memory step time; and a projection to Qwen2.5-7B and -72B.

    python benchmarks/golden_memory.py                      # qwen2.5-0.5b, 2 x 32 tokens + 2 decode steps, ~2 min
    python benchmarks/golden_memory.py --preset small --json /tmp/golden_memory.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import MiB, Poller, add_checkpoint_args, add_json_arg, check_json_arg, make_log, print_table  # noqa: E402
from common import read_status, resolve_checkpoint  # noqa: E402

GiB = 1 << 30
VARIANTS = ("in-memory", "streamed")
log = make_log("golden_memory")

# Qwen2.5 shapes from their config.json (hidden, layers, intermediate, heads, kv heads, vocab, tied)
PROJECTIONS = {
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen2.5-72B": dict(hidden_size=8192, num_hidden_layers=80, intermediate_size=29568, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


# ---- shapes -> bytes (float64 unless said) -------------------------------------------------------------
def shape_bytes(c: dict, itemsize: int = 8) -> dict:
    """Weight bytes of a Qwen2 config (dict of its fields): per layer, its largest matrix, its vectors, the
    embedding, the whole model, and the LM-head chunk ``tpcheck.reference.streamed`` uses by default."""
    from tpcheck.reference.streamed import HEAD_ROW_ALIGN
    h, inter, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    matrices = [q * h, kv * h, kv * h, h * q, inter * h, inter * h, h * inter]
    vectors = q + 2 * kv + 2 * h  # q/k/v biases, two norms
    layer = sum(matrices) + vectors
    embed = V * h
    total = embed + L * layer + h + (0 if c["tie_word_embeddings"] else embed)
    chunk_rows = max(1, max(matrices) // h // HEAD_ROW_ALIGN) * HEAD_ROW_ALIGN
    return dict(layer=layer * itemsize, largest_matrix=max(matrices) * itemsize, embed=embed * itemsize,
                total=total * itemsize, vectors=(L * vectors + h) * itemsize,
                head_chunk=min(chunk_rows, V) * h * itemsize, head_chunk_rows=min(chunk_rows, V))


def activation_bytes(c: dict, prompt_lens: list[int], decode_steps: int, itemsize: int = 8) -> int:
    """The largest (points + KV cache) of any step of HFCapture.step, with_kv, from the shapes alone: per token
    and layer 6 hidden-size points, q/q_rope/context, k/v/k_rope, gate/up/act; per token embed, final_norm and
    the logits; per layer the KV cache and its copy in the kv.k / kv.v points."""
    h, inter, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_token = L * (6 * h + 3 * q + 3 * kv + 3 * inter) + 2 * h + V
    out = 0
    for step in range(decode_steps + 1):
        tokens = sum(prompt_lens) if step == 0 else len(prompt_lens)
        positions = sum(prompt_lens) + step * len(prompt_lens)
        out = max(out, tokens * per_token + 2 * L * 2 * kv * positions)
    return out * itemsize


# ---- the child: one variant --------------------------------------------------------------------------------
class Sampler(Poller):
    def __init__(self, interval_s: float = 0.005):
        super().__init__(interval_s)
        self.peak: dict[str, int] = {}

    def sample(self) -> None:
        for k, v in read_status().items():
            self.peak[k] = max(self.peak.get(k, 0), v)


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(variant: str, model_dir: str, warm_dir: str, prompt_lens: list[int], decode_steps: int, seed: int) -> dict:
    import gc

    import torch

    from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache
    from tpcheck.pipeline.check import random_prompts
    from tpcheck.reference.streamed import streamed_hf_capture

    def build(d):
        return streamed_hf_capture(d, "float64") if variant == "streamed" else HFCapture(load_hf_model(d, "float64"))

    def steps(cap, prompts, n_decode, digest=None):
        caches = [new_cache(cap.model) for _ in prompts]
        tokens, starts, times, counted = [list(p) for p in prompts], [0] * len(prompts), [], 0
        for _step in range(n_decode + 1):
            t0 = time.perf_counter()
            points = cap.step(tokens, caches, starts, None, with_kv=True)
            times.append(time.perf_counter() - t0)
            kv = sum(t.nbytes for n, t in points.items() if ".kv." in n)  # the cache holds the same bytes again
            counted = max(counted, sum(t.nbytes for t in points.values()) + kv)
            if digest is not None:
                for n in sorted(points):
                    digest.update(n.encode())
                    digest.update(points[n].contiguous().view(torch.uint8).numpy().tobytes())
            lens = [len(t) for t in tokens]
            nxt = points["logits"][torch.tensor(lens).cumsum(0) - 1].argmax(-1).tolist()
            starts, tokens = [s + n for s, n in zip(starts, lens)], [[t] for t in nxt]
            del points
        return times, counted

    warm = build(warm_dir)  # lazy imports, thread pools, allocator arenas: part of the baseline, not the model
    steps(warm, random_prompts(warm.model.config.vocab_size, len(prompt_lens), 4, seed), 1)
    del warm
    gc.collect()
    base = read_status()
    hwm_ok = reset_hwm()
    with Sampler() as sampler:
        t0 = time.perf_counter()
        cap = build(model_dir)
        build_s = time.perf_counter() - t0
        gc.collect()
        built = read_status()
        build_peak = built["VmHWM"]
        reset_hwm()
        vocab = cap.model.config.vocab_size
        prompts = [p[:n] for p, n in zip(random_prompts(vocab, len(prompt_lens), max(prompt_lens), seed), prompt_lens)]
        digest = hashlib.sha256()
        times, counted = steps(cap, prompts, decode_steps, digest)
        after = read_status()
    out = dict(variant=variant, pid=os.getpid(), hwm_reset=hwm_ok, threads=torch.get_num_threads(),
               base_rss=base["VmRSS"], base_anon=base.get("RssAnon"), base_file=base.get("RssFile"),
               built_rss=built["VmRSS"], build_peak_rss=build_peak, steps_peak_rss=after["VmHWM"],
               peak_anon=sampler.peak.get("RssAnon"), peak_file=sampler.peak.get("RssFile"),
               sampled_peak_rss=sampler.peak.get("VmRSS"), build_s=build_s, step_s=times,
               counted_activation_bytes=counted, digest=digest.hexdigest())
    s = getattr(cap.model, "tpcheck_streamer", None)
    if s is not None:
        out.update(streamer_peak_bytes=s.peak_bytes, head_chunk_rows=s.head_chunk_rows, vector_bytes=s.vector_bytes,
                   arena_bytes=s.arena_bytes,
                   bytes_read=s.reader.bytes_read, matrix_loads=s.loads)
    return out


def run_child(variant: str, a, model_dir: Path, warm_dir: Path) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--ckpt-dir", str(model_dir),
           "--warm-dir", str(warm_dir), "--seq-len", str(a.seq_len), "--batch", str(a.batch),
           "--decode-steps", str(a.decode_steps), "--seed", str(a.seed)]
    t0 = time.perf_counter()
    log(f"{variant}: fresh subprocess ...")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"golden_memory: the {variant} child failed (exit {r.returncode})")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    log(f"{variant}: done in {time.perf_counter() - t0:.1f}s (build {res['build_s']:.1f}s, "
        f"steps {sum(res['step_s']):.1f}s)")
    return res


# ---- the parent ----------------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap, seed_help="checkpoint and prompt seed")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per prompt (default 32)")
    ap.add_argument("--batch", type=int, default=2, help="prompts (default 2)")
    ap.add_argument("--decode-steps", type=int, default=2, help="greedy decode steps after the prefill (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="children per variant; the fastest steps count (default 1)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--warm-dir", help=argparse.SUPPRESS)
    add_json_arg(ap)
    args = ap.parse_args(argv)
    if min(args.seq_len, args.batch, args.repeats) < 1 or args.decode_steps < 0:
        ap.error("--seq-len, --batch and --repeats must be >= 1, --decode-steps >= 0")
    if not Path("/proc/self/status").is_file():
        ap.error("needs Linux /proc")
    check_json_arg(ap, args)
    return ap, args


@dataclass
class Figures:
    """What the parent measured (every child's run) and derived from it, for the report and the JSON."""
    model_dir: Path
    cfg: dict
    ckpt_bytes: int
    sb: dict  # shape_bytes(cfg)
    loadavg: list  # before and after the children
    runs: dict  # variant -> its children's results
    mem: dict  # the fastest in-memory child
    st: dict  # the fastest streamed child
    identical: bool
    measured_act: int
    counted_act: int
    formula_act: int
    ratio: float
    step_ratio: float


def _growth(r: dict) -> int:
    """Peak growth over the idle baseline, build and steps."""
    return max(r["build_peak_rss"], r["steps_peak_rss"]) - r["base_rss"]


def _mib(x: float) -> str:
    return f"{x / MiB:,.0f}"


def measure(ap, a) -> Figures:
    """Run ``--repeats`` children of each variant on the checkpoint and derive the figures."""
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    model_dir = resolve_checkpoint(ap, a, log)
    warm_dir = cached_checkpoint("tiny", root=a.cache_root)
    cfg = json.loads((model_dir / "config.json").read_text())
    ckpt_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    sb = shape_bytes(cfg)
    load0 = os.getloadavg()
    runs = {v: [run_child(v, a, model_dir, warm_dir) for _ in range(a.repeats)] for v in VARIANTS}
    load1 = os.getloadavg()
    best = {v: min(rs, key=lambda r: sum(r["step_s"])) for v, rs in runs.items()}
    mem, st = best["in-memory"], best["streamed"]
    # activations: measured = what the in-memory steps add over its resident model; counted = points + cache
    measured_act = mem["steps_peak_rss"] - mem["built_rss"]
    return Figures(model_dir=model_dir, cfg=cfg, ckpt_bytes=ckpt_bytes, sb=sb, loadavg=[load0, load1], runs=runs,
                   mem=mem, st=st, identical=len({r["digest"] for rs in runs.values() for r in rs}) == 1,
                   measured_act=measured_act, counted_act=mem["counted_activation_bytes"],
                   formula_act=activation_bytes(cfg, [a.seq_len] * a.batch, a.decode_steps),
                   ratio=_growth(st) / (sb["layer"] + measured_act),
                   step_ratio=sum(st["step_s"]) / sum(mem["step_s"]))


def print_sizes(a, f: Figures) -> None:
    """The run's header, then the checkpoint's, the weights' and the activations' sizes."""
    m, sb, mem, st, (load0, load1) = _mib, f.sb, f.mem, f.st, f.loadavg
    print(f"# golden_memory: preset {a.preset}, float64 golden, {a.batch} prompt(s) x {a.seq_len} tokens + "
          f"{a.decode_steps} decode step(s), with_kv; checkpoint {f.model_dir}")
    print(f"# torch threads {mem['threads']}; load average {load0[0]:.1f} before, {load1[0]:.1f} after "
          f"({os.cpu_count()} cores); VmHWM reset between phases: {mem['hwm_reset'] and st['hwm_reset']}")
    print()
    print(f"checkpoint on disk            {m(f.ckpt_bytes)} MiB ({len(list(f.model_dir.glob('*.safetensors')))} file(s))")
    print(f"float64 weights, whole model  {m(sb['total'])} MiB")
    print(f"one layer's float64 weights   {m(sb['layer'])} MiB (largest matrix {m(sb['largest_matrix'])} MiB)")
    print(f"embedding, float64            {m(sb['embed'])} MiB "
          f"({'tied: also the LM head' if f.cfg['tie_word_embeddings'] else 'plus an LM head of the same size'})")
    print(f"LM-head chunk, float64        {m(sb['head_chunk'])} MiB ({st.get('head_chunk_rows', sb['head_chunk_rows'])} "
          f"vocab rows)")
    print(f"activations (one step, max)   measured {m(f.measured_act)} MiB (in-memory steps' peak - its resident "
          f"model); counted {m(f.counted_act)} MiB (points + KV cache; shape formula {m(f.formula_act)} MiB)")
    print()


def print_variants(f: Figures) -> None:
    """One row of memory and time per variant (its fastest child)."""
    m = _mib
    print("# MiB; growth = peak VmRSS (VmHWM) - the idle baseline (torch, transformers, tpcheck imported and warmed)")
    hdr = ["variant", "baseline", "resident after build", "build peak growth", "steps peak growth", "peak growth",
           "peak RssAnon growth", "peak RssFile", "build s", "steps s", "prefill s", "decode s"]
    print_table(hdr, [[r["variant"], m(r["base_rss"]), m(r["built_rss"] - r["base_rss"]),
                       m(r["build_peak_rss"] - r["base_rss"]), m(r["steps_peak_rss"] - r["base_rss"]), m(_growth(r)),
                       m(r["peak_anon"] - r["base_anon"]), m(r["peak_file"]), f"{r['build_s']:.2f}",
                       f"{sum(r['step_s']):.2f}", f"{r['step_s'][0]:.2f}", f"{sum(r['step_s'][1:]):.2f}"]
                      for r in (f.mem, f.st)])
    print()


def print_ratios(f: Figures) -> None:
    """Bit-identity of the variants' points, the streamed peak against its goal, and the time ratios."""
    m, sb, mem, st, ratio, measured_act = _mib, f.sb, f.mem, f.st, f.ratio, f.measured_act
    print("# ratios")
    print(f"points bit-identical (sha256 of every point of every step, all children): {'yes' if f.identical else 'NO'}")
    print(f"streamed peak growth / (one layer's weights + measured activations) = {m(_growth(st))} / "
          f"({m(sb['layer'])} + {m(measured_act)}) = {ratio:.2f} (goal <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
    print(f"streamed peak growth - measured activations = {m(_growth(st) - measured_act)} MiB = "
          f"{(_growth(st) - measured_act) / sb['layer']:.2f} layers' weights "
          f"(streamer's own peak of resident weights: {m(st['streamer_peak_bytes'])} MiB, in a reused buffer of "
          f"{m(st['arena_bytes'])} MiB; resident vectors {m(st['vector_bytes'])} MiB)")
    print(f"streamed / in-memory peak growth = {_growth(st) / _growth(mem):.3f}")
    print(f"streamed / in-memory step time = {f.step_ratio:.2f}x (prefill {st['step_s'][0] / mem['step_s'][0]:.2f}x, "
          f"decode {sum(st['step_s'][1:]) / max(1e-9, sum(mem['step_s'][1:])):.2f}x); build "
          f"{st['build_s']:.2f}s vs {mem['build_s']:.2f}s; streamed total / in-memory total (build + steps) = "
          f"{(st['build_s'] + sum(st['step_s'])) / (mem['build_s'] + sum(mem['step_s'])):.2f}x")
    print(f"streamed read {st['bytes_read'] / GiB:.2f} GiB of checkpoint in {sum(st['step_s']):.1f}s "
          f"({st['matrix_loads']} matrix reads; every forward reads every matrix, each prompt is its own forward)")
    print()


def print_projection(a, f: Figures) -> None:
    """The same workload's float64 golden on the ``PROJECTIONS`` shapes, activations scaled as measured here."""
    factor = f.measured_act / f.formula_act if f.formula_act else 1.0
    print(f"# projection, float64 golden, same workload; activations = shape formula x {factor:.2f} "
          f"(measured / formula here)")
    hdr = ["model", "params", "in-memory weights", "one layer", "largest matrix", "head chunk", "activations",
           "streamed peak estimate", "in-memory / streamed"]
    rows = []
    for name, c in PROJECTIONS.items():
        p = shape_bytes(c)
        act = activation_bytes(c, [a.seq_len] * a.batch, a.decode_steps) * factor
        est = p["vectors"] + max(p["largest_matrix"], p["head_chunk"]) + act
        rows.append([name, f"{p['total'] / 8 / 1e9:.2f}B", f"{p['total'] / GiB:,.1f} GiB", f"{p['layer'] / GiB:.2f} GiB",
                     f"{p['largest_matrix'] / GiB:.2f} GiB", f"{p['head_chunk'] / GiB:.2f} GiB", f"{act / GiB:.2f} GiB",
                     f"{est / GiB:.2f} GiB", f"{(p['total'] + act) / est:.0f}x"])
    print_table(hdr, rows)


def write_json(a, f: Figures) -> None:
    Path(a.json).write_text(json.dumps(dict(
        preset=a.preset, checkpoint=str(f.model_dir), checkpoint_bytes=f.ckpt_bytes, shapes=f.sb, runs=f.runs,
        measured_activation_bytes=f.measured_act, counted_activation_bytes=f.counted_act,
        formula_activation_bytes=f.formula_act, ratio_to_layer_plus_activations=f.ratio, step_time_ratio=f.step_ratio,
        bit_identical=f.identical, loadavg=f.loadavg), indent=2) + "\n")
    log(f"wrote {a.json}")


def main(argv=None) -> int:
    ap, a = parse_args(argv)
    if a.child:  # one variant in this fresh process; one JSON line on stdout
        print(json.dumps(child(a.child, a.ckpt_dir, a.warm_dir, [a.seq_len] * a.batch, a.decode_steps, a.seed)))
        return 0
    f = measure(ap, a)
    print_sizes(a, f)
    print_variants(f)
    print_ratios(f)
    print_projection(a, f)
    if a.json:
        write_json(a, f)
    return 0 if f.identical else 1


if __name__ == "__main__":
    sys.exit(main())
