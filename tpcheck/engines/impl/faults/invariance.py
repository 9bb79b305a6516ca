"""Faults that break invariance only under a schedule: each one is correct arithmetic (within float noise of HF,
so ``tpcheck diff`` passes it), but makes a request's bits depend on what else is in its batch, on its batch slot
or on how its prompt was fed, the way production kernels do. ``tpcheck invariance`` finds them at their origin
under the schedule that exercises them (``schedule``, with impl's ``--batch-invariant`` mode on so that nothing
else varies; ``tpcheck.cli.fault_invariance`` runs each), and not under the schedules that do not:

* "batch": the probe beside companions (``--batch 1,8``); quiet on a prefix-cache hit and a chunked prefill (never
  more tokens or sequences a step than the probe alone). ``gemm_split_by_batch_tokens`` and
  ``rmsnorm_split_by_padded_batch`` choose their reduction's blocking by the step's token count ``T``, as a GEMM
  or a fused-norm kernel picks a split-K or a block width by the problem's size (one block up to ``SPLIT_ABOVE``
  tokens, two halves added after above it); ``mlp_split_by_batch_size`` by the number of sequences in the step.
* "slot": the probe at a batch slot > 0 (``--batch 1,8 --slot 3``); quiet at slot 0 of the same batch.
* "chunk": a prefill that starts at a cached position (``--chunk 5``; a prefix-cache hit does too); quiet batched
  (``--batch 1,8``: every prefill from position 0, decode one query at a time)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from impl import batch_invariant
from impl.context import get_context
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


def _split_k_by_sequences(linear):
    """``linear.matmul`` with the K reduction split in two halves (added after) when the step runs more than one
    sequence: a reduction split chosen by the batch size. Rows stay in fixed blocks, as above."""
    def matmul(x, bias):
        w, k = linear.weight, linear.weight.shape[1] // 2
        if len(get_context().seq_lens_q) <= 1:
            return batch_invariant.linear(x, lambda rows: F.linear(rows, w, bias))

        def split(rows):
            y = F.linear(rows[:, :k], w[:, :k]) + F.linear(rows[:, k:], w[:, k:])
            return y if bias is None else y + bias
        return batch_invariant.linear(x, split)

    return matmul


def _dense(cfg, plan, dtype) -> bool:
    """A model whose MLPs are dense (a MoE layer has no single down_proj)."""
    return getattr(cfg, "moe", None) is None


@fault(61, "mlp_split_by_batch_size",
       "the MLP's down_proj splits its K reduction in two when the step runs more than one sequence (a split chosen "
       "by the batch size): the same request's mlp.out changes in its last bits when batched",
       shows_when="tpcheck invariance --batch-invariant with a batched schedule; tpcheck diff passes it (float "
                  "noise)",
       expected_origin="layers.{layer}.mlp.out", check="invariance", schedule="batch", shows=_dense)
def mlp_split_by_batch_size(runner, i, layer):
    down = layer.mlp.down_proj
    if mark(down, "mlp_split_by_batch_size") and down.quant_method is None:
        down.matmul = _split_k_by_sequences(down)


def _attend(attn, q, ks, vs, mask=None):
    """One query ``[heads, d]`` over keys and values ``[L, kv_heads, d]`` (``mask``: ``[L]``, True attends)."""
    return attn._sdpa(q[None, None], ks[None], vs[None], None if mask is None else mask.view(1, 1, 1, -1))[0, 0]


def _per_query(attn, one):
    """``attn``'s per-query attention (``Attention._per_query``: each query alone over the keys it sees) with
    ``one(i, j, q, ks, vs, lo, p, lq, lk, prev) -> [heads, d]`` computing query ``j`` of sequence ``i`` (``prev``:
    the previous sequence's keys and values in the step, None for the first); run in both modes (the default
    mode's prefill and decode call it too), so the diff judges the faulty arithmetic."""
    def per_query(q, k, v, ctx):
        out, start, w, prev = torch.empty_like(q), 0, attn.sliding_window, None
        for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
            ks, vs = attn.seq_keys(q, k, v, ctx, i, start)
            for j in range(lq):
                p = lk - lq + j
                lo = 0 if w is None else max(0, p - w + 1)
                out[start + j] = one(i, j, q[start + j], ks, vs, lo, p, lq, lk, prev)
            prev, start = (ks, vs), start + lq
        return out

    attn._per_query, attn._prefill = per_query, per_query
    attn._decode = lambda q, ctx: per_query(q, None, None, ctx)  # decode reads every key from the cache


def _neighbour_kv(attn):
    """A sequence at slot > 0 reads the previous sequence's keys and values too, before its own, masked out (a
    kernel over a KV block shared between requests): the masked keys add nothing, but the reduction runs over
    another length, in another order."""
    def one(i, j, q, ks, vs, lo, p, lq, lk, prev):
        if prev is None:
            return _attend(attn, q, ks[lo:p + 1], vs[lo:p + 1])
        kq, vq = torch.cat([prev[0], ks[lo:p + 1]]), torch.cat([prev[1], vs[lo:p + 1]])
        return _attend(attn, q, kq, vq, torch.arange(kq.shape[0], device=q.device) >= prev[0].shape[0])
    _per_query(attn, one)


@fault(62, "attention_reads_neighbour_kv_at_slot",
       "a request batched at a slot > 0 attends over the previous request's keys and values too, masked out (a KV "
       "block shared between requests): its attn.context changes in its last bits with its slot",
       shows_when="tpcheck invariance --batch-invariant with the probe at a batch slot > 0; tpcheck diff passes it "
                  "(float noise)",
       expected_origin="layers.{layer}.attn.context", check="invariance", schedule="slot")
def attention_reads_neighbour_kv_at_slot(runner, i, layer):
    _patch_attention(layer, "attention_reads_neighbour_kv_at_slot", _neighbour_kv)


def _split_at_chunk(attn):
    """A prefill that starts at a cached position attends in two parts, the cached keys and this step's, merged by
    their log-sum-exps (a split at the chunk boundary, as a chunked-prefill kernel's): exact in real numbers, in
    another order in floats. A prefill from position 0 and a decode (one query) attend in one part."""
    def one(i, j, q, ks, vs, lo, p, lq, lk, prev):
        cut = lk - lq  # the cached positions
        if lq == 1 or cut <= lo:
            return _attend(attn, q, ks[lo:p + 1], vs[lo:p + 1])
        parts = [(ks[lo:cut], vs[lo:cut]), (ks[cut:p + 1], vs[cut:p + 1])]
        outs = [_attend(attn, q, a, b).float() for a, b in parts]
        lse = [_logsumexp(attn, q, a) for a, _ in parts]
        m = torch.maximum(*lse)
        wa, wb = (lse[0] - m).exp(), (lse[1] - m).exp()
        return ((outs[0] * wa[:, None] + outs[1] * wb[:, None]) / (wa + wb)[:, None]).to(q.dtype)
    _per_query(attn, one)


def _logsumexp(attn, q, ks) -> torch.Tensor:
    """Per query head, in float32: ``log sum_j exp(scale * q . k_j)`` over keys ``ks [L, kv_heads, d]`` (GQA)."""
    rep = q.shape[0] // ks.shape[1]
    k = ks.float().repeat_interleave(rep, dim=1)
    return torch.logsumexp(torch.einsum("hd,lhd->hl", q.float(), k) * attn.scale, dim=-1)


@fault(63, "attention_split_at_chunk_boundary",
       "a prefill that starts at a cached position (a chunk after the first, a prefix-cache hit) attends in two "
       "parts merged by their log-sum-exps: the same request's attn.context changes in its last bits when chunked",
       shows_when="tpcheck invariance --batch-invariant with --chunk N (or --prefix-cache); tpcheck diff passes it "
                  "(float noise)",
       expected_origin="layers.{layer}.attn.context", check="invariance", schedule="chunk")
def attention_split_at_chunk_boundary(runner, i, layer):
    _patch_attention(layer, "attention_split_at_chunk_boundary", _split_at_chunk)


def _patch_attention(layer, name: str, patch) -> None:
    """``patch(attn)`` on ``layer``'s attention, once."""
    if mark(layer.self_attn.attn, name):
        patch(layer.self_attn.attn)
