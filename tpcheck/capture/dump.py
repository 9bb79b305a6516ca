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
``model_fingerprint`` the checkpoint's (``tpcheck.inputs.fingerprint``; null when the writer was not
told the checkpoint). ``cpu_bf16_rounding`` (optional: older dumps and writers that do not know lack it): whether
the CPU the rank ran on converts float32 to bfloat16 in hardware (``tpcheck.capture.rounding``: without it vLLM's
CPU kernels truncate, and ``tpcheck compare`` declares so). Reading checks every field's type and bounds (``tpcheck.inputs.validate``), that a rank's
JSON names the rank and step of the file it sits in, every tensor against its record (a floating-point tensor,
the rows all ranks agree on, a placement that fits it), and ``Dump.check_model`` the recorded checkpoint and
token ids against ``--model``: a mismatch is a DumpError (exit 2) naming the file and the tensor.

``DumpWriter`` writes one rank (``tpcheck diff --dump`` writes every rank of impl through it);
``read_dump`` checks a directory is complete and consistent and ``DumpAdapter`` replays it as an engine,
so ``tpcheck compare`` judges it exactly as ``tpcheck diff`` judges a live engine."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from impl.placements import Fused, Shard
from tpcheck.capture.rounding import declared_rounding
from tpcheck.capture.background import BackgroundWriter
from tpcheck.capture.dump_format import DumpError, check_fits as _check_fits, check_rows, placement_from_json, placement_to_json
from tpcheck.capture.batches import RequestLog, StepBatch, UnknownPrefix
from tpcheck.inputs.step_store import load_step, save_step, write_json_atomic
from tpcheck.inputs.validate import MAX_TP, field, int_in, read_json, token_lists, verify_tensor
from tpcheck.inputs.fingerprint import fingerprint
from impl.config import load_config

FORMAT = 2  # 2: per-request ids and a point's rows (continuous batching), per-tensor hashes, the checkpoint's id
logger = logging.getLogger(__name__)
_STEP = re.compile(r"step(\d+)\.json")
_RANK = re.compile(r"rank(\d+)")


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
        if any(_STEP.fullmatch(p.name) for p in self.dir.iterdir()):  # two runs' steps must never mix
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


@dataclass
class Dump:
    """A complete, consistent dump: ``steps[s]`` holds the tokens and starts of step s, ``ranks`` the tp."""

    root: Path
    tp: int
    dtype: str
    engine: str
    tokens: list[list[list[int]]]   # per step, per request in row order
    starts: list[list[int]]         # per step, per request in row order
    batches: list[StepBatch] | None = None  # per step
    fingerprint: str | None = None  # the checkpoint's, as the writer recorded it
    point_names: list[frozenset[str]] | None = None  # per step, the points rank 0 recorded
    cpu_bf16_rounding: bool | None = None  # the ranks' CPUs round float32 to bfloat16 in hardware; None: not recorded

    @property
    def rounding(self):
        """The dumped engine's declared rounding (``tpcheck.capture.rounding``), from the CPU flags it recorded."""
        return declared_rounding(self.engine, self.dtype, self.cpu_bf16_rounding, "the CPU the dump ran on")

    def __post_init__(self):
        if self.batches is None:
            self.batches = [StepBatch([str(i) for i in range(len(t))], t, s) for t, s in zip(self.tokens, self.starts)]

    def check_model(self, model_dir: str) -> None:
        """Refuse a dump of another checkpoint (its recorded fingerprint) or with token ids outside its vocab."""
        if self.fingerprint is None:
            logger.warning(f"tpcheck compare: {self.root} records no checkpoint fingerprint (its writer was not "
                           f"told the checkpoint): that it was written by a run of {model_dir} is not checked")
        elif self.fingerprint != fingerprint(model_dir):
            raise DumpError(f"{self.root}/rank0/step0.json: model_fingerprint is not that of --model {model_dir} "
                            "(the dump was written by a run of another checkpoint, or its weights changed)")
        vocab = load_config(model_dir).vocab_size
        for s, (toks, b) in enumerate(zip(self.tokens, self.batches)):
            token_lists(toks, vocab, f"{self.root}/rank0/step{s}.json: tokens", DumpError)
            token_lists(list(b.prompts.values()), vocab, f"{self.root}/rank0/step{s}.json: prompts", DumpError)

    def points(self, step: int) -> dict:
        """``{name: (placement, [rank 0 tensor, ...])}`` of step ``step`` (None where a rank lacks a point);
        every tensor checked against its record and its placement."""
        out: dict = {}
        for r in range(self.tp):
            base = self.root / f"rank{r}" / f"step{step}"
            meta = _read_meta(base.with_suffix(".json"), r, step)
            tensors = load_step(base.with_suffix(".safetensors"), DumpError)
            for name, pj in meta["placements"].items():
                if name not in tensors:
                    raise DumpError(f"{base}.safetensors: lacks {name!r}, which its JSON lists")
                t, where = tensors[name], f"{base}.safetensors: {name}"
                verify_tensor(t, meta["tensors"].get(name), where, DumpError)
                if not t.is_floating_point() and not name.endswith(".moe.topk_ids"):  # ids: the experts a router chose
                    raise DumpError(f"{where}: a {t.dtype} tensor in a {self.dtype} dump (points are floating-point)")
                placement = placement_from_json(pj, f"{base}.json: {name}")
                _check_fits(t, placement, where)
                entry = out.setdefault(name, (placement, [None] * self.tp))
                if entry[0] != placement:
                    raise DumpError(f"{base}.json: {name} placement {placement} differs from rank 0's {entry[0]}")
                rows = {x.shape[0] for x in entry[1] if x is not None and x.dim()}
                by_rows = isinstance(placement, Shard) and placement.dim % max(t.dim(), 1) == 0
                if t.dim() and rows and t.shape[0] not in rows and not by_rows:
                    raise DumpError(f"{where}: {t.shape[0]} rows, other ranks' {sorted(rows)[0]}")
                check_rows(t, name, placement, meta, where, base.with_suffix(".json"))
                entry[1][r] = t
        return out


