"""``tpcheck invariance --dumps A B [C ...]``: two or more dumps of the same requests, written by any engine under
any schedules (``tpcheck diff --dump``, the vLLM ``TPCHECK_DUMP`` plugin, an engine's own ``DumpWriter``:
``tpcheck.capture.dump``), compared bit for bit point by point. The engine ran the schedules; this only reads
what each run recorded, unshards it (``tpcheck.measure.unshard``) and compares it (``tpcheck.result.invariance``).

Requests are matched across dumps by their token ids, never by the engine's request ids (two runs number them
their own way): a request of another dump matches one of the reference dump (the first) when each one's tokens
begin with the other's prompt (the tokens its engine knew when it first scheduled it: the step's recorded
``prompts``, else the tokens of its first step). Requests of a dump that match none (a batch's companions) are not
compared; two requests with the same prompt (parallel sampling) match in the order they first ran. Every request
of the reference dump that another dump holds is compared, each as a schedule of its own (``B`` when one request
of ``B`` matched, ``B:<id>`` for each otherwise).

Positions: a request's point rows are keyed by the position they computed (a token point: the step's row of that
position; a point that holds only some rows, vLLM's sampled ``logits``: the rows it lists; the KV-cache points:
every cached position, after the last step that wrote the position before them), so a whole prefill, a chunked one
and a prefix-cache hit (which computes only the positions after its cached blocks) compare on the positions both
computed. Only the positions where both runs fed the same tokens are compared (a sampled run parts there once its
bits changed a sample). Steps are named as ``tpcheck invariance`` names them: 0 the prefill (every prompt
position, of the longer of the two prompts), ``k`` the position decode step ``k`` feeds. A position run twice (a
preemption's recompute) keeps its first rows."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.dump.replay import Dump, read_dump
from tpcheck.capture.points import kind_of
from tpcheck.measure.unshard import unshard
from tpcheck.pipeline.rows import subset_rows
from tpcheck.result.invariance import InvarianceResult, Positions, compare_captures


@dataclass
class RequestRows:
    """One request of one dump: ``tokens`` from position 0 (as far as it ran), ``prompt_len`` (its prompt's
    length), ``rows[point][position]`` a token point's row, ``cache[point]``: ``[(last position, rows 0..it)]``
    after each step, in step order."""

    rid: str
    tokens: list[int]
    prompt_len: int
    rows: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    cache: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)


def requests_of(dump: Dump, points: str | None = None) -> dict[str, RequestRows]:
    """Every request of ``dump`` with its rows by position (see the module docstring); ``points``: a regex the
    compared points fullmatch (None: all)."""
    out: dict[str, RequestRows] = {}
    keep = None if points is None else re.compile(points)
    for s, b in enumerate(dump.batches):
        for rid, toks, start in zip(b.ids, b.tokens, b.starts):
            if rid not in out:
                prompt = b.prompts.get(rid)
                out[rid] = RequestRows(rid, list(prompt[:start]) if prompt else [],
                                       len(prompt) if prompt else start + len(toks))
            r = out[rid]
            r.tokens = r.tokens[:start] + list(toks) if start <= len(r.tokens) else r.tokens  # a gap: _read refused it
        _read_step(dump, s, out, keep)
    return out


def _read_step(dump: Dump, s: int, out: dict[str, RequestRows], keep) -> None:
    """Step ``s``'s points, each request's rows added to ``out`` by position."""
    b = dump.batches[s]
    offsets = [sum(b.row_lens[:i]) for i in range(len(b.ids))]
    kv_offsets = [sum(b.kv_lens[:i]) for i in range(len(b.ids))]
    owner = [i for i, n in enumerate(b.row_lens) for _ in range(n)]  # the request of each flat row
    for name, (placement, per_rank) in dump.points(s).items():
        for u in unshard(name, placement, per_rank):
            if keep is not None and not keep.fullmatch(u.name):
                continue
            if kind_of(u.name).rows == "cache":
                for i, rid in enumerate(b.ids):
                    n = b.kv_lens[i]
                    out[rid].cache.setdefault(u.name, []).append((n - 1, u.tensor[kv_offsets[i]:kv_offsets[i] + n]))
                continue
            subset = subset_rows(name, b.rows)
            flat = range(u.tensor.shape[0]) if subset is None else subset
            for j, f in enumerate(flat):
                i = owner[f]
                pos = b.starts[i] + f - offsets[i]
                out[b.ids[i]].rows.setdefault(u.name, {}).setdefault(pos, u.tensor[j])


def _matches(a: RequestRows, b: RequestRows) -> bool:
    """Each one's tokens begin with the other's prompt (module docstring)."""
    return a.tokens[:b.prompt_len] == b.tokens[:b.prompt_len] and b.tokens[:a.prompt_len] == a.tokens[:a.prompt_len] \
        and len(a.tokens) >= b.prompt_len and len(b.tokens) >= a.prompt_len


def match(ref: dict[str, RequestRows], other: dict[str, RequestRows]) -> list[tuple[RequestRows, RequestRows]]:
    """``(reference request, its match)`` pairs, in the reference's order; each request matched once."""
    used: set[str] = set()
    pairs = []
    for a in ref.values():
        b = next((b for b in other.values() if b.rid not in used and _matches(a, b)), None)
        if b is not None:
            used.add(b.rid)
            pairs.append((a, b))
    return pairs


