"""Write a run as SGLang's dumper would: the format's writer, built from its source's documented format
(``python/sglang/srt/debug_utils/dumper.py``), for tests, demos and engines that want to emit it.

``write_from_dump`` converts a tpcheck dump (``tpcheck diff --dump``, ``generate_dumped``) of any engine into
SGLang's layout, point by point and rank by rank: each point under the name the rules give it (the
non-intrusive dumper's module names), its rank's tensor as the engine held it, its placement as a dims
annotation (``spelling``: ``"new"`` ``h[tp]``, ``"old"`` ``h(tp)``, ``"none"``: none, as the non-intrusive
dumper writes, the rules' defaults then apply), and per step the auxiliary ``input_ids`` / ``positions`` /
``seq_lens`` / ``req_pool_indices`` (and ``rids`` with ``rids=True``) of the batch, as SGLang's ``ForwardBatch``
holds them. Logits are written as SGLang samples them: each request's last row, on every rank. The KV cache
(SGLang's dumper does not dump it) is left out.

    python -m tpcheck.engines.sglang_dump.writer --from runs/impl --model CKPT --out runs/sglang

``FileSink`` writes the files itself (``torch.save({"value", "meta"})``, the name's tags in SGLang's order);
any object with the same ``dump(rank, name, value, dims, tags)`` / ``step(rank)`` methods can stand in (the
tests drive SGLang's own ``_Dumper`` through one where its module imports)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from impl.config import load_config
from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.engines.dump.replay import read_dump
from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.sglang_dump import batches, passes, rules as name_rules
from tpcheck.engines.sglang_dump.dims import Dim, Dims, Split, format_dims


class FileSink:
    """SGLang's file layout: ``{out}/{exp_name}/step=..___rank=..___dump_index=..___name=..___...pt`` holding
    ``{"value", "meta"}``; ``meta`` the tags, ``world_rank``, ``world_size``, ``sglang_parallel_info`` and
    ``dims``."""

    def __init__(self, out: str | Path, tp: int, exp_name: str = "dump_tpcheck"):
        self.dir = Path(out) / exp_name
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(self.dir.iterdir()):
            raise DumpError(f"{self.dir}: not empty; write into a new directory")
        self.tp, self.steps, self.index = tp, [0] * tp, [0] * tp

    def dump(self, rank: int, name: str, value, dims: str | None, tags: dict) -> None:
        self.index[rank] += 1
        full = {"step": self.steps[rank], "rank": rank, "dump_index": self.index[rank], "name": name,
                "recompute_status": "disabled", **tags}
        meta = {**full, "world_rank": rank, "world_size": self.tp, "sglang_parallel_info": parallel_info(rank, self.tp)}
        if dims is not None:
            meta["dims"] = dims
        torch.save({"value": value, "meta": meta}, self.dir / ("___".join(f"{k}={v}" for k, v in full.items()) + ".pt"))

    def step(self, rank: int) -> None:
        self.steps[rank] += 1


class PassSink:
    """SGLang's older forward-hook layout (``tpcheck.engines.sglang_dump.passes``):
    ``{out}/TP{r}_PP0_Rank{r}_pid{pid}/Pass{n:05d}.pt``, one dict per pass of each module's output under its module
    name (a tuple's as a list), the batch as ``model.forward_batch_info.*``, and what that dumper records after
    writing a pass (the logits processor's) in the next pass's file; the last pass's is never written, as there.
    Request ids and pool slots are not recorded (the layout has none). ``emit`` writes one pass; a subclass can
    hand it to SGLang's own ``TensorDumper`` instead."""

    def __init__(self, out: str | Path, tp: int, pid: int = 4242):
        self.dirs = [Path(out) / f"TP{r}_PP0_Rank{r}_pid{pid}" for r in range(tp)]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
            if any(d.iterdir()):
                raise DumpError(f"{d}: not empty; write into a new directory")
        self.tp, self.passes = tp, [0] * tp
        self.now: list[dict] = [{} for _ in range(tp)]
        self.late: list[dict] = [{} for _ in range(tp)]
        self.carry: list[dict] = [{} for _ in range(tp)]
        self.batch: list[dict] = [{} for _ in range(tp)]

    def dump(self, rank: int, name: str, value, dims: str | None, tags: dict) -> bool:
        """Record ``name``'s value; False where this layout has no place for it (a module's input, request ids,
        pool slots)."""
        if name in batches.REQUIRED:
            self.batch[rank][name] = value
            return True
        if name in batches.AUX_NAMES or ".output" not in name:
            return False
        key, index = passes.entry_key(name)
        (self.late if passes.is_late(key, "model") else self.now)[rank].setdefault(key, {})[index] = value
        return True

    def step(self, rank: int) -> None:
        collapse = lambda parts: {k: _collapsed(k, v) for k, v in parts.items()}  # noqa: E731
        self.emit(rank, collapse(self.now[rank]), collapse(self.late[rank]), self.batch[rank])
        self.now[rank], self.late[rank], self.batch[rank] = {}, {}, {}
        self.passes[rank] += 1

    def emit(self, rank: int, now: dict, late: dict, batch: dict) -> None:
        entries = {**self.carry[rank], **now, **{f"model{passes.BATCH}{k}": v for k, v in batch.items()}}
        torch.save(entries, self.dirs[rank] / f"Pass{self.passes[rank]:05d}.pt")
        self.carry[rank] = late


def _collapsed(key: str, parts: dict):
    """A module's outputs by index (None: the one a rule names alone, index 0 of a tuple) as the forward hook
    stores them: one tensor, or a list."""
    if list(parts) == [None]:
        return parts[None]
    parts = {0 if i is None else i: t for i, t in parts.items()}
    if sorted(parts) != list(range(len(parts))):
        raise DumpError(f"{key}: outputs {sorted(parts)} are not a tuple's 0..n-1")
    return [parts[i] for i in range(len(parts))]


def parallel_info(rank: int, tp: int) -> dict:
    """SGLang's ``sglang_parallel_info`` of a plain TP run (no PP, DP attention, EP or CP)."""
    return {"tp_rank": rank, "tp_size": tp, "pp_rank": 0, "pp_size": 1, "moe_ep_rank": 0, "moe_ep_size": 1,
            "moe_tp_rank": rank, "moe_tp_size": tp, "moe_dp_rank": 0, "moe_dp_size": 1,
            "enable_dp_attention": False, "attn_tp_rank": rank, "attn_tp_size": tp, "attn_dp_rank": 0,
            "attn_dp_size": 1, "local_attn_dp_rank": 0, "local_attn_dp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1}


def dims_of(placement, spelling: str) -> str | None:
    """A placement as a dims annotation of a ``[tokens, features]`` tensor. KV heads replicated over ranks (tp >
    KV heads) are written ``h[tp]``, the heads each rank holds: the grammar has no spelling for replicas, and the
    reader recovers them from the model's KV heads."""
    if spelling == "none":
        return None
    split = {Replicate: (), Partial: (Split("tp", partial=True),)}.get(type(placement), (Split("tp"),))
    return format_dims(Dims((Dim("t"), Dim("h", split))), old=spelling == "old")


def passes_rules() -> list:
    """The rules that name points in the older forward-hook layout: its own, then the shipped ones."""
    return name_rules.load_rules([passes.RULES])


def write_from_dump(src: str | Path, model: str, sink, spelling: str = "new", rids: bool = False,
                    rules: list | None = None) -> list[str]:
    """Every step of the tpcheck dump ``src`` into ``sink`` (a ``FileSink``, or SGLang's dumper behind the same
    methods); returns the points left out (no rule names them, or the KV cache)."""
    dump, cfg = read_dump(src), load_config(model)
    rules = name_rules.for_run(rules or name_rules.load_rules(), cfg.model_type, "sglang")
    left_out: set[str] = set()
    slots: dict[str, int] = {}
    for s, b in enumerate(dump.batches):
        for rid in b.ids:
            slots.setdefault(rid, len(slots))
        aux = {"input_ids": torch.tensor([t for toks in b.tokens for t in toks], dtype=torch.int64),
               "positions": torch.tensor([p for st, toks in zip(b.starts, b.tokens)
                                          for p in range(st, st + len(toks))], dtype=torch.int64),
               "seq_lens": torch.tensor(b.kv_lens, dtype=torch.int64),
               "req_pool_indices": torch.tensor([slots[r] for r in b.ids], dtype=torch.int64)}
        if rids:
            aux["rids"] = list(b.ids)
        points = dump.points(s)
        for rank in range(dump.tp):
            for name, value in aux.items():
                sink.dump(rank, name, value, None, {})
            for point, (placement, tensors) in points.items():
                named = name_rules.engine_name(rules, point, cfg.num_layers)
                if named is None or ".kv." in point:
                    left_out.add(point)
                    continue
                engine, rule, layer = named
                t = tensors[rank] if tensors[rank] is not None else tensors[0]  # gathered logits: every rank
                if rule.rows == "last":
                    t = t[_last_of(b, point, t)]
                p = Shard(-1) if isinstance(placement, Fused) else placement
                t, dims = _as_dumped(t, rule, dims_of(p, spelling), cfg.head_dim)
                if sink.dump(rank, engine, t.contiguous(), dims, {} if layer is None else
                             {"layer_id": layer}) is False:  # no place for it in the sink's layout
                    left_out.add(point)
            sink.step(rank)
    return sorted(left_out)


def _as_dumped(t: torch.Tensor, rule, dims: str | None, head_dim: int) -> tuple[torch.Tensor, str | None]:
    """A point's ``[rows, heads * head_dim]`` rank tensor as the engine hands it to the dumped module where the
    name's rule reads it per head first (``b s h d``: SGLang's Gemma 3 attention takes q and k as ``[1, tokens,
    heads, head_dim]``), with the annotation ``dims_of`` gave a ``t h`` tensor rewritten to that shape."""
    first = rule.dims[0] if rule.dims else None
    if first is None or [d.name for d in first.dims] != ["b", "s", "h", "d"]:
        return t, dims
    shaped = t.reshape(1, t.shape[0], -1, head_dim)
    return shaped, None if dims is None else dims.replace("t ", "b s ", 1) + " d"


def _last_of(b, point: str, t: torch.Tensor) -> list[int]:
    """Indices into ``t`` (the step's rows, or only those ``b.rows[point]`` names) of each request's last row."""
    last = batches.last_rows(b)
    held = b.rows.get(point)
    if held is None:
        return last
    if sorted(held) != last:
        raise DumpError(f"step rows {held} of {point} are not each request's last row {last}: SGLang samples those")
    return [held.index(r) for r in last]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpcheck.engines.sglang_dump.writer",
                                 description="convert a tpcheck dump into SGLang's dumper format")
    ap.add_argument("--from", dest="src", required=True, help="a tpcheck dump directory (tpcheck diff --dump)")
    ap.add_argument("--model", required=True, help="the checkpoint the run used")
    ap.add_argument("--out", required=True, help="the new SGLang dump directory (DUMPER_DIR)")
    ap.add_argument("--dims", choices=["new", "old", "none"], default="new", help="the dims spelling to write")
    ap.add_argument("--rids", action="store_true", help="dump the request ids too")
    ap.add_argument("--layout", choices=["dumper", "passes"], default="dumper",
                    help="SGLang's dumper's files (default), or its older forward-hook dumper's Pass files")
    a = ap.parse_args(argv)
    tp = read_dump(a.src).tp
    with torch.no_grad():
        if a.layout == "passes":
            left = write_from_dump(a.src, a.model, PassSink(a.out, tp), "none", rules=passes_rules())
        else:
            left = write_from_dump(a.src, a.model, FileSink(a.out, tp), a.dims, a.rids)
    print(f"wrote {a.out}; not written (no SGLang name, or the KV cache): {', '.join(left) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
