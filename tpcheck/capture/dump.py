"""Dumps: an engine's points written per rank and per step, compared offline (``tpcheck compare``).

Layout of a dump directory (local, or a shared filesystem for ranks on several nodes)::

    DIR/rank{r}/step{s}.safetensors   rank r's local tensors of step s, keyed by canonical point name
    DIR/rank{r}/step{s}.json          {"format": 2, "rank", "tp", "step", "ids", "tokens", "starts", "rows",
                                       "placements", "dtype", "engine"}

A step is the requests it ran, in the batch's row order (``tpcheck.capture.batches``): ``ids[i]`` (the engine's
request id, stable over the run) consumed the token ids ``tokens[i]`` at positions ``starts[i]..``; a point's rows
are the requests' rows concatenated in that order. Requests may join at any step and leave, a prompt may be
prefilled over several steps, and a preempted request may run again from an earlier position (with the same
tokens). ``rows``: ``{point: flat row indices}`` for a point that holds only some of the step's rows (vLLM's
``logits``: the sampled rows). ``placements``: per point, how the rank's tensor maps onto the full one
(``impl.placements``, as JSON). Every rank of a step must agree on tp, ids, tokens and starts. Format 1 (no
``ids``/``rows``: one fixed set of prompts, all from step 0) is still read. Safetensors and JSON only: nothing
is unpickled.

``DumpWriter`` writes one rank (``tpcheck diff --dump`` writes every rank of impl through it);
``read_dump`` checks a directory is complete and consistent and ``DumpAdapter`` replays it as an engine,
so ``tpcheck compare`` judges it exactly as ``tpcheck diff`` judges a live engine."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.capture.batches import RequestLog, StepBatch

FORMAT = 2  # 2: per-request ids and a point's rows (continuous batching); 1 is still read
_STEP = re.compile(r"step(\d+)\.json")
_RANK = re.compile(r"rank(\d+)")


class DumpError(ValueError):
    """A dump directory that is incomplete, inconsistent or unreadable (names the file at fault)."""


def placement_to_json(p) -> dict:
    if isinstance(p, Replicate):
        return {"type": "replicate"}
    if isinstance(p, Partial):
        return {"type": "partial"}
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim, "replicas": p.replicas}
    if isinstance(p, Fused):
        return {"type": "fused", "parts": [[name, width, placement_to_json(sub)] for name, width, sub in p.parts]}
    raise TypeError(f"unknown placement {p!r}")


def placement_from_json(d: dict, where: str):
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial()
    if kind == "shard":
        return Shard(int(d.get("dim", -1)), int(d.get("replicas", 1)))
    if kind == "fused":
        return Fused(tuple((str(n), int(w), placement_from_json(s, where)) for n, w, s in d["parts"]))
    raise DumpError(f"{where}: unknown placement {d!r}")


class DumpWriter:
    """Writes one rank's points, step by step, into ``root/rank{rank}``. ``points``: a regex of canonical
    point names to keep (None: all); ``budget_bytes``: refuse (DumpError, before writing) a step that would
    take the directory's written bytes past it."""

    def __init__(self, root: str | Path, rank: int, tp: int, dtype: str, engine: str = "impl",
                 points: str | None = None, budget_bytes: int | None = None):
        self.dir = Path(root) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(_STEP.fullmatch(p.name) for p in self.dir.iterdir()):  # two runs' steps must never mix
            raise DumpError(f"{self.dir}: holds steps of an earlier run; dump into a new or empty directory")
        self.rank, self.tp, self.dtype, self.engine = rank, tp, dtype, engine
        self.keep = re.compile(points) if points else None
        self.budget, self.written = budget_bytes, 0

    def write(self, step: int, tokens: list[list[int]], starts: list[int], points: dict,
              ids: list[str] | None = None, rows: dict[str, list[int]] | None = None) -> None:
        """``points``: ``{name: (placement, this rank's tensor or None)}``; ``ids``: the requests' ids in row
        order (default: ``"0"``, ``"1"``, ...: a fixed batch); ``rows``: the rows of a point that holds only some
        (``tpcheck.capture.batches.StepBatch``)."""
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
        save_file(tensors, str(self.dir / f"step{step}.safetensors"))
        ids = [str(i) for i in range(len(tokens))] if ids is None else [str(i) for i in ids]
        rows = {n: list(r) for n, r in (rows or {}).items() if n in kept}
        meta = {"format": FORMAT, "rank": self.rank, "tp": self.tp, "step": step, "ids": ids, "tokens": tokens,
                "starts": starts, "rows": rows, "dtype": self.dtype, "engine": self.engine,
                "placements": {n: placement_to_json(p) for n, (p, _) in kept.items()}}
        (self.dir / f"step{step}.json").write_text(json.dumps(meta))
        self.written += size


