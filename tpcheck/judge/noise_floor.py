"""``NoiseFloor``: the references' errors against the golden, kept per point across the steps of a run; each row's
``ref_rel_err`` (the error the threshold scales) comes from here.

The references are every legitimate way to compute a point at the run's dtype: Hugging Face on one device
(``"hf"``) and, when the engine's all-reduces round (tp > 1), Hugging Face rounding as a ``tp``-way row-parallel
engine does (``"hf-tp"``, ``tpcheck.reference.reductions``). A point's floor is the worst of them.

Why the worst *row*, kept over steps: a few rows make a reference's error a noisy sample. Where a few outlier
elements dominate a row's norm, the reference can round luckily where a correct engine lands an ulp the other
way, and the MLP's outlier units amplify that. Every row (token) of a point is computed by the same ops, so each
reference row is a sample of the per-row error a correct engine may make, and an error over several rows (an
RMS of its rows) is at most its worst row. The floor of step s is therefore the worst reference row at that
point over steps 0..s, or the references' whole-tensor error at s where that is larger."""
from __future__ import annotations

import math

import torch

from tpcheck.measure.metrics import row_rel_errs
from tpcheck.reference.reductions import Reductions

Level = tuple[float, str, int]  # (rel_err, reference name, step)


class NoiseFloor:
    """Feed it each reference's points of a step (``observe``), then ask a point's floor (``row_fields``)."""

    def __init__(self, reductions: Reductions):
        # (name, reductions to emulate): HF at the dtype, and (tp > 1) HF at the dtype rounding like the engine
        self.references: list[tuple[str, Reductions | None]] = [("hf", None)]
        if reductions.emulated:
            self.references.append(("hf-tp", reductions))
        self._worst_row: dict[str, Level] = {}   # point -> worst reference row over the steps so far
        self._now: dict[str, dict[str, float]] = {}  # point -> reference -> whole-tensor rel_err this step
        self._level: dict[str, Level] = {}       # point -> this step's floor
        self._step = 0

    def begin_step(self, step: int) -> None:
        self._step, self._now, self._level = step, {}, {}

    def observe(self, reference: str, point: str, tensor: torch.Tensor, golden: torch.Tensor) -> None:
        """One reference's tensor of ``point`` at this step, against the golden's."""
        e, worst = row_rel_errs(tensor, golden)
        self._now.setdefault(point, {})[reference] = e
        if math.isfinite(e) and e > self._level.get(point, (-1.0,))[0]:
            self._level[point] = (e, reference, self._step)
        if math.isfinite(worst) and worst > self._worst_row.get(point, (-1.0,))[0]:
            self._worst_row[point] = (worst, reference, self._step)

    def end_step(self) -> None:
        """Every reference observed: a point's floor is the larger of this step's whole-tensor errors and the
        worst row so far."""
        for point, worst in self._worst_row.items():
            if worst[0] > self._level.get(point, (-1.0,))[0]:
                self._level[point] = worst

    def row_fields(self, point: str) -> dict:
        """The ``Row`` fields of ``point`` at this step: ``ref_rel_err`` (the floor), the two references'
        whole-tensor errors, and ``ref_by`` (``"hf-tp@0"``: the reference and step that set the floor)."""
        err, by, step = self._level.get(point) or (math.nan, "", self._step)
        now = self._now.get(point, {})
        return {"ref_rel_err": err, "ref_rel_err_hf": now.get("hf", math.nan),
                "ref_rel_err_tp": now.get("hf-tp", math.nan), "ref_by": f"{by}@{step}" if by else ""}
