"""``tpcheck diff --dump`` for an engine whose ranks do not write their own dump: the adapter wrapped, its points
written from the driver, per rank, through ``tpcheck.capture.dump.DumpWriter``."""
from __future__ import annotations

from pathlib import Path

from tpcheck.capture.dump import DumpWriter
from tpcheck.engines.adapter import EngineAdapter, as_adapter


class DumpingAdapter(EngineAdapter):
    """Wraps a live engine adapter: every step's points go to the caller and, per rank, to a ``DumpWriter``
    under ``root`` (``tpcheck diff --dump``), so the live run and ``tpcheck compare`` of its dump are judged
    from the same tensors. It delegates to the wrapped adapter what dumping leaves as it was: ``reductions``,
    ``teacher_forcing`` (dumping does not take the local pass away), ``rounding`` and ``point_rows``; not
    ``takes_prefix`` (the dump records every step from position 0)."""

    def __init__(self, inner, root: str | Path, dtype: str, engine: str = "impl", points: str | None = None,
                 budget_bytes: int | None = None, model: str | None = None):
        inner = as_adapter(inner)
        self.inner, self.root, self.dtype, self.engine, self.model = inner, Path(root), dtype, engine, model
        self.keep, self.budget, self.reductions = points, budget_bytes, inner.reductions
        self.teacher_forcing = inner.teacher_forcing
        self.rounding, self.cpu_bf16 = inner.rounding, inner.cpu_bf16_rounding
        self.writers: list[DumpWriter] = []

    @property
    def point_rows(self) -> dict[str, list[int]]:
        return self.inner.point_rows

    def begin(self, prompts, decode_steps) -> None:
        self.step_index, self.starts = 0, [0] * len(prompts)
        self.inner.begin(prompts, decode_steps)

    def step(self, new_tokens, teacher, capture_kv):
        points = self.inner.step(new_tokens, teacher, capture_kv)
        if teacher is None:  # the propagated run is what a dump records
            tp = max((len(ranks) for _, ranks in points.values()), default=1)
            if not self.writers:
                per_rank = None if self.budget is None else self.budget // tp
                self.writers = [DumpWriter(self.root, r, tp, self.dtype, self.engine, self.keep, per_rank, self.model,
                                           cpu_bf16_rounding=self.cpu_bf16) for r in range(tp)]
            rows = self.inner.point_rows
            for r, w in enumerate(self.writers):
                w.write(self.step_index, [list(t) for t in new_tokens], list(self.starts),
                        {n: (p, ranks[r]) for n, (p, ranks) in points.items()}, rows=rows)
            self.step_index += 1
            self.starts = [s + len(t) for s, t in zip(self.starts, new_tokens)]
        return points

    def close(self) -> None:
        self.writers = []
        self.inner.close()
