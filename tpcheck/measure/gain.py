"""The gain statistic: a systematic relative error (a gain or a bias) far below one element's rounding.

Why it exists: ``rel_err`` is an RMS of per-element errors, so it cannot tell a gain of ``1 + 2^-7`` on a bfloat16
tensor (every element off by +0.8%) from rounding (every element off by up to ``u = 2^-8`` relative, with random
sign): both give ``rel_err`` ~ 5e-3, and the noise floor's ``k * ref_rel_err`` admits it. But rounding errors have
random sign and cancel over a tensor; a gain does not. The median over n elements of ``(x_i - g_i) / g_i`` (x the
engine, g the float64 golden) is a gain estimate whose noise shrinks as ``1 / sqrt(n)``: with a few thousand
elements it sees a gain ~30x below the elementwise rounding.

The estimator, per point (``gain_of``):

* qualifying elements: ``|g_i| >= median(|g|)`` of the element's row (rows of fewer than ``NARROW_FEATURES``
  features: of the whole tensor) and ``g_i != 0``. The ratio of an element near zero is its absolute rounding
  error over a tiny value, unbounded; keeping the upper half bounds every ratio by the error over the median
  magnitude, and the median then ignores the few outlier / massive-activation elements however large they are;
* ``gain`` = the median of the ratios (robust: one huge ratio cannot move it);
* ``se`` = ``sqrt(pi / 2) * 1.4826 * MAD / sqrt(n)``: the standard error of a sample median, ``1 / (2 f(m)
  sqrt(n))``, with the density at the median ``f(m)`` that of a normal whose sigma is the MAD's robust estimate
  (1.4826 MAD). For the heavier-tailed ratio distributions seen here (a scale mixture: the elements' magnitudes
  differ) the normal's ``f(m)`` is the smallest for its MAD, so the estimate is conservative; for a uniform
  rounding error it is 7% low, which the verdict's ``z`` covers. It is the engine's own spread, so it is
  measured on the very run it judges;
* ``se_cols``: the same standard error where one column's error repeats down the rows (``col_group_se``): the
  spread of the gains of up to 64 interleaved column groups. ``se`` alone takes the elements as independent; in a
  trained model's attention they are not (every token's context is mostly its sink's V), and a clean float16
  ``attn.out`` of 533 rows had a gain of 9x its ``se`` (2.5e-5) that was 0.8x its ``se_cols``.

The verdict's noise term is ``gain_z(n) * se`` with ``gain_z(n) = GAIN_Z * (1 + 4 / sqrt(n))``, ``GAIN_Z = 6``:
a clean engine's gain is ~N(0, se) and 6 se is exceeded with probability ~2e-9 per comparison for large n, but with
se itself estimated from n elements the ratio ``|gain| / se`` has a heavier, t-like tail. Simulated with uniform
ratios (a single rounding's relative error: the flattest, so the worst of normal, Laplace, t3 and uniform), its
1e-5 quantile is 16.5 at n = 16, 9.2 at 32, 6.6 at 64, 5.6 at 128; ``gain_z`` is 12, 10.2, 9.0, 8.1 there and
tends to 6 (6.5 at n = 2,000). The column-group term is ``gain_z_cols(G) * se_cols``: Student's t with ``G - 1``
degrees of freedom at the same ~2e-9 tail (7.0 at 64 groups).

Not measured (``GainStat.n`` below ``MIN_ELEMENTS``, gain NaN): integer points (MoE top-k ids), tensors with a NaN /
Inf (rel_err already fails them), and points with fewer than ``MIN_ELEMENTS = 32`` qualifying elements: below 32 a
median and a MAD of so few samples leave the tail above (16.5 se at n = 16) too wide to bound usefully."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from tpcheck.measure import golden_stats
from tpcheck.measure.metrics import unit_roundoff

NARROW_FEATURES = 16  # rows of fewer features are "narrow" (tpcheck.judge.noise_floor: a row is no unit of scale)
MIN_ELEMENTS = 32     # fewer qualifying elements: no gain measured (module docstring)
SE_FACTOR = math.sqrt(math.pi / 2) * 1.4826  # se of a median = SE_FACTOR * MAD / sqrt(n) (module docstring)
U_FP32 = unit_roundoff(torch.float32)  # 2^-24
GAIN_Z = 6.0          # gain_z(n) tends to it: a clean engine's gain is ~N(0, se), beyond 6 se with probability 2e-9
GAIN_C = 4.0          # gain_floor = GAIN_C * U_FP32 * sqrt(features) (``gain_fields``)
COL_GROUPS = 64       # the column-group standard error: at most this many groups of interleaved features
MIN_COL_GROUPS = 16   # fewer groups (narrower rows): no column-group standard error
MIN_GROUP = 8         # qualifying elements each group needs
GAIN_TAIL = 2 * 0.5 * math.erfc(GAIN_Z / math.sqrt(2))  # P(|N(0, 1)| > GAIN_Z): the tail gain_z_cols matches


@dataclass(frozen=True)
class GainStat:
    """``gain`` (median ratio), ``se`` (its standard error), ``n`` (qualifying elements); NaN / 0 where none;
    ``se_cols`` the standard error from ``groups`` column groups (``col_group_se``), NaN / 0 where not measured."""

    gain: float = math.nan
    se: float = math.nan
    n: int = 0
    se_cols: float = math.nan
    groups: int = 0


def gain_z(n: float) -> float:
    """The noise term's multiple of ``se`` for a gain of ``n`` elements (module docstring)."""
    return GAIN_Z * (1 + 4 / math.sqrt(n)) if n > 0 else math.nan


