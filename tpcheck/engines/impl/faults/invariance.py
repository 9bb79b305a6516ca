"""Faults that break batch invariance only: each one is correct arithmetic (within float noise of HF, so
``tpcheck diff`` passes it), but makes a request's bits depend on what else is in its batch, the way production
kernels do. ``tpcheck invariance`` finds them at their origin under the schedule that exercises them (``schedule``:
"batch", the probe beside companions, with impl's ``--batch-invariant`` mode on so that nothing else varies), and
not under schedules that keep the step's token count as small as the probe's alone (a prefix-cache hit, a chunked
prefill).

Both choose their reduction's blocking by the step's token count ``T`` (every sequence's new tokens), as a
GEMM or a fused-norm kernel picks a split-K or a block width by the problem's size: one block up to
``SPLIT_ABOVE`` tokens, two halves added after above it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impl import batch_invariant
from tpcheck.engines.impl.faults.patching import mark
from tpcheck.engines.impl.faults.registry import fault

SPLIT_ABOVE = 32  # tokens in a step above which the faulty kernels split their reduction in two


def _split_k_matmul(linear):
    """``linear.matmul`` with the K reduction split in two halves (added after) when the step has more than
    ``SPLIT_ABOVE`` rows: a split-K chosen by the batch's token count. Rows stay in fixed blocks
    (``impl.batch_invariant.linear``), so the split is the only thing the batch changes."""
    def matmul(x, bias):
        w = linear.weight
        if x.shape[0] <= SPLIT_ABOVE:
            return batch_invariant.linear(x, lambda rows: F.linear(rows, w, bias))
        k = w.shape[1] // 2

        def split(rows):
            y = F.linear(rows[:, :k], w[:, :k]) + F.linear(rows[:, k:], w[:, k:])
            return y if bias is None else y + bias
        return batch_invariant.linear(x, split)

    return matmul


@fault(59, "gemm_split_by_batch_tokens",
       "o_proj's GEMM splits its K reduction in two when the step has more than 32 tokens (a split-K chosen by the "
       "batch's token count): the same request's attn.out changes in its last bits when batched",
       shows_when="tpcheck invariance --batch-invariant with a batched schedule of more than 32 tokens a step; "
                  "tpcheck diff passes it (float noise)",
       expected_origin="layers.{layer}.attn.out", check="invariance", schedule="batch")
def gemm_split_by_batch_tokens(runner, i, layer):
    o = layer.self_attn.o_proj
    if mark(o, "gemm_split_by_batch_tokens") and o.quant_method is None:
        o.matmul = _split_k_matmul(o)


def _llama_norm(cfg, plan, dtype) -> bool:
    """A model whose norms cast back before scaling (the patch's op order; Gemma 3 scales first)."""
    return getattr(cfg, "gemma", None) is None


def _norm_split_by_rows(norm):
    """RMSNorm whose sum of squares is reduced in two halves of the hidden dim (added after) when the padded
    batch has more than ``SPLIT_ABOVE`` rows: the kernel's block width chosen by the batch."""
    def forward(x):
        dtype = x.dtype
        h = x.to(torch.float32)
        if x.shape[0] > SPLIT_ABOVE:
            half = h.shape[-1] // 2
            ss = h[..., :half].pow(2).sum(-1, keepdim=True) + h[..., half:].pow(2).sum(-1, keepdim=True)
            var = ss / h.shape[-1]
        else:
            var = h.pow(2).mean(-1, keepdim=True)
        return norm.weight * (h * torch.rsqrt(var + norm.eps)).to(dtype)

    return forward


@fault(60, "rmsnorm_split_by_padded_batch",
       "the input RMSNorm reduces its sum of squares in two halves when the padded batch has more than 32 rows "
       "(a block width chosen by the batch): the same request's input_norm changes in its last bits when batched",
       shows_when="tpcheck invariance --batch-invariant with a batched schedule of more than 32 tokens a step; "
                  "tpcheck diff passes it (float noise)",
       expected_origin="layers.{layer}.input_norm", check="invariance", schedule="batch", shows=_llama_norm)
def rmsnorm_split_by_padded_batch(runner, i, layer):
    norm = layer.input_layernorm
    if mark(norm, "rmsnorm_split_by_padded_batch"):
        norm.forward = _norm_split_by_rows(norm)