def _read_meta(path: Path, rank: int, step: int) -> dict:
    """A step's JSON, every field checked (types, bounds); it must name the ``rank`` and ``step`` of its file."""
    meta = read_json(path, DumpError, "dump step")
    fmt = field(meta, "format", "int", str(path), DumpError)
    if fmt > FORMAT:
        raise DumpError(f"{path}: dump format {fmt} is newer than this tpcheck reads ({FORMAT})")
    if fmt < FORMAT:
        raise DumpError(f"{path}: dump format {fmt} records no tensor hashes; write the dump again")
    for key, kind in (("rank", "int"), ("tp", "int"), ("step", "int"), ("tokens", "list"), ("starts", "list"),
                      ("placements", "dict"), ("dtype", "str"), ("tensors", "dict")):
        field(meta, key, kind, str(path), DumpError)
    int_in(meta["tp"], 1, MAX_TP, f"{path}: tp", DumpError)
    if meta["rank"] != rank or meta["step"] != step:
        raise DumpError(f"{path}: says rank {meta['rank']} step {meta['step']}, but sits in rank{rank}/step{step} "
                        "(files copied between ranks or steps)")
    token_lists(meta["tokens"], None, f"{path}: tokens", DumpError)
    for i, s in enumerate(meta["starts"]):
        int_in(s, 0, 2**40, f"{path}: starts[{i}]", DumpError)
    if len(meta["starts"]) != len(meta["tokens"]):
        raise DumpError(f"{path}: {len(meta['starts'])} starts for {len(meta['tokens'])} prompts")
    ids = field(meta, "ids", "list", str(path), DumpError)
    if len(ids) != len(meta["tokens"]) or not all(isinstance(i, str) and len(i) <= 256 for i in ids):
        raise DumpError(f"{path}: ids must be one short string per request ({len(meta['tokens'])})")
    rows = field(meta, "rows", "dict", str(path), DumpError, default={})
    for name, r in rows.items():
        if not isinstance(r, list):
            raise DumpError(f"{path}: rows[{name!r}] must be a list of row indices")
        for i in r:
            int_in(i, 0, 2**40, f"{path}: rows[{name!r}]", DumpError)
    prompts = field(meta, "prompts", "dict", str(path), DumpError, default={})
    token_lists(list(prompts.values()), None, f"{path}: prompts", DumpError)
    if not set(prompts) <= set(ids):
        raise DumpError(f"{path}: prompts of requests not in the step: {sorted(set(prompts) - set(ids))[:5]}")
    fp = meta.get("model_fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise DumpError(f"{path}: model_fingerprint must be a string or null")
    if meta.get("cpu_bf16_rounding") is not None and not isinstance(meta["cpu_bf16_rounding"], bool):
        raise DumpError(f"{path}: cpu_bf16_rounding must be true, false or absent")
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
        metas[r] = {s: _read_meta(p, r, s) for s, p in steps.items()}
    first = next(iter(next(iter(metas.values())).values()), None)
    if first is None:
        raise DumpError(f"{root}/rank{ranks[0]}: no step*.json")
    tp = first["tp"]
    if ranks != list(range(tp)):  # tp is bounded (MAX_TP) by _read_meta
        missing = sorted(set(range(tp)) - set(ranks))
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
        except UnknownPrefix as e:  # the diagnosis is the engine's prefix cache, not a mixed or mislabelled dump
            raise DumpError(f"{where}: {e}") from None
        except ValueError as e:
            follow = f"does not follow step {s - 1}: " if s else ""
            raise DumpError(f"{where}: {follow}{e}: steps of different runs, or requests mislabelled") from None
    for r in ranks:
        if sorted(metas[r]) != steps:
            raise DumpError(f"{root}/rank{r}: steps {sorted(metas[r])} differ from rank 0's {steps}")
        for s in steps:
            m, m0 = metas[r][s], metas[0][s]
            for key in ("tp", "dtype", "ids", "tokens", "starts", "prompts", "model_fingerprint"):
                if m.get(key) != m0.get(key):
                    raise DumpError(f"{root}/rank{r}/step{s}.json: {key} {m.get(key)!r} differs from rank 0's "
                                    f"{m0.get(key)!r}")
    return Dump(root, tp, first["dtype"], str(first.get("engine", "?")), [b.tokens for b in batches],
                [b.starts for b in batches], batches=batches, fingerprint=first.get("model_fingerprint"),
                point_names=[frozenset(metas[0][s]["placements"]) for s in steps],
                cpu_bf16_rounding=_all_or_none([m.get("cpu_bf16_rounding") for ms in metas.values() for m in ms.values()]))


def _all_or_none(flags: list) -> bool | None:
    """Whether every rank's CPU rounds to bfloat16 in hardware; None where a step does not record it."""
    return None if any(f is None for f in flags) else all(flags)


def _batch(meta: dict) -> StepBatch:
    """A step's ``StepBatch`` from its (checked) JSON; an inconsistent one is a ValueError."""
    return StepBatch([str(i) for i in meta["ids"]], meta["tokens"], meta["starts"], meta.get("rows", {}),
                     meta.get("prompts", {}))


class DumpAdapter:
    """A dump replayed as an engine (``tpcheck.engines.adapter.EngineAdapter``): each ``step`` returns the recorded
    points of the next step. ``schedule(s)`` gives the requests, tokens and positions the engine ran at step s
    (``tpcheck.capture.batches.StepBatch``), which the golden replays instead of its own greedy choice (so a
    sampled or continuously batched run is comparable); ``point_rows``: the rows of the last step's points that
    hold only some."""

    def __init__(self, dump: Dump, reductions=None):
        self.dump, self.step_index = dump, 0
        self.reductions, self.rounding = reductions, dump.rounding
        self.point_rows: dict[str, list[int]] = {}

    @property
    def prompts(self) -> list[list[int]]:
        """Each request's tokens from position 0 to the end of the first step it ran in (a cached prefix's
        recorded tokens included), in the order the requests first ran."""
        first: dict[str, list[int]] = {}
        for b in self.dump.batches:
            for rid, toks, start in zip(b.ids, b.tokens, b.starts):
                if rid not in first:
                    first[rid] = list(b.prompts.get(rid, [])[:start]) + list(toks)
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

    def lacking(self, names: list[str]) -> dict[str, int]:
        """``{point: the first step}`` of each of ``names`` that some step does not record at every row."""
        out: dict[str, int] = {}
        held_by_step = self.dump.point_names or [frozenset()] * len(self.dump.batches)  # unknown: none held
        for s, (held, b) in enumerate(zip(held_by_step, self.dump.batches)):
            for n in names:
                if n not in out and (n not in held or any(n == p or p.endswith(".") and n.startswith(p)
                                                          for p in b.rows)):
                    out[n] = s
        return out

    def step(self, new_tokens, teacher, capture_kv):
        s = self.step_index
        if new_tokens != self.dump.tokens[s]:
            raise DumpError(f"{self.dump.root}: step {s} consumed {self.dump.tokens[s]}, the comparison fed "
                            f"{new_tokens}")
        if teacher is not None:  # its local pass forces the golden onto its inputs instead (tpcheck.pipeline.forced)
            raise DumpError("a dump cannot be teacher-forced: it records what the engine ran")
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
                 budget_bytes: int | None = None, model: str | None = None):
        self.inner, self.root, self.dtype, self.engine, self.model = inner, Path(root), dtype, engine, model
        self.keep, self.budget, self.reductions = points, budget_bytes, getattr(inner, "reductions", None)
        self.teacher_forcing = getattr(inner, "teacher_forcing", False)  # dumping does not take the local pass away
        self.rounding, self.cpu_bf16 = getattr(inner, "rounding", None), getattr(inner, "cpu_bf16_rounding", None)
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
                self.writers = [DumpWriter(self.root, r, tp, self.dtype, self.engine, self.keep, per_rank, self.model,
                                           cpu_bf16_rounding=self.cpu_bf16) for r in range(tp)]
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
