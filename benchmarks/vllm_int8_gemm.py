"""vLLM's CPU INT8 GEMM (``_C.onednn_scaled_mm``, the oneDNN path ``CPUInt8ScaledMMLinearKernel`` takes on a CPU
without AMX) against the exact int32 GEMM and against ``tpcheck.engines.vllm.int8.pair_saturating_gemm``, the
model of oneDNN's non-VNNI int8 path (int16 sums of adjacent u8 x s8 products, saturating).

Unit scales and a float32 output, so the op's output is its int32 accumulator (below 2^24: exact in float32).
Crafted operands: weights uniform in +-127 / +-64 / +-63 with activations uniform in +-127 or near the ends
(|x| 100..127), then the one pair ``x = (127, 127)``, ``w = (127, 127)``; with ``--model DIR`` (INT8 W8A8
compressed-tensors checkpoints), each one's layer-0 ``q_proj`` and ``down_proj`` int8 weights on activations drawn
normal and quantized per token by vLLM's own ``onednn_scaled_int8_quant``. Run it in vLLM's virtual environment:

    python benchmarks/vllm_int8_gemm.py [--model DIR ...] [--preset small-w8a8,small-w8a8-tensor]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tpcheck.engines.vllm.int8 import exact_int8_gemm, pair_saturating_gemm, saturated_pairs  # noqa: E402


def vllm_acc(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vLLM's op with unit scales (float32 output): its int32 accumulator. ``w`` ``[K, N]`` int8."""
    from vllm import _custom_ops as ops
    n = w.shape[1]
    ws = torch.ones(n, 1)  # the handler keeps a pointer to the scales, not a copy: alive until the GEMM ran
    h = ops.create_onednn_scaled_mm(w.t().contiguous().t(), ws, torch.float32, True, False, 32)  # [K, N], K-major
    out = torch.empty(xq.shape[0], n, dtype=torch.float32)
    ops.onednn_scaled_mm(h, xq.contiguous(), out, torch.ones(xq.shape[0], 1), None, None, None)
    return out.double()


def row(label: str, xq: torch.Tensor, w: torch.Tensor) -> str:
    got, ex, emu = vllm_acc(xq, w), exact_int8_gemm(xq, w), pair_saturating_gemm(xq, w)
    rel = ((got - ex).norm() / ex.norm()).item()
    return (f"| {label} | {rel:.3g} | {(got != ex).float().mean().item():.4f} | {saturated_pairs(xq, w):.4f} | "
            f"{'yes' if torch.equal(got, emu) else 'NO'} |")


def crafted(g: torch.Generator) -> list[str]:
    out = []
    m, k, n = 16, 128, 64
    for wmax in (127, 64, 63):
        w = torch.randint(-wmax, wmax + 1, (k, n), dtype=torch.int8, generator=g)
        uni = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1, 1)
        ends = (torch.randint(100, 128, (m, k), generator=g) * sign).to(torch.int8)
        out += [row(f"w uniform +-{wmax}, x uniform +-127", uni, w), row(f"w uniform +-{wmax}, x in +-[100, 127]", ends, w)]
    xq = torch.zeros(1, k, dtype=torch.int8)
    xq[0, :2] = 127
    w = torch.zeros(k, n, dtype=torch.int8)
    w[:2, 0] = 127
    got, ex = vllm_acc(xq, w)[0, 0].item(), exact_int8_gemm(xq, w)[0, 0].item()
    print(f"one pair x = (127, 127), w = (127, 127): exact {ex:.0f}, vLLM {got:.0f}, "
          f"model {pair_saturating_gemm(xq, w)[0, 0].item():.0f} (sat16(2 * 255 * 127) - 128 * 254 = 32767 - 32512)")
    return out


def checkpoint(label: str, d: str, g: torch.Generator) -> list[str]:
    from safetensors.torch import load_file
    from vllm import _custom_ops as ops
    t = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        t.update(load_file(f))
    out = []
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        wq = t[name]  # [N, K] int8
        reach = (wq.abs().amax(1) == 127).float().mean().item()
        x = torch.randn(64, wq.shape[1], generator=g)
        xq, _, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        out.append(row(f"{label} {name[15:]} ({reach:.0%} of rows reach 127)", xq, wq.t()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="*", default=[], help="INT8 W8A8 checkpoint directories")
    ap.add_argument("--preset", default="small-w8a8,small-w8a8-tensor", help="INT8 presets, comma-separated ('' none)")
    args = ap.parse_args()
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    g = torch.Generator().manual_seed(0)
    rows = crafted(g)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [(d, d) for d in args.model] + [(p, str(cached_checkpoint(p, root=tmp)))
                                               for p in args.preset.split(",") if p]
        for label, d in dirs:
            rows += checkpoint(label, d, g)
    print("| operands | rel. error vs exact int32 | outputs wrong | int16 pair sums saturated | vLLM == model |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
