"""What a sparse layer's ops allow (``tpcheck.measure.own_moe``), and what that costs in sensitivity.

Hugging Face at the run's dtype stands for the engine (its own kernels and roundings) on each MoE preset, one
prompt. Per preset and dtype it prints: the references' own error at ``moe.experts`` (HF at the dtype against the
float64 golden), the experts' and the block output's allowance ``B`` relative to the point (``||B|| / ||y||``) at
tp 1/2/4, and, for a noise-like error injected into the experts' output (each element plus ``r`` times its row's
RMS times N(0, 1)), the point's ``rel_err`` and its ``own_err``: where ``own_err`` stays within the threshold a
row over it passes as inherited (its inputs within their floors), so the ratio of the injected ``rel_err`` to the
threshold at which ``own_err`` crosses it is the blind spot the allowance buys.

    python benchmarks/moe_own_op.py [--presets tiny-qwen2-moe,tiny-mixtral] [--layer 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, however this script is run
from common import print_table  # noqa: E402

from tpcheck.inputs.models.checkpoints import cached_checkpoint  # noqa: E402
from tpcheck.judge.tolerances import Tolerances  # noqa: E402
from tpcheck.measure import own_moe  # noqa: E402
from tpcheck.measure.own_input import own_error  # noqa: E402
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache  # noqa: E402

PROMPT = [5, 17, 42, 9, 3, 77, 12, 250, 31, 8, 99, 140]
NOISE = {"bfloat16": (0.01, 0.02, 0.04, 0.06, 0.08), "float32": (1e-6, 2e-6, 4e-6, 1e-5, 1e-4)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny-qwen2-moe,tiny-mixtral")
    ap.add_argument("--layer", type=int, default=0, help="a sparse layer of every preset")
    a = ap.parse_args()
    root = tempfile.mkdtemp()
    rows = []
    for preset in a.presets.split(","):
        d = cached_checkpoint(preset, root=root)
        gold_model = load_hf_model(d, "float64")
        gold = HFCapture(gold_model).step([PROMPT], [new_cache(gold_model)], [0])
        for dtype in ("bfloat16", "float32"):
            model = load_hf_model(d, dtype)
            eng = HFCapture(model).step([PROMPT], [new_cache(model)], [0])
            n = f"layers.{a.layer}.moe.experts"
            if n not in eng:
                ap.error(f"{preset}: layer {a.layer} is not sparse")
            ref = _rel(eng[n], gold[n])
            thr = Tolerances().threshold("moe.experts", dtype, ref)
            allow = []
            for tp in (1, 2, 4):
                t = getattr(torch, dtype)
                for kind in ("moe.experts", "mlp.out"):
                    y, b = own_moe.op(model, a.layer, kind, eng.__getitem__, tp, t, t)
                    allow.append(f"{float(torch.as_tensor(b).expand_as(y).norm() / y.norm()):.2g}")
            e = eng[n].double()
            noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            rms = e.square().mean(-1, keepdim=True).sqrt()
            seeded = []
            for r in NOISE[dtype]:
                bad = (e + r * rms * noise).to(eng[n].dtype)
                own = own_error(model, n, bad, gold[n], eng.__getitem__)
                seeded.append(f"{r:g}: {_rel(bad, gold[n]) / thr:.2g}x / {own / thr:.2g}x")
            rows.append([preset, dtype, f"{ref:.3g}", f"{thr:.3g}", " ".join(allow), "; ".join(seeded)])
    print_table(["preset", "dtype", "HF's rel_err", "threshold (no floors)",
                 "B/|y| experts, mlp.out at tp 1, 2, 4", "noise r: rel_err / own_err over the threshold"], rows)


if __name__ == "__main__":
    main()
