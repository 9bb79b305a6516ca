"""tpcheck on a GPU, whole, in one script: what a lent GPU machine runs (no network; torch, transformers, pandas,
hypothesis, pytest installed; tpcheck with ``pip install --no-deps --no-build-isolation -e .``), printing every
figure of its GPU checklist (docs/gpu.md) it can measure, each with its verdict.

Sections, in order of what matters most (each skipped, and said so, when ``--budget-s`` runs out):

1. ``tpcheck diff --device cuda`` with default options (both passes) on qwen2.5-0.5b (synthetic weights), 2 x
   ``--seq-len`` tokens, ``--decode-steps`` decode steps: tp 1 and tp 2 (two ranks on one GPU when there is one:
   gloo, host-staged collectives), float32 and bfloat16: PASS or FAIL, the first call (load included) and a loaded
   call, timed.
2. Time to verdict, loaded: the same diff with the golden and references on the GPU and on the host
   (``--golden-device cpu``), and the whole diff on the host (``--device cpu``: the host's cores), parts timed
   (engine, golden, references, transfers of the engine's points, and the rest: statistics and bookkeeping).
3. A Llama-3-8B-shaped synthetic checkpoint (hidden 4096, 32 heads / 8 KV heads, intermediate 14336, vocab
   128,256; ``--layers-8b`` layers), tp 1, bfloat16: written once, then the first diff (load included) and a loaded
   one, parts timed beside the GPU's work floor for that verdict (its forwards' FLOPs at the chip's peak rates:
   ``--peak-fp64-tflops``, ``--peak-bf16-tflops``).
4. The fault catalog on the device (``tpcheck faults matrix --device``): its summary.
5. TF32 in a float32 engine (``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` in a fresh ``tpcheck diff``): the effective
   precision it reports (CUDA only).

CUDA graphs (``--cuda-graphs``) are not built yet: nothing here measures them.

``--device cpu --quick``: the same code on small presets, one run per configuration (float32 alone in section 1),
as the test suite's smoke test (``tests/test_tpcheck/inputs/test_devices.py``); its figures say nothing about a GPU.

    python benchmarks/gpu_check.py [--device cuda] [--budget-s 450] [--layers-8b 4] [--out gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
# --quick: the same shape's family, narrow (the CPU smoke test)
NARROW = dict(LLAMA3_8B, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
              vocab_size=1000, bos_token_id=1, eos_token_id=2)


class Parts:
    """Wall seconds of a diff's parts, by wrapping what does them (CUDA synchronized at each edge, so a part's time
    is its work's): the engine adapter's steps and prefix, the golden's and the references' forwards (the float64
    capture is the golden), the engine points' moves to the golden's device; ``rest`` = the diff less these."""

    def __init__(self):
        from tpcheck.engines.impl.adapter import ImplAdapter
        from tpcheck.pipeline import steps
        from tpcheck.reference.hf import HFCapture
        self.t = {"engine": 0.0, "golden": 0.0, "references": 0.0, "transfers": 0.0}
        self._undo = []
        self._wrap(ImplAdapter, "step", lambda *a, **k: "engine")
        self._wrap(ImplAdapter, "take_prefix", lambda *a, **k: "engine")
        self._wrap(HFCapture, "step", lambda cap, *a, **k: "golden" if cap.model.dtype == torch.float64
                   else "references")
        self._wrap(steps, "to_device", lambda *a, **k: "transfers")

    def _wrap(self, owner, name, part_of):
        orig = getattr(owner, name)

        def timed(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                _sync()
                self.t[part_of(*args, **kwargs)] += time.perf_counter() - t0
        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def close(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_diff(pool, parts: Parts | None = None, **kw) -> dict:
    """One ``tpcheck.diff`` (``kw``), its verdict, wall seconds and (``parts``) its parts' seconds."""
    import tpcheck
    if parts is not None:
        parts.t = dict.fromkeys(parts.t, 0.0)
    _sync()
    t0 = time.perf_counter()
    r = tpcheck.diff(pool=pool, **kw)
    _sync()
    wall = time.perf_counter() - t0
    out = {"passed": bool(r.passed), "wall_s": round(wall, 3), "rows": len(r.table), "devices": r.meta.get("devices")}
    if parts is not None:
        out["parts_s"] = {k: round(v, 3) for k, v in parts.t.items()}
        out["parts_s"]["rest (statistics, bookkeeping)"] = round(wall - sum(parts.t.values()), 3)
    if not r.passed:
        w = r.worst()
        out["worst"] = f"{w.point} step {int(w.step)} ({w.mode}): {w.note or ''}"
    return out