@functools.lru_cache(maxsize=None)
def gain_z_cols(groups: int) -> float:
    """The column-group term's multiple of ``se_cols``: the quantile of Student's t with ``groups - 1`` degrees of
    freedom whose two-sided tail is ``P(|N(0, 1)| > GAIN_Z)`` (~2e-9): se_cols is estimated from ``groups`` group
    gains, themselves medians of many elements and so near normal (7.0 at 64 groups, 8.3 at 32, 12.7 at 16)."""
    nu = groups - 1
    c = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(nu * math.pi)
    t = np.linspace(0.0, 60.0, 600_001)
    tail = np.cumsum((c * (1 + t * t / nu) ** (-(nu + 1) / 2))[::-1])[::-1] * (t[1] - t[0]) * 2
    return float(t[np.searchsorted(-tail, -GAIN_TAIL)])


def is_narrow(golden: torch.Tensor) -> bool:
    """Rows of fewer than ``NARROW_FEATURES`` features (a ``[rows, 1]`` gate logit, top-k weights, a router of
    a few experts): per-row statistics degenerate there (``tpcheck.judge.noise_floor``)."""
    return golden.dim() < 2 or golden.shape[-1] < NARROW_FEATURES


def _qualifying(x: torch.Tensor, golden: torch.Tensor) -> tuple[golden_stats.GoldenStats, torch.Tensor] | None:
    """The golden's ``GoldenStats`` and its ``[rows, features]`` mask of the qualifying elements (module
    docstring), computed once for the engine's and each reference's gain; None where no gain is measured (integers,
    a non-finite x, an empty or scalar tensor). The mask is shared: not to be written. Rows and features as
    ``metrics`` takes them (``golden_stats.as_rows``: the last dim the features, as ``is_narrow`` reads them)."""
    if x.shape != golden.shape or golden.dim() == 0 or golden.numel() == 0 or \
            not (x.is_floating_point() and golden.is_floating_point()):
        return None
    lo, hi = torch.aminmax(x.detach())  # NaN propagates: both finite iff every element is (in x's own dtype:
    if not (math.isfinite(lo) and math.isfinite(hi)):  # finite there iff in float64); 1/14 of isfinite's time
        return None
    gs = golden_stats.of(golden)

    def mask(g64: torch.Tensor) -> torch.Tensor:
        a = golden_stats.as_rows(g64).abs()
        cut = a.median() if is_narrow(golden) else _row_medians(a)
        return (a >= cut) & (a > 0)
    return gs, gs.get("gain.qualifying", mask)


