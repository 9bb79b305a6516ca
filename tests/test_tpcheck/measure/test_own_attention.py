"""Whose error is it at attention's points (``tpcheck.measure.own_attention``): RoPE and the attention context
recomputed in float64 on the engine's own inputs; a correct kernel (Hugging Face's, float32 and bfloat16, a
prefill and a decode step reading the cache) has no own error, bugs of attention have theirs at full size."""
from __future__ import annotations

import math

import pytest
import torch

from tpcheck.judge import judge
from tpcheck.measure import own_attention
from tpcheck.measure.own_attention import RowLayout, written
from tpcheck.measure.own_input import own_error
from tpcheck.reference.hf import HFCapture, new_cache
from tpcheck.result.table import DiffResult, Row

PROMPT = [5, 17, 42, 9, 33, 2, 8, 100, 7]


def _steps(model):
    """A 9-token prefill and one decode step, each with the cache read back."""
    cap, cache = HFCapture(model), [new_cache(model)]
    return cap.step([PROMPT], cache, [0], with_kv=True), cap.step([[11]], cache, [len(PROMPT)], with_kv=True)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3"])  # Llama-like; per-head q/k norms, a RoPE base per layer
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_kernel_has_no_own_error_and_attention_bugs_do(ckpt, hf_model, preset, dtype):
    d = ckpt(preset)
    (g0, g1), (e0, e1) = _steps(hf_model(d, "float64")), _steps(hf_model(d, dtype))
    model = hf_model(d, dtype)
    prefill, decode = RowLayout([9], [0], [9]), RowLayout([1], [9], [10])
    for layer in (0, 1):  # the KV cache's op: the keys and values the steps wrote
        for c, p in (("k", "k_rope"), ("v", "v")):
            n, at = f"layers.{layer}.kv.{c}", f"layers.{layer}.attn.{p}"
            e0[written(n)], e1[written(n)] = e0[at], torch.cat([e0[at], e1[at]])
    for layer in (0, 1):
        for kind in own_attention.KINDS:
            n = f"layers.{layer}.{kind}"
            assert own_error(model, n, e0[n], g0[n], e0.__getitem__, layout=prefill) == 0, n
            assert own_error(model, n, e1[n], g1[n], e1.__getitem__, layout=decode) == 0, n
    n = "layers.1.attn.context"
    rel = float((e1[n].double() - g1[n]).norm() / g1[n].norm())

    def engine(kind, get, layout):  # what a buggy engine computes: the op on other inputs or positions
        y, _ = own_attention.op(model, 1, kind, get, layout, e1[n].dtype)
        return y.to(e1[n].dtype)

    dropped = {**e1, "layers.1.kv.k": e1["layers.1.kv.k"][1:], "layers.1.kv.v": e1["layers.1.kv.v"][1:]}
    assert own_error(model, n, engine("attn.context", dropped.__getitem__, RowLayout([1], [8], [9])), g1[n],
                     e1.__getitem__, layout=decode) > 0.05  # the first key dropped (a block lost, a window too short)
    q = "layers.1.attn.q_rope"
    assert own_error(model, q, engine("attn.q_rope", e1.__getitem__, RowLayout([1], [10], [11])), g1[q],
                     e1.__getitem__, layout=decode) > 0.05  # RoPE at the next position
    kv = "layers.1.kv.k"
    stale = e1[kv].clone()
    stale[-1] = e1[kv][-2]  # the new key written one slot back: the cache holds a stale key where it should be
    assert own_error(model, kv, stale, g1[kv], e1.__getitem__, layout=decode) > 0.05
    scaled = (e1[n].double() * (1 + 2 ** -10)).to(e1[n].dtype)  # a 2^-10 gain: 16 float32 ulps, under bfloat16's
    err = own_error(model, n, scaled, g1[n], e1.__getitem__, layout=decode)
    assert (err > 0.5 * 2 ** -10) if dtype == "float32" else (err < 0.1 * rel), err
    assert math.isnan(own_error(model, n, e1[n], g1[n], e1.__getitem__))  # no layout: not recomputed


