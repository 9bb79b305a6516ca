"""``NoiseFloor``: the references' errors against the golden, kept per point across the steps of a run; each row's
``ref_rel_err`` (the error the threshold scales) and ``ref_gain`` (the gain threshold's reference term) come from
here.

The references are every legitimate way to compute a point at the run's dtype: Hugging Face on one device
(``"hf"``) and, when the engine's all-reduces round (tp > 1), Hugging Face rounding as a ``tp``-way row-parallel
engine does (``"hf-tp"``, ``tpcheck.reference.reductions``). A point's floor is the worst of them.

Why the worst *row*, kept over steps: a few rows make a reference's error a noisy sample. Where a few outlier
elements dominate a row's norm, the reference can round luckily where a correct engine lands an ulp the other
way, and the MLP's outlier units amplify that. Every row (token) of a point is computed by the same ops, so each
reference row is a sample of the per-row error a correct engine may make, and an error over several rows (an
RMS of its rows) is at most its worst row. The floor of step s is therefore the worst reference row at that
point over steps 0..s, or the references' whole-tensor error at s where that is larger.

**Narrow points** (rows of fewer than ``NARROW_FEATURES`` = 16 features: a Qwen2-MoE layer's ``[rows, 1]`` shared
gate logit, the top-k weights, a router of a few experts) measure each row's error against the point's *scale*
``S``, not against the row's own norm: the RMS over every row of this and earlier steps of the row's operand scale
(``tpcheck.measure.operands``: ``sqrt(sum_j sum_i w_ji^2 x_ri^2)`` for a logit ``w_j . x_r``, what its rounding
is proportional to; its mean square is the logits' over random signs) where the point is a known linear map, else
of the golden's row norm:

* why: a row of n random-sign features has a squared norm ~ chi2_n times its mean, below 1/9 of it (a norm under
  1/3 of typical) with probability 26% at n = 1, 0.1% at n = 8 and 6e-6 at n = 16. At n = 1 a gate logit near zero
  turns its one-element row's relative error into ~u / |z|: as a reference row it lifts the floor (bfloat16: a
  threshold ~3, so a doubled logit passed at 0.34x), and as the engine's only row (a one-token prompt) it is one
  sample against a reference that rounded luckily (float32, ``tiny-qwen2-moe`` tp 2, prompt [197]: 1.35x). From 16
  features on a row's norm does not vanish and the per-row rule stands;
* why a correct engine stays under: these points are dot products of a normalised hidden state (the
  post-attention RMSNorm's output, of about the same norm for every token) and a weight row, or a softmax of them.
  Their legitimate rounding, ``u |z| + gamma_n sum_i |w_i x_i|`` (random sign: ~ ``u sqrt(sum_i w_i^2 x_i^2)``),
  is set by the operands, the same size for every token, not by the result z. So every row's *absolute* error is
  a sample of one distribution, and the references' worst row over every row and step so far is the maximum of
  many samples (a one-token prompt: one per reference per step, accumulating over the decode steps) where the
  per-row rule had the one row of this step. Engine and references are divided by the same S, so the gate is in
  effect absolute: the engine's RMS row error against k times the references' worst row, plus ``floor * S``;
  ``rel_err`` is that RMS over S. A one-token prefill still compares one engine element with one per reference:
  no sample bound holds there (with Gaussian errors, one sample exceeds 2x the larger of two others 13% of the
  time), and what keeps it sound is the floor, an a priori ``floor * S`` (float32: 1e-6, ~17 roundings of the
  operand scale). Hence the operand scale: the golden's own norm at that one row is ``|z|``, which a logit near
  zero makes vanish with the floor (``tiny-qwen2-moe`` tp 2 float32, prompt [18]: z = 0.1 against ~0.7 at other
  tokens, 1.12x by the golden's norm, passed by the operands');
* what a bug must be to cross: an error of k times the references' worst row, which in bfloat16 is a few ulp of
  the point's typical magnitude. A doubled or un-gated logit is off by ``|z|`` per row, RMS ~S: rel_err ~1, tens of
  times the threshold, found at the gate itself.

**The gain** (``tpcheck.measure.gain``): each reference's whole-tensor gain is a sample of the systematic part
every legitimate computation shares (the weights rounded to the dtype: the same rounding in HF and the engine)
plus its estimation noise; ``ref_gain`` is the largest |gain| of either reference at this point over the steps so
far. Whole-tensor, not per row: a row's gain is a median of a few dozen ratios whose noise (~u / 6 in bfloat16)
is of the order of the gains worth finding, so k times the worst row would hide a gain of 2u
(``tpcheck.judge.verdict`` has the rule)."""
from __future__ import annotations

