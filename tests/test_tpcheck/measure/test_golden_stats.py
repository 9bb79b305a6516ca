"""What the statistics read of a golden point, computed once (``tpcheck.measure.golden_stats``): one memo per golden
tensor, fresh after an in-place change, gone with the tensor, computed once when several threads ask; and the
statistics that read it are those computed from the golden afresh."""
from __future__ import annotations

import gc
import threading

import numpy as np
import torch

from tpcheck.measure import golden_stats
from tpcheck.measure.gain import gain_of
from tpcheck.measure.metrics import compare, rel_err, row_errors


def whole(t: torch.Tensor) -> float:
    """A whole tensor's norm as the statistics define it: the norm of its row norms."""
    return float(t.norm(dim=-1).norm())


def _golden(rows: int = 6, features: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_one_memo_per_golden_fresh_after_an_in_place_change():
    g, h = _golden(), _golden()
    assert golden_stats.of(g) is golden_stats.of(g) and golden_stats.of(g) is not golden_stats.of(h)
    before = golden_stats.of(g)
    assert before.norm() == whole(g)
    g.mul_(2)  # the same tensor, other values: measured afresh
    assert golden_stats.of(g) is not before
    assert golden_stats.of(g).norm() == whole(g) == 2 * before.norm()
    assert torch.equal(golden_stats.of(g).row_norms(), g.norm(dim=-1))


def test_an_inference_tensor_is_measured_without_a_memo():
    """``torch.inference_mode`` tensors keep no version counter: each call measures afresh, and the statistics
    work on them."""
    with torch.inference_mode():
        g = _golden()
    assert golden_stats.of(g) is not golden_stats.of(g)
    assert compare(g.float(), g)["ref_norm"] == whole(g)


def test_the_memo_goes_with_its_golden():
    gc.collect()
    held = len(golden_stats._MEMO)
    g = _golden()
    golden_stats.of(g).row_norms()
    assert len(golden_stats._MEMO) == held + 1
    del g
    gc.collect()
    assert len(golden_stats._MEMO) == held


def test_a_value_is_computed_once_however_many_threads_ask():
    g, calls, got = _golden(), [], []
    barrier = threading.Barrier(6)

    def ask():
        barrier.wait()
        got.append(golden_stats.of(g).get("k", lambda g64: calls.append(1) or float(g64.sum())))
    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [float(g.sum())] * 6


def test_the_statistics_are_those_of_the_golden_as_it_is_now():
    """A golden measured, changed in place, measured again: every statistic is the plain formula's on its new
    values (a memo that outlived the change would give the old norms, mask and gain)."""
    g = _golden(8, 64, seed=1)
    x = (g * (1 + 2.0 ** -8)).to(torch.float32)
    for _ in range(2):
        c, e, gain = compare(x, g), row_errors(x, g), gain_of(x, g, spread=False).gain
        d = x.double() - g
        assert c["ref_norm"] == whole(g) and c["rel_err"] == whole(d) / whole(g)
        assert e.worst == float((d.norm(dim=-1) / g.norm(dim=-1)).max())
        assert rel_err(x, g) == c["rel_err"]
        r = (x.double() - g) / g
        a = g.abs()
        q = (a >= a.median(dim=-1, keepdim=True).values) & (a > 0)
        assert gain == float(np.median(r[q].numpy()))
        g[:, ::2].mul_(-3)  # other magnitudes, other signs: another mask, another gain