def captures(a: RequestRows, b: RequestRows) -> tuple[dict, dict, Positions, int]:
    """``a`` and ``b`` as two ``Capture``s on the positions both computed with the same tokens (a point one of
    them never recorded: the other's rows alone, which ``compare_captures`` notes), the positions of each
    ``(step, point)``'s rows, and the prompt length that names the steps."""
    same = 0
    while same < min(len(a.tokens), len(b.tokens)) and a.tokens[same] == b.tokens[same]:
        same += 1
    prompt = max(a.prompt_len, b.prompt_len)

    def step_of(p: int) -> int:
        return 0 if p < prompt else p - prompt + 1
    ca: dict = {}
    cb: dict = {}
    where: Positions = {}
    for name in sorted(set(a.rows) | set(b.rows)):
        ra, rb = a.rows.get(name, {}), b.rows.get(name, {})
        sides = [(ca, ra), (cb, rb)] if ra and rb else [(ca, ra)] if ra else [(cb, rb)]
        for p in sorted(set(ra) & set(rb) if ra and rb else set(ra) | set(rb)):
            if p < same:
                for cap, got in sides:
                    cap.setdefault((step_of(p), name), []).append(got[p])
                where.setdefault((step_of(p), name), []).append(p)
    for cap, req in ((ca, a), (cb, b)):
        for name, after in req.cache.items():
            for last, t in after:  # a step's last write counts (a prefill in chunks: after its last chunk)
                if last < same:
                    cap[(step_of(last), name)] = [t]
    return _stacked(ca), _stacked(cb), where, prompt


def _stacked(rows: dict) -> dict:
    """Each ``(step, point)``'s rows as one tensor (a cache point's is one already)."""
    return {k: v[0] if len(v) == 1 and v[0].dim() == 2 else torch.stack(v) for k, v in rows.items()}


def _name(path: Path, paths: list[Path]) -> str:
    """A dump's schedule name: its directory's name, or its path where two dumps share a name."""
    return path.name if [p.name for p in paths].count(path.name) == 1 else str(path)


def run_dumps(paths: list[Path], ulps: float | None = None, points: str | None = None) -> InvarianceResult:
    """Every dump of ``paths`` against the first (module docstring); ``ulps``: the declared invariance (0
    bitwise, N ulps, None: report only). A dump that is not one, that holds none of the reference's requests, or
    that is of another checkpoint, is a DumpError naming it (exit 2)."""
    if len(paths) < 2:
        raise ValueError(f"--dumps takes two or more dump directories, got {len(paths)}")
    dumps = [read_dump(p) for p in paths]
    prints = {d.fingerprint for d in dumps if d.fingerprint is not None}
    if len(prints) > 1:
        raise DumpError(f"{paths[0]} and the other dumps were written by runs of different checkpoints "
                        "(their model_fingerprint differ): their bits are not comparable")
    reqs = [requests_of(d, points) for d in dumps]
    ref_name = _name(paths[0], paths)
    names, described, rows = [ref_name], [_describe(paths[0], dumps[0], reqs[0])], []
    for path, d, other in zip(paths[1:], dumps[1:], reqs[1:]):
        pairs = match(reqs[0], other)
        if not pairs:
            raise DumpError(f"{path}: holds none of {paths[0]}'s requests (matched by their prompt tokens): dumps of "
                            "other requests")
        for a, b in pairs:
            sched = _name(path, paths) + ("" if len(pairs) == 1 else f":{a.rid}")
            ca, cb, where, prompt = captures(a, b)
            names.append(sched)
            described.append(f"{_describe(path, d, other)}; its request {b.rid} is {paths[0].name}'s {a.rid} "
                             f"({prompt} prompt tokens, {len(where)} (step, point)s compared)")
            rows += compare_captures(ca, cb, sched, prompt, positions=where)
    meta = {"dumps": [str(p) for p in paths], "engines": [d.engine for d in dumps], "tps": [d.tp for d in dumps],
            "dtypes": [d.dtype for d in dumps], "model_fingerprint": next(iter(prints), None)}
    return InvarianceResult(names, described, rows, ulps, meta)


def _describe(path: Path, d: Dump, reqs: dict[str, RequestRows]) -> str:
    sizes = [len(b.ids) for b in d.batches]
    return (f"{path}: {d.engine} tp {d.tp} {d.dtype}, {len(d.batches)} steps of {min(sizes)}-{max(sizes)} "
            f"requests, {len(reqs)} request(s)")