import math

import torch

from tpcheck.measure.ahead import Ahead
from tpcheck.measure.gain import gain_of, is_narrow
from tpcheck.measure.metrics import RowErrors, row_errors
from tpcheck.reference.reductions import Reductions

Level = tuple[float, str, int]  # (error, reference name, step)


class NoiseFloor:
    """Feed it each reference's points of a step (``observe``), then ask a point's floor (``row_fields``) and the
    engine's error in the same units (``engine_rel_err``)."""

    def __init__(self, reductions: Reductions, gains: bool = True):
        # (name, reductions to emulate): HF at the dtype, and (tp > 1) HF at the dtype rounding like the engine
        self.references: list[tuple[str, Reductions | None]] = [("hf", None)]
        if reductions.emulated:
            self.references.append(("hf-tp", reductions))
        # a narrow point's errors are absolute until end_step divides them by its scale (module docstring)
        self._worst_row: dict[str, Level] = {}   # point -> worst reference row over the steps so far
        self._now: dict[str, dict[str, float]] = {}  # point -> reference -> whole-tensor error this step
        self._level: dict[str, Level] = {}       # point -> this step's floor
        self._scale: dict[str, list] = {}        # narrow point -> [sum of squared golden row norms, rows, last step]
        self._gain: dict[str, float] = {}        # point -> largest |gain| of a reference so far
        self.gains = gains                       # measure the references' gains (the local pass: judged there)
        # point -> this step's first reference's (tensor, golden, errors, gain): the TP reference computes what HF
        # does up to the first row-parallel linear of a layer it was handed (all of layer 0's attention before
        # o_proj; in the local pass, every layer's, and the final norm and logits), so its statistics there are
        # the first reference's, bit for bit, and are taken instead of computed again
        self._first: dict[str, tuple[torch.Tensor, torch.Tensor, RowErrors, float]] = {}
        self._checked: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # point -> ahead's known() answer
        self._step = 0

    def begin_step(self, step: int) -> None:
        self._step, self._now, self._level, self._first, self._checked = step, {}, {}, {}, {}

    def measure(self, tensor: torch.Tensor, golden: torch.Tensor) -> tuple[RowErrors, float]:
        """What ``observe`` reads of a reference's tensor, pure (``tpcheck.measure.ahead`` runs it in worker
        threads): its ``row_errors`` and (the local pass) its gain."""
        return row_errors(tensor, golden), gain_of(tensor, golden, spread=False).gain if self.gains else math.nan

    def known(self, point: str, tensor: torch.Tensor, golden: torch.Tensor) -> bool:
        """This step's first reference observed the same tensor of ``point`` against the same golden (the TP
        reference up to a layer's first row-parallel linear): ``observe`` takes its statistics."""
        first = self._first.get(point)
        return first is not None and first[1] is golden and first[0].dtype == tensor.dtype and \
            torch.equal(first[0], tensor)

    def ahead(self, points: dict[str, torch.Tensor], gold: dict[str, torch.Tensor]) -> Ahead:
        """``measure`` of each of a reference's ``points`` against the golden's, started in worker threads
        (``tpcheck.measure.ahead``), where ``observe`` will compute it: a point of the golden's shape whose
        statistics are not the first reference's. ``observe(..., measured=ahead.take(point))`` reads them."""
        ahead = Ahead()
        for n, t in points.items():
            g = gold.get(n)
            if g is not None and t.shape == g.shape:
                known = self.known(n, t, g)
                self._checked[n] = (t, g, known)  # observe reads the answer rather than compare the tensors again
                if not known:
                    ahead.submit(n, self.measure, t, g, elements=g.numel())
        return ahead

    def observe(self, reference: str, point: str, tensor: torch.Tensor, golden: torch.Tensor,
                operand_sq: float | None = None, measured: tuple[RowErrors, float] | None = None) -> None:
        """One reference's tensor of ``point`` at this step, against the golden's; ``operand_sq``: the sum over
        the rows of a narrow point's squared operand scale (``tpcheck.measure.operands``), None: the golden's;
        ``measured``: its ``measure``, computed ahead."""
        checked = self._checked.pop(point, None)  # ahead's answer, for these very tensors
        same = checked[2] if checked is not None and checked[0] is tensor and checked[1] is golden else None
        if measured is None and (same if same is not None else self.known(point, tensor, golden)):
            e, g = self._first[point][2:]  # the same tensor against the same golden: the same statistics
        else:
            e, g = measured if measured is not None else self.measure(tensor, golden)
            if reference == self.references[0][0] and len(self.references) > 1:
                self._first[point] = (tensor, golden, e, g)
        narrow = is_narrow(golden)
        if narrow:
            acc = self._scale.setdefault(point, [0.0, 0, -1])
            if acc[2] != self._step:  # the golden is the same for every reference: counted once a step
                sq = e.golden_sq if operand_sq is None else operand_sq
                acc[:] = [acc[0] + sq, acc[1] + e.rows, self._step]
        whole, worst = (e.rms_row, e.worst_abs) if narrow else (e.whole, e.worst)
        self._now.setdefault(point, {})[reference] = whole
        if math.isfinite(whole) and whole > self._level.get(point, (-1.0,))[0]:
            self._level[point] = (whole, reference, self._step)
        if math.isfinite(worst) and worst > self._worst_row.get(point, (-1.0,))[0]:
            self._worst_row[point] = (worst, reference, self._step)
        if math.isfinite(g) and abs(g) > self._gain.get(point, -1.0):
            self._gain[point] = abs(g)

    def end_step(self) -> None:
        """Every reference observed: a point's floor is the larger of this step's whole-tensor errors and the
        worst row so far; a narrow point's, divided by its scale."""
        self._first, self._checked = {}, {}  # the references' tensors: not held past the step
        for point, worst in self._worst_row.items():
            if worst[0] > self._level.get(point, (-1.0,))[0]:
                self._level[point] = worst
        for point in self._level.keys() & self._scale.keys():
            s = self.scale(point)
            err, by, step = self._level[point]
            self._level[point] = (err / s if s > 0 else err, by, step)
            self._now[point] = {r: (v / s if s > 0 else v) for r, v in self._now.get(point, {}).items()}

    def scale(self, point: str) -> float:
        """A narrow point's scale: the RMS over the rows of the steps so far of their operand scale or golden norm
        (NaN: not a narrow point the references measured)."""
        acc = self._scale.get(point)
        return math.sqrt(acc[0] / acc[1]) if acc and acc[1] else math.nan

    def engine_rel_err(self, point: str, rel_err: float, golden_norm: float, rows: int) -> float:
        """The engine's ``rel_err`` in the floor's units: unchanged, except at a narrow point, where it is the
        RMS row error (``rel_err * golden_norm / sqrt(rows)``) over the point's scale."""
        s = self.scale(point)
        if not s > 0 or rows <= 0 or not math.isfinite(golden_norm):
            return rel_err
        return rel_err * golden_norm / math.sqrt(rows) / s if golden_norm > 0 else rel_err / math.sqrt(rows) / s

    def row_fields(self, point: str) -> dict:
        """The ``Row`` fields of ``point`` at this step: ``ref_rel_err`` (the floor), the two references'
        whole-tensor errors, ``ref_by`` (``"hf-tp@0"``: the reference and step that set the floor) and
        ``ref_gain``."""
        err, by, step = self._level.get(point) or (math.nan, "", self._step)
        now = self._now.get(point, {})
        return {"ref_rel_err": err, "ref_rel_err_hf": now.get("hf", math.nan),
                "ref_rel_err_tp": now.get("hf-tp", math.nan), "ref_by": f"{by}@{step}" if by else "",
                "ref_gain": self._gain.get(point, math.nan)}
