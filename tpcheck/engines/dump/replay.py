"""A dump read back and replayed as an engine (``tpcheck compare``): ``read_dump`` checks a directory is complete
and consistent (the layout and the checks: ``tpcheck.capture.dump``, which writes it) and ``DumpAdapter`` replays
it, so ``tpcheck compare`` judges it exactly as ``tpcheck diff`` judges a live engine."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from impl.config import load_config
from impl.placements import Shard
from tpcheck.capture.batches import RequestLog, StepBatch, UnknownPrefix
from tpcheck.capture.dump import FORMAT, STEP_FILE
from tpcheck.capture.dump_format import DumpError, check_fits, check_rows, placement_from_json
from tpcheck.capture.rounding import declared_rounding
from tpcheck.engines.adapter import EngineAdapter
from tpcheck.inputs.files.fingerprint import fingerprint
from tpcheck.inputs.files.step_store import load_step
from tpcheck.inputs.files.validate import MAX_TP, field, int_in, read_json, token_lists, verify_tensor

logger = logging.getLogger(__name__)
_RANK = re.compile(r"rank(\d+)")


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
                check_fits(t, placement, where)
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
        steps = {int(m.group(1)): p for p in (root / f"rank{r}").iterdir() if (m := STEP_FILE.fullmatch(p.name))}
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


class DumpAdapter(EngineAdapter):
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


