"""Dumps: an engine's points written per rank and per step, compared offline (``tpcheck compare``).

Layout of a dump directory (local, or a shared filesystem for ranks on several nodes)::

    DIR/rank{r}/step{s}.safetensors   rank r's local tensors of step s, keyed by canonical point name
    DIR/rank{r}/step{s}.json          {"format": 2, "rank", "tp", "step", "ids", "tokens", "starts", "rows",
                                       "prompts", "placements", "dtype", "engine", "model_fingerprint", "tensors",
                                       "cpu_bf16_rounding"}

A step is the requests it ran, in the batch's row order (``tpcheck.capture.batches``): ``ids[i]`` (the engine's
request id, stable over the run) consumed the token ids ``tokens[i]`` at positions ``starts[i]..``; a point's rows
are the requests' rows concatenated in that order. Requests may join at any step and leave, a prompt may be
prefilled over several steps, and a preempted request may run again from an earlier position (with the same
tokens). ``rows``: ``{point: flat row indices}`` for a point that holds only some of the step's rows (vLLM's
``logits``: the sampled rows). ``prompts`` (optional: older dumps lack it): ``{request id: token ids from
position 0}`` of the requests first scheduled (or scheduled again after a preemption) in the step, so a request whose first step starts past 0 (a
prefix-cache hit: another request computed its first blocks) has its prefix run by the golden first.
``placements``: per point, how the rank's tensor maps onto the full one (``impl.placements``, as JSON). Every rank of a step must agree on tp, ids, tokens and starts. Format 1 (no
hashes, no request ids) is refused: write the dump again. Safetensors and JSON only: nothing is unpickled.

Integrity (format 2): ``tensors`` records per point the dtype, shape and sha256 of the bytes written, and
``model_fingerprint`` the checkpoint's (``tpcheck.inputs.files.fingerprint``; null when the writer was not
told the checkpoint). ``cpu_bf16_rounding`` (optional: older dumps and writers that do not know lack it): whether
the CPU the rank ran on converts float32 to bfloat16 in hardware (``tpcheck.capture.rounding``: without it vLLM's
CPU kernels truncate, and ``tpcheck compare`` declares so). Reading checks every field's type and bounds (``tpcheck.inputs.files.validate``), that a rank's
JSON names the rank and step of the file it sits in, every tensor against its record (a floating-point tensor,
the rows all ranks agree on, a placement that fits it), and ``Dump.check_model`` the recorded checkpoint and
token ids against ``--model``: a mismatch is a DumpError (exit 2) naming the file and the tensor.

``DumpWriter`` writes one rank (every engine's ranks write through it: impl's, Hugging Face TP's, vLLM's plugin,
``tpcheck.capture.from_env`` in a user's engine); ``tpcheck.engines.dump.replay.read_dump`` checks a directory is
complete and consistent and ``DumpAdapter`` replays it as an engine, so ``tpcheck compare`` judges it exactly as
``tpcheck diff`` judges a live engine."""
from __future__ import annotations

import re
from pathlib import Path

from impl.placements import Fused
from tpcheck.capture.background import BackgroundWriter
from tpcheck.capture.dump_format import DumpError, placement_to_json
from tpcheck.inputs.files.fingerprint import fingerprint
from tpcheck.inputs.files.step_store import save_step, write_json_atomic

FORMAT = 2  # 2: per-request ids and a point's rows (continuous batching), per-tensor hashes, the checkpoint's id
STEP_FILE = re.compile(r"step(\d+)\.json")  # a step's record in a rank's directory


