"""tpcheck.measure.bitwise and tpcheck.result.invariance's comparison: ulps counted in the tensor's own dtype,
the first differing element, captures aligned by position, the first break and the growth after it."""
from __future__ import annotations

import math

import pytest
import torch

from tpcheck.measure.bitwise import compare_tensors, ulp_distance
from tpcheck.result.invariance import InvarianceResult, compare_captures, growth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_ulps_count_representable_steps_of_the_dtype(dtype):
    x = torch.tensor([1.0, -1.0, 0.0, 3.5], dtype=dtype)
    up = torch.nextafter(x, torch.full_like(x, math.inf)) if dtype in (torch.float32, torch.float64) else None
    if up is None:  # half types have no nextafter: one step is one more integer of the bits
        width = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
        bits = x.view(width)
        up = torch.where(x >= 0, bits + 1, bits - 1).to(width).view(dtype)
    assert ulp_distance(x, up).tolist() == [1, 1, 1, 1]
    assert ulp_distance(x, x).tolist() == [0, 0, 0, 0]
    two_up = torch.nextafter(up, torch.full_like(up, math.inf)) if dtype in (torch.float32, torch.float64) else None
    if two_up is not None:
        assert ulp_distance(x, two_up).tolist() == [2, 2, 2, 2]


def test_ulps_across_zero_nan_and_signed_zero():
    tiny = torch.tensor([torch.finfo(torch.float32).tiny * 2**-23])  # the smallest subnormal
    assert ulp_distance(tiny, -tiny).item() == 2  # +s, +0 = -0, -s
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).item() == 0
    assert not compare_tensors(torch.tensor([[0.0]]), torch.tensor([[-0.0]])).identical  # other bits all the same
    nan = torch.tensor([math.nan])
    assert ulp_distance(nan, torch.tensor([1.0])).item() == math.inf
    assert ulp_distance(nan, nan).item() == 0  # the same NaN bits


def test_compare_names_the_first_differing_element_and_its_ulps():
    a = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    b = a.clone()
    b[1, 2] = torch.nextafter(a[1, 2].float(), torch.tensor(100.0)).bfloat16()  # float32 step: rounds back
    assert compare_tensors(a, b).identical
    b.view(torch.int16)[1, 2] += 3  # three bfloat16 steps up
    b.view(torch.int16)[2, 0] += 1
    d = compare_tensors(a, b)
    assert (d.differing, d.first, d.max_ulps, d.numel) == (2, (1, 2), 3.0, 12)
    assert d.within(3) and not d.within(2) and not d.within(0)
    assert "shapes [3, 4] vs [4, 3]" in compare_tensors(a, b.reshape(4, 3)).structural
    ids = torch.tensor([[1, 2]]), torch.tensor([[1, 3]])
    assert compare_tensors(*ids).max_ulps == math.inf  # an expert id that differs is no rounding


def test_captures_compared_in_execution_order_by_position():
    ref = {(0, "embed"): torch.zeros(5, 2), (0, "layers.0.attn.q"): torch.zeros(5, 2),
           (0, "logits"): torch.zeros(5, 2), (1, "layers.0.attn.q"): torch.zeros(1, 2),
           (0, "layers.0.kv.k"): torch.zeros(5, 2)}
    other = {k: v.clone() for k, v in ref.items()}
    other[(0, "layers.0.attn.q")] = other[(0, "layers.0.attn.q")][3:]  # a prefix hit computes positions 3, 4
    other[(0, "layers.0.attn.q")][1, 1] = 1e-30
    other[(0, "logits")][0, 0] = 1.0
    other[(1, "layers.0.attn.q")][0, 0] = -1e-30
    rows = compare_captures(ref, other, "b", prompt_len=5)
    assert [(r.step, r.point) for r in rows] == [(0, "embed"), (0, "layers.0.attn.q"), (0, "layers.0.kv.k"),
                                                 (0, "logits"), (1, "layers.0.attn.q")]
    q = rows[1]
    assert (q.token, q.element, q.differing, q.numel) == (4, 1, 1, 4)  # position 4: the last of the prompt
    assert rows[4].token == 5  # decode step 1 computes position prompt_len
    r = InvarianceResult(["a", "b"], ["a: alone", "b: batched"], rows, ulps=None)
    assert r.first_break("b") is q and r.passed  # nothing declared: a report
    assert not InvarianceResult(["a", "b"], ["", ""], rows, ulps=0).passed
    assert [g["layer"] for g in growth(rows)] == ["0", "head", "0"]
    assert "first differs from a at step 0, layers.0.attn.q, token 4, element 1" in r.summary()
    missing = compare_captures(ref, {k: v for k, v in ref.items() if k[1] != "logits"}, "c", 5)
    assert [r.note for r in missing if r.note] == ["c did not capture it"]
