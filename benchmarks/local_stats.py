"""The noise floor's and the gain's statistics of one local-pass step, one source tree against another.

On ``qwen2.5-0.5b``-shaped float64 goldens of one 128-token prompt (``--layers`` layers of the 15 per-layer
kinds, and the logits): both references observed by a ``NoiseFloor`` with gains (the TP reference's tensor is the
first reference's, bit for bit, before ``o_proj`` and at the logits, as in a local pass), and the engine's own
``gain_of``. CPU seconds of this process (``time.process_time``: steadier than wall time on a shared machine),
the trees alternating ``--repeats`` times; medians, min and max.

    python benchmarks/local_stats.py OLD_TREE NEW_TREE [--layers 4] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {"input_norm": 896, "attn.q": 896, "attn.k": 128, "attn.v": 128, "attn.q_rope": 896, "attn.k_rope": 128,
          "attn.context": 896, "attn.out": 896, "attn.residual": 896, "post_attn_norm": 896, "mlp.gate": 4864,
          "mlp.up": 4864, "mlp.act": 4864, "mlp.out": 896, "out": 896}
BEFORE_O_PROJ = {"input_norm", "attn.q", "attn.k", "attn.v", "attn.q_rope", "attn.k_rope", "attn.context"}


def load(root: str):
    """``(gain_of, NoiseFloor, Reductions)`` of the tree at ``root``."""
    for m in [k for k in sys.modules if k.startswith("tpcheck")]:
        del sys.modules[m]
    sys.path.insert(0, root)
    try:
        from tpcheck.judge.noise_floor import NoiseFloor
        from tpcheck.measure.gain import gain_of
        from tpcheck.reference.reductions import Reductions
    finally:
        sys.path.pop(0)
    return gain_of, NoiseFloor, Reductions


def points(layers: int) -> dict:
    """``{point: (golden, first reference, TP reference)}``: references 1e-6 off, the same bits where they agree."""
    torch.manual_seed(0)
    near = lambda g: (g + 1e-6 * torch.randn_like(g)).float()  # noqa: E731
    out = {}
    for i in range(layers):
        for kind, features in SHAPES.items():
            g = torch.randn(128, features, dtype=torch.float64)
            a = near(g)
            out[f"layers.{i}.{kind}"] = (g, a, a if kind in BEFORE_O_PROJ else near(g))
    g = torch.randn(128, 151936, dtype=torch.float64)
    a = near(g)
    out["logits"] = (g, a, a)
    return out


def step(tree, pts: dict) -> float:
    gain_of, NoiseFloor, Reductions = tree
    t = time.process_time()
    floor = NoiseFloor(Reductions(2), gains=True)
    floor.begin_step(0)
    for p, (g, a, b) in pts.items():
        floor.observe("hf", p, a, g)
        floor.observe("hf-tp", p, b, g)
        gain_of(a, g)  # the engine's gain row
    floor.end_step()
    return time.process_time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    pts = points(a.layers)
    trees = {"old": load(a.old), "new": load(a.new)}
    cpu: dict[str, list[float]] = {n: [] for n in trees}
    for i in range(a.repeats):
        for name, tree in trees.items():
            cpu[name].append(step(tree, pts))
        print(f"run {i + 1}: " + ", ".join(f"{n} {v[-1]:.2f} CPU s" for n, v in cpu.items()), flush=True)
    o, n = statistics.median(cpu["old"]), statistics.median(cpu["new"])
    print(f"{a.layers} layers + logits: old {o:.2f} CPU s ({min(cpu['old']):.2f}-{max(cpu['old']):.2f}), "
          f"new {n:.2f} ({min(cpu['new']):.2f}-{max(cpu['new']):.2f}): {o / n:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