def _ratios(x: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``((x - g) / g, qualifying)``: float64 ``[rows, features]`` ratios and the mask of the qualifying elements
    (``_qualifying``: shared, not to be written); None where no gain is measured."""
    gq = _qualifying(x, golden)
    if gq is None:
        return None
    gs, q = gq
    g = gs.g64.reshape(q.shape)
    return x.detach().to(torch.float64, copy=True).reshape(g.shape).sub_(g).div_(g), q


def _qualifying_ratios(x: torch.Tensor, golden: torch.Tensor) -> np.ndarray | None:
    """The ratios of the qualifying elements alone, in row-major order (``_ratios``' ``r[q]``), a new array; None
    where no gain is measured. The ratios of every element, then those at the mask taken (``_compress``): cheaper
    here than gathering ``x`` and ``g`` at the mask first (two boolean gathers, each slower than the arithmetic)."""
    rq = _ratios(x, golden)
    return None if rq is None else _compress(rq[0], rq[1])


def _compress(r: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """``r[q]`` as a new numpy array, row-major: ``np.compress`` on the flat arrays, the same elements in the same
    order at ~2.5x the speed of a boolean index (numpy's or torch's) on 622k float64 here."""
    if r.device.type != "cpu":
        return r[q].cpu().numpy()
    return np.compress(q.reshape(-1).numpy(), r.reshape(-1).numpy())


def _row_medians(a: torch.Tensor) -> torch.Tensor:
    """``a.median(dim=-1, keepdim=True).values`` (the lower middle element of each row) of a float64 CPU tensor by
    numpy's in-place selection, a copy reordered instead of each row sorted (the same values, at a fraction of the
    time on rows of thousands of features)."""
    if a.device.type != "cpu" or a.numel() == 0 or bool(torch.isnan(a).any()):
        return a.median(dim=-1, keepdim=True).values  # torch's NaN ordering, kept where it matters
    k = (a.shape[-1] - 1) // 2
    v = a.numpy().copy()
    v.partition(k, axis=-1)
    return torch.from_numpy(v[..., k:k + 1].copy())


def ratios(x: torch.Tensor, golden: torch.Tensor) -> torch.Tensor | None:
    """``(x - g) / g`` as a float64 ``[rows, features]`` tensor, NaN outside the qualifying elements (module
    docstring); None where no gain is measured (integers, a non-finite x, an empty or scalar tensor)."""
    rq = _ratios(x, golden)
    return None if rq is None else rq[0].masked_fill_(~rq[1], math.nan)


def _median(v: np.ndarray) -> float:
    """``np.median`` of a 1-D array without its NaN and masked-array checks (2/3 of its time on small arrays);
    ``v`` is reordered. Of an even count the lower middle element is the largest of the ``k`` below the upper
    one once ``v`` is partitioned at it (numpy's sort order, NaN last, is max's): one selection, where
    ``partition((k - 1, k))`` took ~6x as long as ``partition(k)`` on 311k ratios here."""
    n = v.size
    k = n // 2
    v.partition(k)
    return float(v[k]) if n % 2 else 0.5 * (float(v[:k].max()) + float(v[k]))


def _median_mad(r: np.ndarray) -> tuple[float, float]:
    med = _median(r)
    return med, _median(np.abs(r - med))


def col_group_se(r: np.ndarray, q: np.ndarray) -> tuple[float, int]:
    """``(se_cols, groups)``: the gain's standard error when elements of one column (feature) share their error
    across rows; ``(nan, 0)`` where it is not measured (one row, rows narrower than ``2 * MIN_COL_GROUPS``
    features, or fewer than ``MIN_COL_GROUPS`` groups with ``MIN_GROUP`` qualifying elements each; the groups
    with fewer are left out, and ``groups`` counts those kept).

    Why: ``se`` assumes the elements' errors independent. Where rows are near copies of each other (every token
    of a trained model attends to its sink, so attention's context rows, and what the next GEMM makes of them,
    are alike), a GEMM rounds each column of them alike, and the errors of one feature repeat down its rows:
    measured on a clean 533-row float16 ``attn.out``, two rows' error patterns correlate at 0.35-0.47, and the
    gain's spread over column groups is 10x ``se``. So the features are dealt into ``G = min(COL_GROUPS,
    features // 2)`` interleaved groups (feature j to group j mod G, so a head's features spread over all of them),
    each group's gain is the median of its qualifying ratios over every row, and ``se_cols = sd(group gains) /
    sqrt(G)``: groups of other columns are independent whatever the rows share. Where the errors are independent
    it equals ``se`` (the mean of G medians has the variance of the median of all)."""
    rows, feats = r.shape
    groups = min(COL_GROUPS, feats // 2)
    if rows < 2 or groups < MIN_COL_GROUPS:
        return math.nan, 0
    m = feats // groups * groups
    # group j (features j, j + G, ...) as one contiguous block, so its median is a partition of its own qualifying
    # ratios (np.nanmedian over a NaN-masked [elements, G] array gave the same medians at 5-20x the time): the
    # arrays laid out group after group (torch's transposing copy: ~3x numpy's here), then every group's qualifying
    # ratios taken in one ``np.compress`` (a boolean gather per group cost more than its selection)
    by_group = lambda a: torch.from_numpy(a)[:, :m].reshape(-1, groups).t().contiguous().numpy()  # noqa: E731
    qg = by_group(q)
    v = np.compress(qg.reshape(-1), by_group(r).reshape(-1))  # ours: _median reorders each group's part
    ends = np.cumsum(qg.sum(axis=1))
    starts = np.concatenate(([0], ends[:-1]))
    # each group's finite qualifying ratios: its count where the sum is finite (so is every term), else counted
    if math.isfinite(v.sum()):
        finite = ends - starts
    else:
        before = np.concatenate(([0], np.cumsum(np.isfinite(v))))  # finite ratios before each position
        finite = before[ends] - before[starts]
    medians = []
    for start, end, n in zip(starts, ends, finite):
        if n >= MIN_GROUP:  # a group of columns that rarely qualify: left out
            medians.append(_median(v[start:end]))
    if len(medians) < MIN_COL_GROUPS:
        return math.nan, 0
    return float(np.array(medians).std(ddof=1) / math.sqrt(len(medians))), len(medians)


def gain_of(x: torch.Tensor, golden: torch.Tensor, spread: bool = True) -> GainStat:
    """The gain of ``x`` against ``golden`` over the whole tensor, with its standard errors (module docstring,
    ``col_group_se``); ``spread=False``: the gain alone, ``se`` and ``se_cols`` NaN (a noise-floor reference's gain
    is a sample of the systematic part, whose spread nothing reads: a third of the work)."""
    if not spread:  # the qualifying ratios alone: nothing else is read
        v = _qualifying_ratios(x, golden)  # ours: _median reorders it
        if v is None:
            return GainStat()
        return GainStat(_median(v), math.nan, int(v.size)) if v.size >= MIN_ELEMENTS else GainStat(n=int(v.size))
    rq = _ratios(x, golden)
    if rq is None:
        return GainStat()
    v = _compress(*rq)  # a copy: _median_mad reorders it
    r, q = rq[0].cpu().numpy(), rq[1].cpu().numpy()
    if v.size < MIN_ELEMENTS:
        return GainStat(n=int(v.size))
    med, mad = _median_mad(v)
    se_cols, groups = col_group_se(r, q)
    return GainStat(med, SE_FACTOR * mad / math.sqrt(v.size), int(v.size), se_cols, groups)


def row_gains(x: torch.Tensor, golden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's gain and its standard error (rows with fewer than ``MIN_ELEMENTS`` qualifying elements: NaN);
    None where no gain is measured, or the rows are narrow (one row of a gate logit is one element)."""
    r = ratios(x, golden)
    if r is None or is_narrow(golden):
        return None
    n = (~torch.isnan(r)).sum(-1)
    med = r.nanmedian(dim=-1, keepdim=True).values
    mad = (r - med).abs_().nanmedian(dim=-1).values
    med = med.squeeze(-1)
    few = n < MIN_ELEMENTS
    se = SE_FACTOR * mad / n.clamp(min=1).to(torch.float64).sqrt()
    return med.masked_fill(few, math.nan), se.masked_fill(few, math.nan)


