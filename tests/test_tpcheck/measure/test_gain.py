"""The gain statistic (``tpcheck.measure.gain``) and the narrow-point noise floor (``tpcheck.judge.noise_floor``)
on synthetic tensors, and the judge's gain rule (``tpcheck.judge.verdict``): no engine runs here."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tpcheck.judge.noise_floor import NoiseFloor
from tpcheck.judge.verdict import GAIN_MODES, judge
from tpcheck.measure.gain import GAIN_C, MIN_ELEMENTS, U_FP32, gain_fields, gain_of, gain_z, gain_z_cols, is_narrow, \
    ratios, row_gains
from tpcheck.reference.reductions import Reductions
from tpcheck.result.origin import truncation_like
from tpcheck.result.report.sample import sample_result

BF16_GAIN = 1 + 2**-7  # the residual_gain fault's factor: 2 ulp at most of a bfloat16 element


def golden(rows: int = 64, features: int = 128, seed: int = 0, outliers: bool = False) -> torch.Tensor:
    """A float64 hidden state; with ``outliers`` two massive-activation channels (~1000x the rest)."""
    g = torch.randn(rows, features, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    if outliers:
        g[:, [3, features // 2 + 13]] *= 1000
    return g


def test_pure_rounding_is_noise_and_a_gain_far_below_it_is_found():
    g = golden(outliers=True)
    noise = gain_of(g.to(torch.bfloat16), g)
    assert noise.n >= g.numel() // 2 and abs(noise.gain) < 3 * noise.se
    assert 3e-5 < noise.se < 3e-4  # ~u / 4 spread over ~4,000 elements
    faulty = gain_of((g * BF16_GAIN).to(torch.bfloat16), g)
    assert faulty.gain == pytest.approx(2**-7, rel=0.1)
    assert abs(faulty.gain) > 3 * gain_z(faulty.n) * faulty.se  # >= 3x the noise term
    # each element moves by 2^-7 of itself, 1-2 bfloat16 ulp (1-3 after both roundings): a few roundings upstream
    clean, bad = g.to(torch.bfloat16), (g * BF16_GAIN).to(torch.bfloat16)
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(clean.double().abs()))
    assert set(((bad.double() - clean.double()).abs() / ulp).round().unique().tolist()) <= {1.0, 2.0, 3.0}


def test_clean_gain_over_its_se_is_standard_normal_like():
    """Many independent noisy tensors: |gain| / se stays far under gain_z and se is the spread's right size."""
    z, gains, ses = [], [], []
    for seed in range(200):
        g = golden(16, 64, seed, outliers=seed % 2 == 0)
        st = gain_of(g.to(torch.bfloat16), g)
        z.append(abs(st.gain) / st.se)
        gains.append(st.gain)
        ses.append(st.se)
    assert max(z) < 4.5
    assert 0.6 < np.std(gains) / np.mean(ses) < 1.4


