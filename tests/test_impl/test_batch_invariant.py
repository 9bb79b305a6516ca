"""impl's batch-invariant mode (``impl.batch_invariant``): a GEMM in fixed row blocks gives each row the same bits
whatever the number of rows and its neighbours (where one big GEMM does not), and a request generates the same
tokens, sampled included, alone or batched."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from impl import SamplingParams, batch_invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_rows_gives_a_row_the_same_bits_whatever_the_batch(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(70, 64, generator=g).to(dtype)
    alone = batch_invariant.fixed_rows(lambda r: F.linear(r, w), x[5:6])
    for n in (2, 9, 16, 17, 70):
        rows = torch.cat([torch.randn(n - 1, 64, generator=g).to(dtype), x[5:6]])  # the row last, others new
        assert torch.equal(batch_invariant.fixed_rows(lambda r: F.linear(r, w), rows)[-1:], alone), n
    assert batch_invariant.fixed_rows(lambda r: F.linear(r, w), x[:0]).shape == (0, 96)


def test_the_switch_is_off_by_default_and_linear_passes_through():
    assert not batch_invariant.enabled()
    x = torch.randn(3, 2, 4)
    assert torch.equal(batch_invariant.linear(x, lambda r: r * 2), x * 2)


def test_generate_alone_and_batched_gives_the_same_tokens(engines, ckpt):
    llm = engines.get(ckpt("tiny"), 1)
    probe = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    others = [[7] * 23, [1, 2, 3], list(range(40, 77))]
    sp = SamplingParams(temperature=0.8, max_tokens=8, seed=11, ignore_eos=True)
    try:
        llm.set_batch_invariant(True)
        alone = llm.generate([probe], sp)[0]
        llm.reset_scheduler()
        batched = llm.generate([others[0], probe, *others[1:]], sp)[1]
    finally:
        llm.set_batch_invariant(False)
        llm.reset_scheduler()
    assert batched == alone
