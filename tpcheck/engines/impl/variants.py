"""Correct engines that round otherwise: impl patched, inside its ranks, to compute the same sums in another order
than Hugging Face does, as real engines do. Each is right to its dtype, so a diff of it must pass; the tests hold
the noise floor to that on every configuration they run (a floor calibrated to HF's own order would fail them).

* ``rank_order_allreduce``: each row-parallel all-reduce (o_proj, down_proj) gathers the ranks' partial sums and
  adds them in the activations' dtype starting from the rank's own, ``p_r + p_{r+1} + ... + p_{r-1}``: vLLM's CPU
  shared-memory all-reduce. At tp >= 3 the ranks round the same sum differently, so the replicated activations
  (the residual stream, the norms, the logits) differ by ulps from rank to rank; where a sum cancels (a massive
  activation's ``mlp.out``) by the size of the error against the golden. In a mixture-of-experts model each rank
  routes its own copy of the hidden state, so at a near tie the ranks may pick different experts for a token and
  the all-reduce then mixes their shards: not a rounding but a wrong sum, which the diff reports at
  ``moe.topk_ids`` (ranks holding different ids). Measured there, not hidden.
* ``sequential_k``: every linear layer of the decoder accumulates its dot products one term at a time in float32,
  ``((x_1 w_1 + x_2 w_2) + x_3 w_3) + ...``, then adds the bias and rounds once to the dtype: the textbook order
  whose rounding error grows like ``sqrt(K)`` where a blocked BLAS kernel's grows like that of its blocks. The
  slowest correct order short of a lower precision (each product is exact in float32 for bfloat16 and float16
  operands; the accumulator is float32, as every engine's is).
* ``truncate_bf16``: every linear layer of the decoder computes in float32 and *truncates* its result to
  bfloat16 (rounds toward zero) instead of rounding to nearest: vLLM's CPU kernels on a CPU without AVX512-BF16.
  Not right to bfloat16 as HF rounds it: each result shrinks by half an ulp on average, which the local pass's gain
  reads; right under its declaration (``--rounding truncate``: ``tpcheck.capture.rounding``), which the diff must
  then pass. In other dtypes it changes nothing.

``apply(runner, names)`` patches one rank (run on every rank: ``llm.call(apply, names)``); ``llm.reload()`` undoes
it, as for faults (``tpcheck.engines.impl.faults.engine``)."""
from __future__ import annotations

import torch

from impl.distributed import all_gather, get_tp_rank, get_tp_size, rank_order_sum

VARIANTS = ("rank_order_allreduce", "sequential_k", "truncate_bf16")
ROUND_TO_NEAREST = ("rank_order_allreduce", "sequential_k")  # right under the default declaration (nearest)
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


__all__ = ["VARIANTS", "ROUND_TO_NEAREST", "apply", "rank_order_sum"]  # rank_order_sum: impl's, a rank's own order


def _rank_order_allreduce(m) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = m.matmul(x, m.bias if m.tp_rank == 0 else None)
        if not m.reduce_results or get_tp_size() == 1:
            return y
        return rank_order_sum(all_gather(y.unsqueeze(0), dim=0), get_tp_rank())
    m.forward = forward


def sequential_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x w^T + bias`` accumulated over the input features one at a time in float32, rounded once to x's dtype."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)
    for k in range(w.shape[1]):
        acc.add_(xf[..., k:k + 1] * wf[:, k])
    if bias is not None:
        acc.add_(bias.float())
    return acc.to(x.dtype)


def _sequential_k(m) -> None:
    if m.quant_method is not None:
        raise ValueError(f"sequential_k: {type(m).__name__} is quantized; the variant computes float weights only")
    m.matmul = lambda x, bias: sequential_matmul(x, m.weight, bias)


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded toward zero to bfloat16: its low 16 bits cleared (NaN and inf kept)."""
    bits = x.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the cleared value is a bfloat16


def _truncate_bf16(m) -> None:
    if m.quant_method is not None:
        raise ValueError(f"truncate_bf16: {type(m).__name__} is quantized; the variant computes float weights only")
    inner = m.matmul

    def matmul(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return inner(x, bias)
        y = x.float() @ m.weight.float().T
        return truncate_to_bf16(y + bias.float() if bias is not None else y)
    m.matmul = matmul


def apply(runner, names: list[str] | str) -> list[str]:
    """Patch this rank's loaded model with the variants ``names`` (``VARIANTS``); returns them."""
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}: one of {', '.join(VARIANTS)}")
    for layer in runner.model.model.layers:
        for path in _LINEARS:
            try:
                m = layer.get_submodule(path)
            except AttributeError:  # a mixture-of-experts layer has no dense MLP: its attention is patched
                continue
            if "sequential_k" in names:
                _sequential_k(m)
            if "truncate_bf16" in names:
                _truncate_bf16(m)
            if "rank_order_allreduce" in names and path in ("self_attn.o_proj", "mlp.down_proj"):
                _rank_order_allreduce(m)
    return names