@dataclass
class Dump:
    """A complete, consistent dump: ``steps[s]`` holds the tokens and starts of step s, ``ranks`` the tp."""

    root: Path
    tp: int
    dtype: str
    engine: str
    tokens: list[list[list[int]]]   # per step, per request in row order
    starts: list[list[int]]         # per step, per request in row order
    batches: list[StepBatch] | None = None  # per step (format 1: prompt i is request "i")

    def __post_init__(self):
        if self.batches is None:
            self.batches = [StepBatch([str(i) for i in range(len(t))], t, s) for t, s in zip(self.tokens, self.starts)]

    def points(self, step: int) -> dict:
        """``{name: (placement, [rank 0 tensor, ...])}`` of step ``step`` (None where a rank lacks a point)."""
        out: dict = {}
        for r in range(self.tp):
            base = self.root / f"rank{r}" / f"step{step}"
            meta = json.loads((base.with_suffix(".json")).read_text())
            try:
                tensors = load_file(str(base.with_suffix(".safetensors")))
            except (SafetensorError, OSError) as e:
                raise DumpError(f"{base}.safetensors: not a readable safetensors file ({e})") from None
            for name, pj in meta["placements"].items():
                if name not in tensors:
                    raise DumpError(f"{base}.safetensors: lacks {name!r}, which its JSON lists")
                placement = placement_from_json(pj, f"{base}.json: {name}")
                entry = out.setdefault(name, (placement, [None] * self.tp))
                if entry[0] != placement:
                    raise DumpError(f"{base}.json: {name} placement {placement} differs from rank 0's {entry[0]}")
                entry[1][r] = tensors[name]
        return out


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DumpError(f"{path}: not readable JSON ({e})") from None
    for key in ("format", "rank", "tp", "step", "tokens", "starts", "placements", "dtype"):
        if key not in meta:
            raise DumpError(f"{path}: no {key!r}")
    meta.setdefault("ids", [str(i) for i in range(len(meta["tokens"]))] if isinstance(meta["tokens"], list) else None)
    if meta["format"] > FORMAT:
        raise DumpError(f"{path}: dump format {meta['format']} is newer than this tpcheck reads ({FORMAT})")
    return meta


def read_dump(root: str | Path) -> Dump:
    """Check ``root`` holds every rank and every step, agreeing on tp, dtype, tokens and starts; a gap or a
    disagreement is a DumpError naming the rank, step or file."""
    root = Path(root)
    if not root.is_dir():
        raise DumpError(f"{root}: no such dump directory")
    ranks = sorted(int(m.group(1)) for d in root.iterdir() if d.is_dir() and (m := _RANK.fullmatch(d.name)))
    if not ranks:
        raise DumpError(f"{root}: no rank*/ directories (not a tpcheck dump)")
    metas: dict[int, dict[int, dict]] = {}
    for r in ranks:
        steps = {int(m.group(1)): p for p in (root / f"rank{r}").iterdir() if (m := _STEP.fullmatch(p.name))}
        metas[r] = {s: _read_meta(p) for s, p in steps.items()}
    first = next(iter(next(iter(metas.values())).values()), None)
    if first is None:
        raise DumpError(f"{root}/rank{ranks[0]}: no step*.json")
    tp = first["tp"]
    missing = sorted(set(range(tp)) - set(ranks))
    if missing or ranks[-1] >= tp:
        raise DumpError(f"{root}: tp={tp} but rank directories {ranks} (missing ranks {missing})")
    steps = sorted(metas[0])
    if steps != list(range(len(steps))):
        raise DumpError(f"{root}/rank0: steps {steps} are not 0..{len(steps) - 1}")
    batches = []
    log = RequestLog()  # each step continues its requests, or runs them again from an earlier position
    for s in steps:
        where = f"{root}/rank0/step{s}.json"
        try:
            batches.append(_batch(metas[0][s]))
            log.advance(batches[-1])
        except ValueError as e:
            follow = f"does not follow step {s - 1}: " if s else ""
            raise DumpError(f"{where}: {follow}{e}: steps of different runs, or requests mislabelled") from None
    for r in ranks:
        if sorted(metas[r]) != steps:
            raise DumpError(f"{root}/rank{r}: steps {sorted(metas[r])} differ from rank 0's {steps}")
        for s in steps:
            m, m0 = metas[r][s], metas[0][s]
            for key in ("tp", "dtype", "ids", "tokens", "starts"):
                if m[key] != m0[key]:
                    raise DumpError(f"{root}/rank{r}/step{s}.json: {key} {m[key]!r} differs from rank 0's {m0[key]!r}")
    return Dump(root, tp, first["dtype"], first.get("engine", "?"), [b.tokens for b in batches],
                [b.starts for b in batches], batches)