def forward_flops(cfg, tokens: int) -> float:
    """~2 x the matmul parameters x tokens (the embedding is a lookup, the LM head a matmul), plus attention's
    QK^T and PV over a context of at most ``tokens`` (an upper bound)."""
    h, L = cfg.hidden_size, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return 2.0 * tokens * (L * per_layer + h * cfg.vocab_size) + 4.0 * L * tokens * tokens * q


def work_floor(cfg, prompts: int, seq: int, steps: int, local_rows: int, peak64: float, peak16: float) -> dict:
    """The GPU's least time for one default diff's forwards at the chip's peak rates: the golden once in float64
    (the local pass reuses it), the two references and the engine at the dtype, each over the propagated pass's
    tokens and the local pass's (its last ``local_rows`` per prompt, and the decode steps)."""
    prop = prompts * (seq + steps)
    local = prompts * (min(seq, local_rows) + steps)
    golden = forward_flops(cfg, prop) / (peak64 * 1e12)
    low = 3 * (forward_flops(cfg, prop) + forward_flops(cfg, local)) / (peak16 * 1e12)
    return {"golden_fp64_s": round(golden, 4), "engine_and_references_s": round(low, 4),
            "floor_s": round(golden + low, 4), "peak_fp64_tflops": peak64, "peak_low_tflops": peak16}


