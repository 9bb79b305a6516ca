"""tpcheck.measure.metrics against the textbook formulas written out plainly (fresh float64 copies, torch.kthvalue)."""
import math

import pytest
import torch

from tpcheck.measure.metrics import compare, max_row_rel_err, rel_err, row_rel_errs


def plain(x: torch.Tensor, g: torch.Tensor) -> dict:
    x64, g64 = x.double().flatten(), g.double().flatten()
    d = (x64 - g64).abs().nan_to_num(nan=math.inf)
    n = d.numel()
    return {"rel_err": float((x64 - g64).norm() / g64.norm()), "cosine": float(x64 @ g64 / (x64.norm() * g64.norm())),
            "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "p99_abs": float(d.kthvalue(max(1, math.ceil(0.99 * n))).values), "ref_norm": float(g64.norm())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 1000)])
def test_compare_matches_the_plain_formulas(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, dtype=torch.float64, generator=gen) * 3
    x = (g + 1e-3 * torch.randn(shape, dtype=torch.float64, generator=gen)).to(dtype)
    keep = x.clone()
    got, want = compare(x, g), plain(x, g)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-300), k
    assert torch.equal(x, keep)  # the caller's tensor is never the scratch buffer, float64 or not
    d = (x.double() - g).abs()
    r, f = got["max_abs_index"]
    assert d[r, f] == d.max()
    assert got["nan"] == got["inf"] == 0


@pytest.mark.parametrize("shape", [(300, 1000), (3, 70_000)])  # several rows a chunk; one row a chunk
def test_the_statistics_are_the_same_in_chunks_of_any_size(monkeypatch, shape):
    """The one pass over ``x - g`` (``metrics._sweep``) taken a chunk of rows at a time gives what one chunk of
    everything gives, bit for bit (the mean of |x - g| to its summation order), a NaN and Infs in a later chunk
    included; so a chunk boundary drops, repeats or shifts nothing."""
    import tpcheck.measure.metrics as metrics
    gen = torch.Generator().manual_seed(shape[0])
    g = torch.randn(shape, dtype=torch.float64, generator=gen)
    x = (g + 1e-4 * torch.randn(shape, dtype=torch.float64, generator=gen)).float()
    x[-1, 5] = 1e3  # the max, in the last chunk
    bad = x.clone()
    bad[-1, 0], bad[-1, 1], bad[1, 2] = math.nan, math.inf, -math.inf
    got = {}
    for chunk in (1 << 30, 4096, 1):
        monkeypatch.setattr(metrics, "CHUNK", chunk)
        got[chunk] = [metrics.compare(t, g) for t in (x, bad)] + [metrics.row_errors(x, g), metrics.rel_err(x, g)]
    whole = got.pop(1 << 30)
    assert whole[0]["max_abs_index"] == [shape[0] - 1, 5] and (whole[1]["nan"], whole[1]["inf"]) == (1, 2)
    same = lambda u, v: u == v or isinstance(u, float) and math.isnan(u) and math.isnan(v)  # noqa: E731
    for chunked in got.values():
        for a, b in zip(chunked[:2], whole[:2]):
            assert a.keys() == b.keys() and a["mean_abs"] == pytest.approx(b["mean_abs"], rel=1e-12)
            assert all(same(a[k], b[k]) for k in a if k != "mean_abs"), (a, b)
        assert chunked[2:] == whole[2:]


def test_compare_nan_and_inf():
    g = torch.ones(4, 5, dtype=torch.float64)
    x = torch.ones(4, 5)
    x[1, 2], x[3, 0], x[3, 4] = math.nan, math.inf, -math.inf
    s = compare(x, g)
    assert (s["nan"], s["inf"]) == (1, 2)
    assert math.isnan(s["rel_err"]) and math.isnan(s["cosine"])
    assert s["max_abs"] == math.inf and s["p99_abs"] == math.inf
    only_inf = torch.ones(4, 5)
    only_inf[0, 0] = math.inf
    s = compare(only_inf, g)
    assert (s["nan"], s["inf"]) == (0, 1) and s["rel_err"] == math.inf and math.isnan(s["cosine"])


def test_compare_empty_and_mismatched_shapes():
    s = compare(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.float64))
    assert s["max_abs"] == s["p99_abs"] == s["mean_abs"] == 0.0 and s["max_abs_index"] == []
    with pytest.raises(ValueError, match=r"shape \(2, 3\) != golden shape \(3, 2\)"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))


def test_row_rel_errs_is_rel_err_and_the_worst_row():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(50, 64, dtype=torch.float64, generator=gen)
    g[7] = 0  # a zero golden row is skipped by the worst row, counted by the whole
    x = (g + 1e-4 * torch.randn(50, 64, dtype=torch.float64, generator=gen)).float()
    whole, worst = row_rel_errs(x, g)
    assert whole == pytest.approx(float((x.double() - g).norm() / g.norm()), rel=1e-12)
    assert whole == pytest.approx(rel_err(x, g), rel=1e-12)
    rows = (x.double() - g).norm(dim=-1) / g.norm(dim=-1)
    assert worst == pytest.approx(float(rows[torch.arange(50) != 7].max()), rel=1e-12)
    assert worst == max_row_rel_err(x, g) and worst >= whole
    x[3, 3] = math.nan
    assert all(math.isnan(v) for v in row_rel_errs(x, g))
    assert math.isnan(row_rel_errs(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.float64))[1])



@pytest.mark.parametrize("chunk", [1 << 30, 1])
def test_the_max_is_the_first_of_equal_maxima(monkeypatch, chunk):
    """``max_abs_index`` names the first element (row-major) of equal largest ``|x - g|``, within a chunk of rows
    and across chunks; an all-equal error names the first element."""
    import tpcheck.measure.metrics as metrics
    monkeypatch.setattr(metrics, "CHUNK", chunk)
    g = torch.zeros(4, 6, dtype=torch.float64)
    assert compare(torch.zeros(4, 6), g)["max_abs_index"] == [0, 0]
    x = torch.zeros(4, 6)
    x[2, 1], x[0, 3], x[0, 5], x[3, 0] = 2.0, -2.0, 2.0, 1.0
    got = compare(x, g)
    assert got["max_abs"] == 2.0 and got["max_abs_index"] == [0, 3]
