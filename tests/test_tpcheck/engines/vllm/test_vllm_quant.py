"""Real vLLM (the CPU build) on quantized checkpoints: quantization faults seeded inside one rank
(``tpcheck.engines.vllm.quant_faults``, live scales changed after vLLM's ``process_weights_after_loading``) found at
their origin on FP8 W8A8 per channel (``small-fp8``), and vLLM's INT8 GEMM held to the model of its int16-saturating
non-VNNI path (``tpcheck.engines.vllm.int8``) on crafted operands.

vLLM tests, skipped without vLLM (the main venv); ``.ci/vllm`` runs this file. The fault functions' slot arithmetic
and the GEMM model without vLLM are in ``test_vllm_quant_faults.py``."""
from __future__ import annotations

import pytest
import torch

from tpcheck.engines.vllm.int8 import exact_int8_gemm, pair_saturating_gemm

from test_vllm import PROMPTS, vllm_env  # noqa: F401 - the vLLM environment fixture (test_vllm.py's)


def _onednn_acc(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vLLM's int8 GEMM with unit scales and a float32 output: its int32 accumulator (``w`` ``[K, N]``)."""
    from vllm import _custom_ops as ops
    ws = torch.ones(w.shape[1], 1)  # the handler keeps a pointer to it: alive until the GEMM ran
    h = ops.create_onednn_scaled_mm(w.t().contiguous().t(), ws, torch.float32, True, False, 32)
    out = torch.empty(xq.shape[0], w.shape[1], dtype=torch.float32)
    ops.onednn_scaled_mm(h, xq.contiguous(), out, torch.ones(xq.shape[0], 1), None, None, None)
    return out.double()


def test_vllm_int8_gemm_is_the_pair_saturating_model(vllm_env):  # noqa: F811 - the imported fixture
    """On a CPU without AVX512-VNNI vLLM's int8 GEMM is, bit for bit, int16-saturating sums of adjacent u8 x s8
    products: wrong against the exact int32 GEMM with weights of +-127, exact within +-64. With VNNI (``vpdpbusd``,
    int32 sums) it is exact everywhere."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (8, 128), dtype=torch.int8, generator=g)
    wide = torch.randint(-127, 128, (128, 32), dtype=torch.int8, generator=g)
    narrow = (wide.to(torch.int16) // 2).to(torch.int8)  # within +-64
    assert torch.equal(_onednn_acc(xq, narrow), exact_int8_gemm(xq, narrow))
    got = _onednn_acc(xq, wide)
    if vnni:
        assert torch.equal(got, exact_int8_gemm(xq, wide))
    else:
        assert torch.equal(got, pair_saturating_gemm(xq, wide))
        assert ((got - exact_int8_gemm(xq, wide)).norm() / exact_int8_gemm(xq, wide).norm()) > 0.05


@pytest.fixture(scope="module")
def fp8(vllm_env, tmp_path_factory):  # noqa: F811 - the imported fixture
    """``small-fp8`` (FP8 W8A8, per-channel weight scales) on vLLM at tp 2, bfloat16: one engine for every fault."""
    from tpcheck.engines.pool import EnginePool
    from tpcheck.engines.vllm.adapter import start
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.plan import RunPlan
    ckpt = cached_checkpoint("small-fp8", root=tmp_path_factory.mktemp("vllm-fp8"))
    pool = EnginePool()
    eng = start(pool, RunPlan.of(DiffOptions.of(model=str(ckpt), tp=2, dtype="bfloat16", prompts=PROMPTS,
                                                decode_steps=1)))
    yield eng, ckpt
    pool.close()  # stops vLLM's workers


def _diff(fp8, faults):
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.result.meta import RunOrigin
    eng, ckpt = fp8
    eng.faults = list(faults)
    try:
        opts = DiffOptions(model=str(ckpt), prompts=PROMPTS, decode_steps=1, dtype="bfloat16")
        return compare(eng, opts, origin=RunOrigin(tp=2, engine="vllm", command="test_vllm_quant"))
    finally:
        eng.faults = []


@pytest.mark.parametrize("fault,origin", [
    ("qkv-scale-rank0-rows", "layers.0.attn.q"),   # rank 1's q/k/v channel scales are rank 0's rows
    ("qkv-scale-k-v-swapped", "layers.0.attn.k"),  # rank 1's k and v scale slots swapped
])
def test_vllm_quant_fault_in_one_rank_found_at_its_origin(fp8, fault, origin):
    """A scale fault in rank 1's live parameters fails the run at the point it first changes, by the noise
    floor."""
    result = _diff(fp8, [(fault, 0, 1)])
    assert not result.passed
    assert f"origin: {origin} (step 0" in result.summary(), result.summary()


def test_vllm_quant_faults_are_undone(fp8):
    """After the faults above (run first: file order), the same engine passes: each fault's scale was put back
    at the end of its diff (``tpcheck_unfault``)."""
    clean = _diff(fp8, [])
    assert clean.passed, clean.summary()