class Check:
    """One run of the check: its options (``a``), device, pool, parts timer, figures and verdicts (``ok``); each
    section a method, skipped (and said so) once ``--budget-s`` is spent."""

    def __init__(self, a):
        from impl import CacheConfig
        from tpcheck.engines.pool import EnginePool
        from tpcheck.inputs.devices import gpu_count, resolve_device
        self.a, self.t0 = a, time.perf_counter()
        self.dev = resolve_device(a.device)  # a GPU asked for and absent: a ValueError naming it
        self.seq = a.seq_len or (24 if a.quick else 128)
        self.qwen = "tiny" if a.quick else "qwen2.5-0.5b"
        self.figures: dict = {"device": self.dev, "gpus": gpu_count(), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(0) if self.dev.startswith("cuda") else None,
                              "cpu_threads": torch.get_num_threads(), "seq_len": self.seq,
                              "decode_steps": a.decode_steps}
        self.ok: list[bool] = []
        self.pool = EnginePool(device=self.dev, cache=CacheConfig(max_num_seqs=16))
        self.parts = Parts()
        self.base = dict(seq_len=self.seq, batch=2, decode_steps=a.decode_steps, device=self.dev)

    def left(self) -> float:
        return self.a.budget_s - (time.perf_counter() - self.t0)

    def pair(self, **kw) -> tuple[dict, dict]:
        """The first diff of ``kw`` (load included) and a loaded one, parts timed (--quick: one run, both)."""
        kw = {**self.base, **kw}
        first = timed_diff(self.pool, self.parts if self.a.quick else None, **kw)
        loaded = first if self.a.quick else timed_diff(self.pool, self.parts, **kw)
        self.ok += [first["passed"], loaded["passed"]]
        return first, loaded

    def diffs(self) -> None:
        """1. the default diff: tp 1 and 2 (two ranks on one GPU), float32 and bfloat16, both passes."""
        from tpcheck.inputs.models.checkpoints import cached_checkpoint
        self.figures["diffs"] = []
        for dtype in ("float32",) if self.a.quick else ("float32", "bfloat16"):
            ckpt = str(cached_checkpoint(self.qwen, dtype=dtype))
            for tp in (1, 2):
                if self.left() < 30:
                    print(f"[1] skipped {self.qwen} tp {tp} {dtype}: budget spent")
                    continue
                first, loaded = self.pair(model=ckpt, tp=tp, dtype=dtype)
                self.figures["diffs"].append({"model": self.qwen, "tp": tp, "dtype": dtype, "first": first,
                                              "loaded": loaded})
                verdict = "PASS" if loaded["passed"] and first["passed"] else "FAIL"
                print(f"[1] {self.qwen} tp {tp} {dtype} on {self.dev}: {verdict}  first {first['wall_s']:.2f}s  "
                      f"loaded {loaded['wall_s']:.2f}s  parts {loaded['parts_s']}"
                      + (f"  worst {loaded.get('worst') or first.get('worst')}" if verdict == "FAIL" else ""))

    def verdict_time(self) -> None:
        """2. time to verdict, loaded: the golden on the device vs on the host; the whole diff on the host."""
        from tpcheck.inputs.models.checkpoints import cached_checkpoint
        ckpt, dev = str(cached_checkpoint(self.qwen, dtype="float32")), self.dev
        vt = self.figures["verdict_time"] = {}
        for label, kw in ((f"engine+golden on {dev}", {}), ("golden on cpu", {"golden_device": "cpu"}),
                          ("all on cpu", {"device": "cpu"})):
            if self.a.quick and label == "golden on cpu":  # the CPU smoke test: the same device as the engine's
                continue
            if self.left() < 40:
                print(f"[2] skipped {label}: budget spent")
                continue
            _, r = self.pair(model=ckpt, tp=1, dtype="float32", **kw)
            vt[label] = r
            print(f"[2] {self.qwen} tp 1 float32, {label}: {r['wall_s']:.2f}s loaded  parts {r['parts_s']}")
        if "all on cpu" in vt and f"engine+golden on {dev}" in vt:
            gpu_s, cpu_s = vt[f"engine+golden on {dev}"]["wall_s"], vt["all on cpu"]["wall_s"]
            self.figures["host_over_device"] = round(cpu_s / gpu_s, 2)
            print(f"[2] the whole diff on the host's {self.figures['cpu_threads']} threads / on {dev}: "
                  f"{cpu_s:.2f}s / {gpu_s:.2f}s = {cpu_s / gpu_s:.2f}x")

    def llama_8b(self) -> None:
        """3. the Llama-3-8B-shaped checkpoint, tp 1, bfloat16, beside its work floor."""
        from impl.config import load_config
        from tpcheck.inputs.models.config_checkpoints import config_checkpoint
        a = self.a
        shape = dict(NARROW if a.quick else LLAMA3_8B, num_hidden_layers=2 if a.quick else a.layers_8b)
        if self.left() < 120 and not a.quick:
            print("[3] skipped the 8B-shaped diff: budget spent")
            return
        t0 = time.perf_counter()
        root = Path(os.environ.get("TPCHECK_GPU_CHECK_ROOT", Path(tempfile.gettempdir()) / "tpcheck-gpu-check"))
        d = str(config_checkpoint(shape, root=root, dtype="bfloat16"))
        written = time.perf_counter() - t0
        first, loaded = self.pair(model=d, tp=1, dtype="bfloat16")
        floor = work_floor(load_config(d), 2, self.seq, a.decode_steps, 32, a.peak_fp64_tflops, a.peak_bf16_tflops)
        self.figures["llama3_8b_shaped"] = {"layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
                                            "vocab": shape["vocab_size"], "written_s": round(written, 1),
                                            "first": first, "loaded": loaded, "work_floor": floor}
        verdict = "PASS" if first["passed"] and loaded["passed"] else "FAIL"
        print(f"[3] Llama-3-8B-shaped ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, vocab "
              f"{shape['vocab_size']}) tp 1 bfloat16 on {self.dev}: {verdict}  written {written:.1f}s  first (load "
              f"included) {first['wall_s']:.2f}s  loaded {loaded['wall_s']:.2f}s  parts {loaded['parts_s']}  work "
              f"floor {floor['floor_s']}s (golden fp64 {floor['golden_fp64_s']}s)")

    def faults(self) -> None:
        """4. the fault catalog on the device, summarised."""
        from tpcheck.cli.fault_matrix import run_matrix
        if self.left() < 90 and not self.a.quick:
            print("[4] skipped the fault matrix: budget spent")
            return
        df = run_matrix(["qkv_shard_dim1"] if self.a.quick else None, pool=self.pool, clean=not self.a.quick)
        faults, clean = df[df["fault"] != "(clean)"], df[df["fault"] == "(clean)"]
        fm = self.figures["fault_matrix"] = {
            "faults_found": int(faults["ok"].sum()), "faults": len(faults),
            "clean_alarmed": int((~clean["ok"].astype(bool)).sum()), "clean": len(clean),
            "missed": [f"{r.fault}: {r.note}" for r in df[~df["ok"].astype(bool)].itertuples()]}
        self.ok.append(bool(df["ok"].all()))
        print(f"[4] fault matrix on {self.dev}: {fm['faults_found']}/{fm['faults']} faults at their origin; "
              f"{fm['clean_alarmed']}/{fm['clean']} clean runs alarmed" + "".join(f"\n    {m}" for m in fm["missed"]))

    def tf32(self) -> None:
        """5. TF32 in a float32 engine: a fresh process (cuBLAS reads the override when it starts)."""
        if not self.dev.startswith("cuda") or self.left() < 45:
            print("[5] TF32: CUDA only" if not self.dev.startswith("cuda") else "[5] skipped TF32: budget spent")
            return
        out = Path(tempfile.mkdtemp()) / "tf32.json"
        env = dict(os.environ, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1")
        p = subprocess.run([sys.executable, "-m", "tpcheck", "diff", "--preset", self.qwen, "--tp", "1", "--dtype",
                            "float32", "--device", self.dev, "--seq-len", str(self.seq), "--json", str(out), "--quiet"],
                           env=env, capture_output=True, text=True, timeout=max(30, int(self.left())))
        prec = json.loads(out.read_text())["meta"].get("effective_precision") if out.is_file() else None
        self.figures["tf32"] = {"exit": p.returncode, "effective_precision": prec}
        print(f"[5] TF32 override, float32 engine: exit {p.returncode}; effective precision {json.dumps(prec)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="the device under test (default cuda; cpu with --quick: a smoke "
                                                     "test)")
    ap.add_argument("--quick", action="store_true", help="small presets (the CPU smoke test)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per prompt (default 128; --quick 24)")
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--layers-8b", type=int, default=4, help="decoder layers of the 8B-shaped checkpoint")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections past this (default 450)")
    ap.add_argument("--peak-fp64-tflops", type=float, default=67.0, help="H200 float64 tensor-core peak")
    ap.add_argument("--peak-bf16-tflops", type=float, default=790.0, help="H200 bfloat16 dense peak")
    ap.add_argument("--out", default="gpu_check.json", help="the figures as JSON")
    a = ap.parse_args()
    c = Check(a)
    print(json.dumps({k: c.figures[k] for k in ("device", "gpus", "gpu", "torch", "cpu_threads")}))
    try:
        c.diffs()
        c.verdict_time()
        c.llama_8b()
        c.faults()
    finally:
        c.parts.close()
        c.pool.close()
    c.tf32()
    print("[6] CUDA graphs: not built yet")
    f = c.figures
    f["total_s"] = round(time.perf_counter() - c.t0, 1)
    f["passed"] = bool(c.ok) and all(c.ok)
    Path(a.out).write_text(json.dumps(f, indent=1) + "\n")
    print(f"gpu_check: {'PASS' if f['passed'] else 'FAIL'} in {f['total_s']}s (figures: {a.out})")
    return 0 if f["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