def _batch(meta: dict) -> StepBatch:
    """A step's ``StepBatch`` from its JSON (format 1: prompt i is request "i"); a malformed one is a ValueError."""
    tokens, starts = meta["tokens"], meta["starts"]
    ids = meta.get("ids", [str(i) for i in range(len(tokens))])
    rows = meta.get("rows", {})
    if not isinstance(rows, dict) or not all(isinstance(r, list) for r in rows.values()):
        raise ValueError(f"rows {rows!r} is not {{point: [row, ...]}}")
    return StepBatch([str(i) for i in ids], tokens, starts, rows)


class DumpAdapter:
    """A dump replayed as an engine (``tpcheck.engines.adapter.EngineAdapter``): each ``step`` returns the recorded
    points of the next step. ``schedule(s)`` gives the requests, tokens and positions the engine ran at step s
    (``tpcheck.capture.batches.StepBatch``), which the golden replays instead of its own greedy choice (so a
    sampled or continuously batched run is comparable); ``point_rows``: the rows of the last step's points that
    hold only some."""

    def __init__(self, dump: Dump, reductions=None):
        self.dump, self.step_index = dump, 0
        self.reductions = reductions
        self.point_rows: dict[str, list[int]] = {}

    @property
    def prompts(self) -> list[list[int]]:
        """Each request's tokens of the first step it ran in, in the order the requests first ran."""
        first: dict[str, list[int]] = {}
        for b in self.dump.batches:
            for rid, toks in zip(b.ids, b.tokens):
                first.setdefault(rid, toks)
        return list(first.values())

    @property
    def decode_steps(self) -> int:
        return len(self.dump.tokens) - 1

    def schedule(self, step: int) -> StepBatch:
        return self.dump.batches[step]

    def recorded_tokens(self, step: int) -> list[list[int]]:
        return self.dump.tokens[step]

    def begin(self, prompts, decode_steps) -> None:
        self.step_index = 0

    def step(self, new_tokens, teacher, capture_kv):
        s = self.step_index
        if new_tokens != self.dump.tokens[s]:
            raise DumpError(f"{self.dump.root}: step {s} consumed {self.dump.tokens[s]}, the comparison fed "
                            f"{new_tokens}")
        if teacher is not None:
            raise DumpError("a dump cannot be teacher-forced (--isolate needs a live engine)")
        self.step_index += 1
        self.point_rows = self.dump.batches[s].rows
        return self.dump.points(s)

    def close(self) -> None:
        pass


class DumpingAdapter:
    """Wraps a live engine adapter: every step's points go to the caller and, per rank, to a ``DumpWriter``
    under ``root`` (``tpcheck diff --dump``), so the live run and ``tpcheck compare`` of its dump are judged
    from the same tensors."""

    def __init__(self, inner, root: str | Path, dtype: str, engine: str = "impl", points: str | None = None,
                 budget_bytes: int | None = None):
        self.inner, self.root, self.dtype, self.engine = inner, Path(root), dtype, engine
        self.keep, self.budget = points, budget_bytes
        self.reductions = getattr(inner, "reductions", None)
        self.writers: list[DumpWriter] = []

    @property
    def point_rows(self) -> dict[str, list[int]]:
        return getattr(self.inner, "point_rows", {})

    def begin(self, prompts, decode_steps) -> None:
        self.step_index, self.starts = 0, [0] * len(prompts)
        self.inner.begin(prompts, decode_steps)

    def step(self, new_tokens, teacher, capture_kv):
        points = self.inner.step(new_tokens, teacher, capture_kv)
        if teacher is None:  # the propagated run is what a dump records
            tp = max((len(ranks) for _, ranks in points.values()), default=1)
            if not self.writers:
                per_rank = None if self.budget is None else self.budget // tp
                self.writers = [DumpWriter(self.root, r, tp, self.dtype, self.engine, self.keep, per_rank)
                                for r in range(tp)]
            rows = getattr(self.inner, "point_rows", {})
            for r, w in enumerate(self.writers):
                w.write(self.step_index, [list(t) for t in new_tokens], list(self.starts),
                        {n: (p, ranks[r]) for n, (p, ranks) in points.items()}, rows=rows)
            self.step_index += 1
            self.starts = [s + len(t) for s, t in zip(self.starts, new_tokens)]
        return points

    def close(self) -> None:
        self.writers = []
        self.inner.close()
