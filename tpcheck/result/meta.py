"""``DiffMeta``: what one diff ran, on what, and what it noticed — the ``meta`` of its result (saved by ``--json``,
shown in the HTML report's header, read back by ``tpcheck gate`` and ``compare-results``).

One typed record, written in one place (``tpcheck.pipeline.diff``), for a live run (``tpcheck diff``, a property
case, the fault matrix) and a replayed dump (``tpcheck compare``) alike: the engine side (``RunOrigin``: which engine,
at which tp, with what injected or replayed from which dump, and the command that repeats it) is given by the
caller, the rest is what the run resolved and measured. Fields that do not apply to a kind of run are left out of
the document rather than written as null (a dump records no expert-parallel size and can hold no injected fault),
so a reader tells "not applicable" from "none"."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RunOrigin:
    """The engine side of a diff: the engine and tp it ran at and the command that repeats the run; a live run also
    its expert-parallel size and injected faults (``inject_silent``: those that cannot show here, and why), a
    replayed dump the directory it came from."""

    tp: int
    engine: str
    command: str
    ep: int | None = None                        # None: not recorded (a dump)
    stages: tuple[tuple[int, int], ...] | None = None  # pipeline stages' layers [start, end); None: one stage
    dump: str | None = None                      # the dump replayed (``tpcheck compare``); None: a live run
    inject: tuple[str, ...] | None = None        # None: a dump, into which nothing can be injected
    inject_layer: int | None = None
    inject_silent: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out: dict = {"tp": self.tp}
        if self.dump is not None:
            out["dump"] = self.dump
        if self.ep is not None:
            out["ep"] = self.ep
        if self.stages is not None:
            out.update(pp=len(self.stages), stages=[list(s) for s in self.stages])
        out["engine"] = self.engine
        if self.inject is not None:
            out.update(inject=list(self.inject), inject_layer=self.inject_layer, inject_silent=dict(self.inject_silent))
        out["command"] = self.command
        return out


@dataclass(frozen=True, kw_only=True)
class DiffMeta:
    """What a diff resolved and measured, with its ``origin``. ``coverage``: ``tpcheck.judge.coverage.Coverage``'s
    figures; ``select``: the compared points' regex (None: every point); ``stopped_at_step``: where ``--fail-fast``
    stopped (None: it did not); ``golden``: the saved golden replayed (None: computed live); ``reductions``: the TP
    rounding the noise floor emulated (tp, dtype); ``effective_precision``: the engine's arithmetic per point kind
    (informational, ``tpcheck.measure.precision``); ``rounding``: how the engine rounds to the dtype, declared
    (``mode`` and ``why``: ``tpcheck.capture.rounding``; the judge reads it); ``notes``: what the run warned about (the pipeline's
    ``tpcheck diff: note:`` lines), kept with the result and not only in the log."""

    origin: RunOrigin | None                     # None: a bare ``compare_engine`` call that named no engine side
    model: str
    dtype: str
    coverage: dict
    decode_steps: int
    isolate: bool
    exact_ops: bool
    select: str | None
    stopped_at_step: int | None
    golden: str | None
    reductions: dict
    num_layers: int
    prompt_lens: list[int]
    effective_precision: dict | None = None
    notes: tuple[str, ...] = ()
    rounding: dict | None = None                 # the engine's declared rounding (tpcheck.capture.rounding)
    local_rows: int | None = None                # the local pass ran each prompt's last N rows (None: every row)
    devices: dict | None = None                  # {"engine": ..., "golden": ...}: where each ran (None: not recorded)

    def to_dict(self) -> dict:
        """The result's ``meta`` (the schema's ``diff_meta``): the run's keys, then the origin's, then the effective
        precision and the notes (left out when there are none)."""
        out = {"model": self.model, "dtype": self.dtype, "coverage": self.coverage, "decode_steps": self.decode_steps,
               "isolate": self.isolate, "exact_ops": self.exact_ops, "select": self.select,
               "stopped_at_step": self.stopped_at_step, "golden": self.golden, "reductions": self.reductions,
               "num_layers": self.num_layers, "prompt_lens": list(self.prompt_lens),
               **(self.origin.to_dict() if self.origin is not None else {})}
        if self.rounding is not None:
            out["rounding"] = self.rounding
        if self.local_rows is not None:
            out["local_rows"] = self.local_rows
        if self.devices is not None:
            out["devices"] = dict(self.devices)
        if self.effective_precision is not None:
            out["effective_precision"] = self.effective_precision
        if self.notes:
            out["notes"] = list(self.notes)
        return out