class DumpWriter:
    """Writes one rank's points, step by step, into ``root/rank{rank}``. ``points``: a regex of canonical
    point names to keep (None: all); ``budget_bytes``: refuse (DumpError, before writing) a step that would
    take the directory's written bytes past it. ``background_bytes``: write the files on a thread of their own
    (``tpcheck.capture.background``: in order, at most that many bytes queued, back-pressure, an error raised by
    a later ``write``); ``flush`` / ``close`` wait for them. None: each ``write`` writes before it returns."""

    def __init__(self, root: str | Path, rank: int, tp: int, dtype: str, engine: str = "impl",
                 points: str | None = None, budget_bytes: int | None = None, model: str | None = None,
                 background_bytes: int | None = None, cpu_bf16_rounding: bool | None = None):
        self.cpu_bf16_rounding = cpu_bf16_rounding  # None: not recorded (the writer does not know its kernels' CPU)
        self.fingerprint = None if model is None else fingerprint(model)  # compare checks it against --model
        self.dir = Path(root) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(STEP_FILE.fullmatch(p.name) for p in self.dir.iterdir()):  # two runs' steps must never mix
            raise DumpError(f"{self.dir}: holds steps of an earlier run; dump into a new or empty directory")
        self.rank, self.tp, self.dtype, self.engine = rank, tp, dtype, engine
        self.keep = re.compile(points) if points else None
        self.budget, self.written = budget_bytes, 0
        self.background = None if background_bytes is None else BackgroundWriter(f"tpcheck-dump-rank{rank}",
                                                                                  background_bytes, DumpError)

    def write(self, step: int, tokens: list[list[int]], starts: list[int], points: dict,
              ids: list[str] | None = None, rows: dict[str, list[int]] | None = None,
              prompts: dict[str, list[int]] | None = None) -> None:
        """``points``: ``{name: (placement, this rank's tensor or None)}``; ``ids``: the requests' ids in row
        order (default: ``"0"``, ``"1"``, ...: a fixed batch); ``rows``: the rows of a point that holds only some
        (``tpcheck.capture.batches.StepBatch``); ``prompts``: the token ids from position 0 of the requests first
        scheduled in this step (what a prefix-cache hit's golden must run first; omitted when None)."""
        kept = {}
        for n, (p, t) in points.items():
            if t is None:
                continue
            if isinstance(p, Fused) and self.keep is not None:  # a selection may keep some parts of it
                pieces = t.split([w for _, w, _ in p.parts], dim=-1)
                kept.update({n + part: (sub, x) for (part, _, sub), x in zip(p.parts, pieces)
                             if self.keep.fullmatch(n + part)})
            elif self.keep is None or self.keep.fullmatch(n):
                kept[n] = (p, t)
        size = sum(t.numel() * t.element_size() for _, t in kept.values())
        if self.budget is not None and self.written + size > self.budget:
            raise DumpError(f"dump {self.dir}: step {step} needs {size / 2**20:.1f} MiB more, past the budget of "
                            f"{self.budget / 2**20:.1f} MiB ({self.written / 2**20:.1f} MiB written); narrow "
                            "--dump-points or raise --dump-budget-mb")
        tensors = {n: t.detach().contiguous().cpu() for n, (_, t) in kept.items()}
        ids = [str(i) for i in range(len(tokens))] if ids is None else [str(i) for i in ids]
        rows = {n: list(r) for n, r in (rows or {}).items() if n in kept}
        meta = {"format": FORMAT, "rank": self.rank, "tp": self.tp, "step": step, "ids": ids, "tokens": tokens,
                "starts": starts, "rows": rows, "dtype": self.dtype, "engine": self.engine,
                "placements": {n: placement_to_json(p) for n, (p, _) in kept.items()},
                "model_fingerprint": self.fingerprint}
        if self.cpu_bf16_rounding is not None:
            meta["cpu_bf16_rounding"] = bool(self.cpu_bf16_rounding)
        if prompts:
            meta["prompts"] = {str(r): [int(t) for t in p] for r, p in prompts.items()}

        def commit() -> None:  # the tensors first: a step's JSON names only a file that is complete
            meta["tensors"] = save_step(self.dir / f"step{step}.safetensors", tensors)
            write_json_atomic(self.dir / f"step{step}.json", meta)
        self.background.submit(commit, size) if self.background is not None else commit()
        self.written += size

    def flush(self) -> None:
        """Every step written so far is on disk (a background writer's queue drained); its error, if one failed."""
        if self.background is not None:
            self.background.flush()

    def close(self) -> None:
        """``flush``, then stop the background writer's thread."""
        if self.background is not None:
            self.background.close()