def gain_fields(x: torch.Tensor, golden: torch.Tensor, scale: RowScale | None = None) -> dict[str, float]:
    """The engine's ``Row`` gain columns: ``gain``, ``gain_se``, ``gain_n`` and ``gain_floor``, NaN where no gain is
    measured.

    ``gain_floor`` is the larger of two allowances for a per-row scale that a correct engine rounds otherwise:

    * ``GAIN_C * U_FP32 * sqrt(features)``: a per-row scalar any engine rounds once in float32 in its own way:
      RMSNorm's ``rsqrt(mean(x^2) + eps)`` sums ``features`` squares (a random walk of roundings, relative error ~
      ``u sqrt(n)``; a fused kernel sums them in another order than HF), then rounds the rsqrt; a softmax's
      denominator likewise. That scales every element of a row alike: a true gain, of one row, which the engine's
      spread does not see and a reference (another summation order) need not sample. It matters in float32 alone;
    * ``scale`` (``RowScale``, ``row_scale_allowance``): the same per-row scale from the norm's *input*, rounded to
      the run's dtype: a row whose RMS one massive element dominates (a trained model's sink token) takes its scale
      from that element's rounding, and a correct engine that rounds it one ulp otherwise (another accumulation
      order before the cast) scales the whole row by up to ``2u`` (``2^-7`` in bfloat16): a gain of every element of
      the row, as large as a bug's, and of either sign. Each qualifying element is allowed its row's share; the
      gain is a median, so the allowance is the median of those shares over the qualifying elements (a prompt of
      one token: that row's; many tokens of which one is a sink: small), times the times the scale enters the
      point (``mult``: 2 after the MLP's product), or their maximum where attention mixes the rows first (every
      query reads the sink's value row). A bug that scales every row (the ``residual_gain`` fault, on the residual
      stream, outside any norm's scope) is judged as before."""
    g = gain_of(x, golden)
    if g.n < MIN_ELEMENTS:
        return {"gain": math.nan, "gain_se": math.nan, "gain_n": math.nan, "gain_floor": math.nan,
                "gain_se_cols": math.nan, "gain_groups": math.nan}
    features = golden.shape[-1] if golden.dim() else 1
    floor = GAIN_C * U_FP32 * math.sqrt(features)
    if scale is not None:
        floor = max(floor, _scale_share(x, golden, scale))
    return {"gain": g.gain, "gain_se": g.se, "gain_n": float(g.n), "gain_floor": floor,
            "gain_se_cols": g.se_cols, "gain_groups": float(g.groups) if g.groups else math.nan}