def test_errors_a_column_shares_down_its_rows_widen_the_column_group_se():
    """Where every row carries one column's error (each token's context is mostly its sink's V, whose rounding
    is then in every row), the elements are not independent, ``se`` is too small, and ``se_cols`` sees the
    spread of the column groups."""
    def shared(seed: int, rows: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
        g = golden(rows, 192, seed)
        col = 2e-4 * golden(1, 192, seed + 1000)  # a relative error per column, the same in every row
        return (g * (1 + col)).to(torch.float16), g

    st = gain_of(*shared(0))
    assert st.groups == 64 and st.se_cols > 3 * st.se
    indep = gain_of(golden(400, 192, seed=2).to(torch.float16), golden(400, 192, seed=2))  # a fresh rounding
    assert indep.groups == 64 and 0.6 < indep.se_cols / indep.se < 1.6  # per element: the two agree
    # over many clean tensors with shared column errors |gain| / se_cols stays t-like, while |gain| / se does not
    zs, zc = [], []
    for seed in range(40):
        s = gain_of(*shared(seed, 200))
        zs.append(abs(s.gain) / s.se)
        zc.append(abs(s.gain) / s.se_cols)
    assert max(zs) > gain_z(19200) and max(zc) < gain_z_cols(64)
    # not measured: one row, or rows too narrow for 16 groups of two features
    assert math.isnan(gain_of(golden(1, 192).to(torch.float16), golden(1, 192)).se_cols)
    assert gain_of(golden(64, 24).to(torch.float16), golden(64, 24)).groups == 0


def test_gain_z_cols_is_students_t_at_the_normal_six_sigma_tail():
    assert gain_z_cols(64) == pytest.approx(7.0, abs=0.02) and gain_z_cols(16) == pytest.approx(12.7, abs=0.05)
    assert gain_z_cols(100_000) == pytest.approx(6.0, abs=0.01)  # many groups: the normal's 6


def test_outliers_and_near_zero_elements_cannot_move_the_gain():
    g = golden()
    x = g.to(torch.bfloat16).double()
    g[5, 9], x[5, 9] = 1e-12, 1.0       # a near-zero golden element: ratio 1e12, below its row's median: skipped
    x[:, 3] = g[:, 3] * 1.5             # one channel 50% off: 1/128 of the elements, the median barely moves
    st = gain_of(x, g)
    assert abs(st.gain) < 1e-3
    r = ratios(x, g)
    assert math.isnan(r[5, 9]) and int((~torch.isnan(r)).sum()) == st.n


def test_no_gain_where_it_means_nothing():
    g = golden(2, 4)
    assert math.isnan(gain_of(g.float(), g).gain)  # 4 qualifying elements < MIN_ELEMENTS
    assert math.isnan(gain_of(golden(1, 60).float(), golden(1, 60)).gain)  # 31 of 60: still too few
    ids = torch.randint(0, 8, (32, 2))
    assert gain_of(ids, ids).n == 0  # integer points (MoE top-k ids)
    x = golden().float()
    x[0, 0] = math.nan
    assert math.isnan(gain_of(x, golden()).gain)  # a NaN fails by rel_err already
    assert all(math.isnan(v) for v in gain_fields(g.float(), g).values())
    f = gain_fields(golden().float(), golden())
    assert f["gain_floor"] == pytest.approx(GAIN_C * U_FP32 * math.sqrt(128))
    assert MIN_ELEMENTS == 32 and f["gain_n"] == 64 * 65  # from the lower median of each row of 128 on


def test_row_gains_and_narrow_points():
    g = golden(8, 64)
    gains, se = row_gains((g * BF16_GAIN).float(), g)
    assert gains.shape == (8,) and torch.allclose(gains, torch.full((8,), 2**-7, dtype=torch.float64), rtol=1e-4)
    assert row_gains(g[:, :1].float(), g[:, :1]) is None  # a [rows, 1] row is one element: no row gain
    assert is_narrow(g[:, :15]) and not is_narrow(g[:, :16])
    # a narrow point selects by the tensor's median, not the row's: the upper half of a gate logit's rows (from the
    # lower median on)
    z = golden(64, 1)
    assert gain_of(z.float(), z).n == 33


# ---- the narrow-point floor: a [rows, 1] gate logit ----------------------------------------------------------

def _gate(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _noisy(z: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    """``z`` plus an error of the same size on every row, whatever z: a dot product's rounding (set by its
    operands, not by its result)."""
    return z + scale * torch.randn(z.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _floor_over(steps: list[torch.Tensor], err: float = 1e-3) -> NoiseFloor:
    nf = NoiseFloor(Reductions(2))
    for s, z in enumerate(steps):
        nf.begin_step(s)
        for i, name in enumerate(("hf", "hf-tp")):
            nf.observe(name, "layers.0.moe.shared_gate", _noisy(z, err, 100 * s + i), z)
        nf.end_step()
    return nf


def test_a_near_zero_logit_does_not_lift_the_floor():
    z = _gate(32, 0)
    z[7] = 1e-6  # a logit at zero: its own relative error is ~1e3
    nf = _floor_over([z])
    ref = nf.row_fields("layers.0.moe.shared_gate")["ref_rel_err"]
    s = nf.scale("layers.0.moe.shared_gate")
    assert s == pytest.approx(float(z.norm() / math.sqrt(32)))
    assert ref < 5e-3  # the references' worst row error (~3e-3 at most) over the scale (~1), not ~1e3
    # a doubled logit: an error of |z| per row, found by tens of times the threshold (k = 3, floor 1e-3)
    twice = nf.engine_rel_err("layers.0.moe.shared_gate", float((2 * z - z).norm() / z.norm()),
                              float(z.norm()), 32)
    assert twice / (3 * ref + 1e-3) > 30


def test_a_one_token_step_is_judged_against_every_earlier_row():
    """The float32 repro's shape: a one-token prompt, one row a step, the logit of step 2 near zero, where the
    references happened to round luckily. The engine's error there is no larger than the references' errors at
    the other steps: within the floor, where the per-row rule failed it (~20x)."""
    point, zs = "layers.0.moe.shared_gate", [1.2, -0.8, 6e-3]
    errs = {"hf": [1e-7, 1e-7, 1e-9], "hf-tp": [-1.5e-7, -1e-7, 2e-9]}
    nf = NoiseFloor(Reductions(2))
    old_floor = 0.0
    for s, z in enumerate(zs):
        nf.begin_step(s)
        g = torch.tensor([[z]], dtype=torch.float64)
        for name, e in errs.items():
            nf.observe(name, point, g + e[s], g)
            old_floor = max(old_floor, abs(e[s] / z))
        nf.end_step()
    ref = nf.row_fields(point)["ref_rel_err"]
    assert nf.scale(point) == pytest.approx(math.sqrt(sum(z * z for z in zs) / 3))
    assert ref == pytest.approx(1.5e-7 / nf.scale(point))
    engine = 2e-7  # the engine's error at step 2
    rel = nf.engine_rel_err(point, engine / zs[2], zs[2], 1)
    assert rel == pytest.approx(engine / nf.scale(point)) and rel <= 2 * ref + 1e-6  # float32: k 2, floor 1e-6
    assert engine / zs[2] > 15 * (2 * old_floor + 1e-6)  # the per-row rule: its own row against a lucky sample


def test_a_wide_point_keeps_the_per_row_rule():
    nf = NoiseFloor(Reductions(1))
    g = golden(4, 64)
    x = g.clone()
    x[2] *= 1.01
    nf.begin_step(0)
    nf.observe("hf", "layers.0.attn.q", x, g)
    nf.end_step()
    assert nf.row_fields("layers.0.attn.q")["ref_rel_err"] == pytest.approx(0.01)
    assert math.isnan(nf.scale("layers.0.attn.q"))
    assert nf.engine_rel_err("layers.0.attn.q", 0.5, 3.0, 4) == 0.5


# ---- the judge -------------------------------------------------------------------------------------------

def _with_gain(gain: float, se: float, ref_gain: float, floor: float = 1e-9, dtype: str = "bfloat16",
               se_cols: float = math.nan):
    r = sample_result(2, 0, isolate=True, dtype=dtype)
    t = r.table
    t["gain"], t["gain_se"], t["gain_n"], t["ref_gain"], t["gain_floor"] = 0.0, se, 2000.0, ref_gain, floor
    t["gain_se_cols"], t["gain_groups"] = se_cols, 64.0
    at = t["point"] == "layers.1.attn.residual"
    t.loc[at, "gain"] = gain  # in both passes: the propagated one is not judged
    r = judge(r)
    i = t.index[at & (t["mode"] == "isolated")][0]
    p = t.index[at & (t["mode"] == "propagated")][0]
    assert r.table.loc[p, "passed"] and math.isnan(r.table.loc[p, "gain_threshold"])
    return r, i


def test_judge_fails_a_gain_over_each_term_and_names_it():
    z = gain_z(2000)
    assert z == pytest.approx(6 * (1 + 4 / math.sqrt(2000))) and gain_z(32) > 10
    ok, i = _with_gain(5e-4, 1e-4, 1e-4)  # under z se = 6.5e-4 and under 3 x 1e-4
    assert ok.table.loc[i, "passed"] and ok.table.loc[i, "gain_threshold"] == pytest.approx(z * 1e-4)
    bad, i = _with_gain(7.8e-3, 1e-4, 2e-4)
    row = bad.table.loc[i]
    assert not row["passed"] and row["excess"] == pytest.approx(7.8e-3 / (z * 1e-4))
    fd = bad.first_divergence
    assert fd["point"] == "layers.1.attn.residual" and fd["mode"] == "isolated" and fd["gain"] == 7.8e-3
    assert f": {7.8e-3 / (z * 1e-4):.3g}x its threshold" in bad.summary()  # the excess: the gain's
    assert f"why: a systematic gain: every element scaled by +0.0078 (threshold {z * 1e-4:.3g})" in bad.summary()
    shared, i = _with_gain(7.8e-3, 1e-4, 3e-3)  # the references have a gain of their own: k x it covers
    assert shared.table.loc[i, "passed"] and shared.table.loc[i, "gain_threshold"] == pytest.approx(9e-3)
    floor, i = _with_gain(3e-7, 1e-9, 0.0, floor=GAIN_C * U_FP32 * 8, dtype="float32")
    assert floor.table.loc[i, "passed"]  # a per-row float32 scalar: the floor term
    cols, i = _with_gain(6e-4, 1e-5, 0.0, se_cols=1e-4)  # errors shared down the columns: the column-group term
    assert cols.table.loc[i, "passed"] and cols.table.loc[i, "gain_threshold"] == pytest.approx(gain_z_cols(64) * 1e-4)
    assert GAIN_MODES == ("isolated",)


def test_rounding_toward_zero_is_a_gain_and_the_origin_says_it_looks_like_truncation():
    # what vLLM's CPU RoPE does to bfloat16 on a machine without AVX512-BF16 (docs/measured/depth.md "A dump's local pass")
    g = golden()
    f32 = g.to(torch.float32)
    trunc = (f32.view(torch.int32) & ~0xFFFF).view(torch.float32)  # the low 16 bits dropped: exact in bfloat16
    t = gain_of(trunc.double(), g)
    rne = gain_of(f32.to(torch.bfloat16).double(), g)
    assert -2**-8 < t.gain < -2**-9 and abs(t.gain) > 5 * gain_z(t.n) * t.se and abs(rne.gain) < 3 * rne.se
    assert truncation_like(t.gain, "bfloat16") and not truncation_like(rne.gain, "bfloat16")
    assert not truncation_like(2**-7, "bfloat16") and not truncation_like(-2**-7, "float16")  # a gain up; float16
    assert not truncation_like(-0.012, "bfloat16") and truncation_like(-0.012, "bfloat16", se=0.0015)  # 3 se
    bad, _ = _with_gain(t.gain, 1e-4, 0.0)
    unwrapped = " ".join(bad.summary().split())  # the origin's lines wrap at 120 characters, anywhere in a phrase
    assert "of the sign and size of rounding toward zero to bfloat16 instead of to nearest" in unwrapped
    assert "every layer's output is locally within the noise floor; the local pass fails inside a layer" \
        in bad.summary()
    up, _ = _with_gain(7.8e-3, 1e-4, 0.0)  # the residual_gain fault: no such note
    assert "rounding toward zero" not in up.summary()


def test_a_result_without_gain_columns_is_judged_as_before():
    r = sample_result(2, 1, isolate=False, fail_at="layers.1.attn.q")
    before = judge(r)
    assert before.table["gain_threshold"].isna().all()
    assert before.first_divergence["point"] == "layers.1.attn.q" and math.isnan(before.first_divergence["gain"])


@pytest.mark.parametrize("rows,features,ties,infinite", [(2, 32, False, False), (7, 100, True, False),
                                                           (64, 896, False, False), (3, 4096, True, False),
                                                           (6, 256, False, True)])
def test_column_group_se_and_row_medians_are_their_definitions(rows, features, ties, infinite):
    """The column-group standard error (each group's median by selection) and the per-row median cut are the
    definitions' values, bit for bit: groups of interleaved features through ``np.nanmedian``, and torch's median.
    ``infinite``: a row of tiny goldens whose finite x overflows the ratio (qualifying ratios of +-inf, which a
    group's median includes and its count of finite ratios does not)."""
    from tpcheck.measure.gain import COL_GROUPS, MIN_COL_GROUPS, MIN_GROUP, _ratios, _row_medians, col_group_se
    g = golden(rows, features, seed=rows)
    g[:, ::5] = 0  # columns that never qualify
    x = g + 1e-3 * golden(rows, features, seed=rows + 1)
    if ties:
        x = (x * 64).round() / 64
    if infinite:
        g[1] *= 1e-300  # this row's median is tiny: its elements qualify, and 1e10 / 1e-300 overflows
        x[1, ::3] = 1e10 * torch.sign(g[1, ::3])
    assert torch.equal(_row_medians(g.abs()), g.abs().median(dim=-1, keepdim=True).values)
    r, q = (t.numpy() for t in _ratios(x, g))
    groups = min(COL_GROUPS, features // 2)
    m = features // groups * groups
    grouped = np.where(q[:, :m], r[:, :m], np.nan).reshape(rows * (m // groups), groups)
    grouped = grouped[:, np.isfinite(grouped).sum(0) >= MIN_GROUP]
    want = (math.nan, 0) if grouped.shape[1] < MIN_COL_GROUPS else \
        (float(np.nanmedian(grouped, axis=0).std(ddof=1) / math.sqrt(grouped.shape[1])), grouped.shape[1])
    got = col_group_se(r, q)
    assert got[1] == want[1] and (got[0] == want[0] or math.isnan(got[0]) and math.isnan(want[0])), (got, want)
    if infinite:
        assert np.isinf(r[q]).sum() > 0 and got[1] > 0


def test_the_tp_reference_takes_the_first_references_statistics_only_for_the_same_bits():
    """Where the TP reference's tensor is the first reference's, bit for bit, against the same golden, its
    statistics are reused; the fields are those of computing them again. A tensor that differs is measured."""
    g = golden(outliers=True)
    x = g.to(torch.bfloat16)
    y = x.clone()
    y[0, 0] += 1  # one element off
    fields = []
    for second, second_golden in ((x, g), (x.clone(), g.clone()), (y, g)):
        floor = NoiseFloor(Reductions(2, "bfloat16"))
        floor.begin_step(0)
        floor.observe("hf", "layers.0.out", x, g)
        floor.observe("hf-tp", "layers.0.out", second, second_golden)
        floor.end_step()
        fields.append(floor.row_fields("layers.0.out"))
    assert fields[0] == fields[1] and fields[0]["ref_rel_err_tp"] == fields[0]["ref_rel_err_hf"]
    assert fields[2]["ref_rel_err_tp"] != fields[2]["ref_rel_err_hf"]


@pytest.mark.parametrize("rows,features,alone_first", [(2, 32, False), (64, 896, False), (1, 40, False),
                                                       (64, 896, True), (40, 4, True), (40, 4, False)])
def test_a_gain_without_its_spread_is_the_same_gain(rows, features, alone_first):
    """A noise-floor reference's gain is measured without its standard errors (``spread=False``, on the qualifying
    elements alone): the same median, bit for bit, whichever is measured first (the golden's side is computed once,
    by the first); ``se`` and ``se_cols`` not measured. Narrow rows (4 features) qualify against the whole
    tensor's median."""
    g = golden(rows, features, seed=rows)
    x = (g * (1 + 2.0 ** -9)).to(torch.bfloat16)
    alone = gain_of(x, g, spread=False) if alone_first else None
    whole = gain_of(x, g)
    alone = alone or gain_of(x, g, spread=False)
    assert alone.gain == whole.gain or math.isnan(alone.gain) and math.isnan(whole.gain)
    assert alone.n == whole.n and math.isnan(alone.se) and math.isnan(alone.se_cols)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 33, 64, 1000, 4097])
def test_median_is_numpys(n):
    """``_median`` (one selection, the lower middle element of an even count the largest below the upper one) is
    ``np.median`` bit for bit: random values, ties, and infinities."""
    from tpcheck.measure.gain import _median
    rng = np.random.default_rng(n)
    for v in (rng.standard_normal(n), np.round(rng.standard_normal(n) * 4) / 4,
              np.where(rng.random(n) < 0.1, np.inf, rng.standard_normal(n)) * np.sign(rng.random(n) - 0.3)):
        assert _median(v.copy()) == np.median(v) or np.isnan(np.median(v)) and np.isnan(_median(v.copy())), v


def test_a_tensor_of_more_dims_is_rows_of_its_last_dim():
    """The gain takes rows and features as ``metrics`` does (the last dim the features, every other dim rows): a
    ``[2, 5, 64]`` point's gain is its ``[10, 64]`` view's, standard errors and column groups included."""
    g = golden(10, 64, seed=3)
    x = g * (1 + 1e-3) + 1e-4 * golden(10, 64, seed=4)
    assert gain_of(x.reshape(2, 5, 64), g.reshape(2, 5, 64)) == gain_of(x, g)
    assert gain_fields(x.reshape(2, 5, 64), g.reshape(2, 5, 64)) == gain_fields(x, g)