def test_a_blocked_online_softmax_in_float32_is_within_its_allowance(ckpt, hf_model):
    """Another correct kernel design than HF's: keys in blocks of 2, the running max and sum rescaled at each block,
    the scale applied to q first (vLLM's CPU and flash attention's way)."""
    d = ckpt("tiny")
    model = hf_model(d, "float32")
    (g0, _), (e0, _) = _steps(hf_model(d, "float64")), _steps(model)
    attn = model.model.layers[1].self_attn
    hd = attn.head_dim
    q = (e0["layers.1.attn.q_rope"].view(9, -1, hd) * attn.scaling).transpose(0, 1)
    k = e0["layers.1.kv.k"].view(9, -1, hd).repeat_interleave(q.shape[0] // (e0["layers.1.kv.k"].shape[1] // hd), 1)
    v = e0["layers.1.kv.v"].view(9, -1, hd).repeat_interleave(q.shape[0] // (e0["layers.1.kv.v"].shape[1] // hd), 1)
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    m = torch.full(q.shape[:2] + (1,), -math.inf)
    den, acc = torch.zeros_like(m), torch.zeros_like(q)
    causal = torch.arange(9)[None, :, None] >= torch.arange(9)[None, None, :]
    for j in range(0, 9, 2):
        s = (q @ k[:, j:j + 2].transpose(1, 2)).masked_fill(~causal[..., j:j + 2], -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
        den, acc, m = den * alpha + p.sum(-1, keepdim=True), acc * alpha + p @ v[:, j:j + 2], m_new
    y = (acc / den).transpose(0, 1).reshape(9, -1)
    n = "layers.1.attn.context"
    assert not torch.equal(y, e0[n])  # it rounds otherwise than HF's eager attention ...
    assert own_error(model, n, y, g0[n], e0.__getitem__, layout=RowLayout([9], [0], [9])) == 0  # ... correctly


def _row(point, rel, own=math.nan, step=0):
    layer = int(point.split(".")[1])
    return Row(point=point, layer=layer, step=step, mode="isolated", kind=point.split(".", 2)[-1], rel_err=rel,
               ref_rel_err=1e-6, own_err=own)


@pytest.mark.parametrize("kv", [True, False])
def test_the_context_is_inherited_when_its_inputs_passed(kv):
    inputs = ["layers.0.attn.q_rope"] + (["layers.0.kv.k", "layers.0.kv.v"] if kv else
                                         ["layers.0.attn.k_rope", "layers.0.attn.v"])
    rows = [_row(p, 1e-6) for p in inputs] + [_row("layers.0.attn.context", 1e-3, own=1e-7)]
    t = judge(DiffResult.from_rows(rows, {"dtype": "float32", "tp": 1, "num_layers": 1})).table.set_index("point")
    assert t.loc["layers.0.attn.context", "inherited"] and t.loc["layers.0.attn.context", "passed"]
    rows[0] = _row(inputs[0], 1.0)  # its queries failed: the context's error is theirs, and reported there
    t = judge(DiffResult.from_rows(rows, {"dtype": "float32", "tp": 1, "num_layers": 1})).table.set_index("point")
    assert not t.loc["layers.0.attn.context", "passed"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_redoes_the_per_head_norm_where_the_run_did_not_record_it(ckpt, hf_model, dtype):
    """SGLang's dumper does not read Gemma 3's per-head q / k norms: RoPE's op is then redone from the projection
    (norm, then rotation), so a correct engine still has no own error at ``attn.q_rope`` / ``attn.k_rope``, and a
    norm applied wrongly (its weight without Gemma's ``1 +``) is the op's own error at full size."""
    d = ckpt("tiny-gemma3")
    (g0, _), (e0, _) = _steps(hf_model(d, "float64")), _steps(hf_model(d, dtype))
    model = hf_model(d, dtype)
    prefill = RowLayout([9], [0], [9])
    dumped = {p: t for p, t in e0.items() if not p.endswith(("q_norm", "k_norm"))}
    for kind in own_attention.ROPE_KINDS:
        for layer in (0, 1):
            n = f"layers.{layer}.{kind}"
            assert own_error(model, n, e0[n], g0[n], dumped.__getitem__, layout=prefill) == 0, n
    n, attn = "layers.1.attn.q_rope", model.model.layers[1].self_attn
    norm = attn.q_norm
    w = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.sub_(1.0)  # the engine's norm: x * w, not x * (1 + w): weights 1 smaller in Gemma's spelling
        wrong, _ = own_attention.op(model, 1, "attn.q_rope", dumped.__getitem__, prefill, e0[n].dtype)
        norm.weight.copy_(w)
    wrong = wrong.to(e0[n].dtype)
    rel = float((wrong.double() - g0[n]).norm() / g0[n].norm())
    assert own_error(model, n, wrong, g0[n], dumped.__getitem__, layout=prefill) > 0.5 * rel > 0.05