_PREV, _LAST = "<layer input>", "<last layer's out>"
#: point kind -> (the norm input its rows' scale comes from, how many times the scale enters it, whether attention
#: mixes the rows in between): the points from a norm to the next one (``gain_fields``); others get no allowance
SCALE_SOURCES: dict[str, tuple[str, int, bool]] = {
    "input_norm": (_PREV, 1, False), "attn.q": (_PREV, 1, False), "attn.k": (_PREV, 1, False),
    "attn.v": (_PREV, 1, False), "attn.context": (_PREV, 1, True), "attn.out": (_PREV, 1, True),
    "post_attn_norm": ("attn.residual", 1, False), "mlp.gate": ("attn.residual", 1, False),
    "mlp.up": ("attn.residual", 1, False), "mlp.act": ("attn.residual", 2, False),
    "mlp.out": ("attn.residual", 2, False), "final_norm": (_LAST, 1, False), "logits": (_LAST, 1, False),
}
#: Gemma 3 adds a norm after the attention and one after the MLP, each with its own input
SANDWICH_SCALE_SOURCES = {"attn.post_norm": ("attn.out", 1, False), "mlp.post_norm": ("mlp.out", 1, False)}


def scale_source(name: str, num_layers: int, sandwich: bool = False) -> tuple[str, int, bool] | None:
    """(the point whose golden rows set point ``name``'s per-row scale allowance, its multiplicity, mixed), or None
    (``SCALE_SOURCES``; ``sandwich``: a Gemma 3 model)."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    layer, kind = (int(m.group(1)), m.group(2)) if m else (None, name)
    src = (SANDWICH_SCALE_SOURCES.get(kind) if sandwich else None) or SCALE_SOURCES.get(kind)
    if src is None:
        return None
    point, mult, mixed = src
    if point == _LAST:
        return (f"layers.{num_layers - 1}.out" if num_layers else "embed"), mult, mixed
    if layer is None:
        return None
    if point == _PREV:
        return ("embed" if layer == 0 else f"layers.{layer - 1}.out"), mult, mixed
    return f"layers.{layer}.{point}", mult, mixed


@dataclass(frozen=True)
class RowScale:
    """The per-row scale allowance of a point (``row_scale_allowance`` of the norm input it descends from), how many
    times the row's scale enters the point (``mult``) and whether attention has mixed the rows (``mixed``)."""

    rows: torch.Tensor
    mult: int = 1
    mixed: bool = False


def row_scale_allowance(source: torch.Tensor, dtype: torch.dtype, engine: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of a norm's input ``source`` (its golden, ``[rows, features]``): ``2u sqrt(sum x^4) / sum x^2``, the
    relative change of the row's RMS when each element moves by up to one ulp of ``dtype`` (``2u``) with random
    sign (``2u`` for a row one element dominates, ``2u / sqrt(n)`` for ``n`` alike), plus, given the ``engine``'s own
    rows of that input, the relative error of their RMS: the row scale the norm passes on, measured (an upstream
    bug fails at that input first, so excusing what it passes on cannot hide it)."""
    x = source.detach().to(torch.float64).reshape(source.shape[0], -1)
    sq = x.square()
    ss = sq.sum(-1)
    share = sq.square().sum(-1).sqrt() / ss.clamp(min=1e-300)
    out = (2 * unit_roundoff(dtype) * share).masked_fill(ss == 0, 0.0)
    if engine is not None and engine.shape[0] == source.shape[0] and engine.numel() == source.numel():
        e = engine.detach().to(torch.float64).reshape(x.shape)
        rel = (e.square().sum(-1).sqrt() / ss.sqrt().clamp(min=1e-300) - 1).abs()
        out = out + torch.nan_to_num(rel.masked_fill(ss == 0, 0.0), nan=0.0, posinf=0.0)
    return out


def _scale_share(x: torch.Tensor, golden: torch.Tensor, scale: RowScale) -> float:
    """The gain a correct engine's per-row scales may add up to (``gain_fields``): the median of the row allowances
    over the qualifying elements (their maximum where attention mixed the rows), times ``scale.mult``; 0 where the
    rows do not line up."""
    gq = _qualifying(x, golden)
    a = scale.rows.to(torch.float64)
    if gq is None or a.numel() == 0:
        return 0.0
    q = gq[1]
    if q.dim() != 2 or q.shape[0] != a.shape[0]:
        return 0.0
    if scale.mixed:
        return scale.mult * float(a.max())
    counts = q.sum(-1).to(torch.float64)
    order = torch.argsort(a)
    cum = counts[order].cumsum(0)
    if cum.numel() == 0 or float(cum[-1]) == 0:
        return 0.0
    at = int(torch.searchsorted(cum, cum[-1] / 2))
    return scale.mult * float(a[order][min(at, a.numel() - 1)])
