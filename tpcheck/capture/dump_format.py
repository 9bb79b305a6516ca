"""The dump format's pieces shared by its writer and its reader: the error it raises, placements as JSON."""
from __future__ import annotations

from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.capture.points import KINDS, split_point
from tpcheck.inputs.files.validate import MAX_TP, field, int_in


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
        return Shard(int_in(d.get("dim", -1), -8, 7, f"{where}: shard dim", DumpError),
                     int_in(d.get("replicas", 1), 1, MAX_TP, f"{where}: shard replicas", DumpError))
    if kind == "fused":
        parts = field(d, "parts", "list", where, DumpError)
        if not all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) for x in parts):
            raise DumpError(f"{where}: fused parts must be [name, width, placement] triples")
        return Fused(tuple((n, int_in(w, 1, 2**40, f"{where}: {n} width", DumpError), placement_from_json(s, where))
                           for n, w, s in parts))
    raise DumpError(f"{where}: unknown placement {str(d)[:80]}")


def check_fits(t, p, where: str) -> None:
    """The placement must fit the tensor: a Shard dim inside it, Fused widths summing to its last dim."""
    if isinstance(p, Shard) and not -t.dim() <= p.dim < t.dim():
        raise DumpError(f"{where}: Shard dim {p.dim} is outside the tensor's {t.dim()} dims {list(t.shape)}")
    if isinstance(p, Fused):
        total = sum(w for _, w, _ in p.parts)
        if t.dim() == 0 or total != t.shape[-1]:
            raise DumpError(f"{where}: Fused widths sum to {total}, the tensor's last dim is "
                            f"{list(t.shape)[-1:] or 'absent'}")


def check_rows(t, name: str, placement, meta: dict, where: str, meta_path) -> None:
    """A point with a row per token (``KIND_TABLE``'s ``rows == "tokens"``) must hold the rows its step records:
    the step's tokens, all requests concatenated, or the ``rows`` its JSON lists for it (a point that holds only
    some: vLLM's sampled logits). Otherwise the file does not match its own record (a step written for other
    tokens, or tensors cut or padded), and a comparison would blame the engine for it: a DumpError naming the
    step file, before any comparison. Points sharded by rows and the KV-cache points (every cached position) are
    left to the unsharding's checks."""
    kind = KINDS.get(split_point(name)[1])
    if kind is None or kind.rows != "tokens" or t.dim() == 0 or (isinstance(placement, Shard)
                                                                 and placement.dim % t.dim() == 0):
        return
    tokens = sum(len(x) for x in meta["tokens"])
    listed = meta.get("rows", {}).get(name)
    if listed is not None and any(i >= tokens for i in listed):
        raise DumpError(f"{meta_path}: rows[{name!r}] lists row {max(listed)}, past the step's {tokens} tokens")
    want, what = (len(listed), f"the {len(listed)} rows {meta_path.name} lists for it") if listed is not None \
        else (tokens, f"the {tokens} tokens {meta_path.name} records")
    if t.shape[0] != want:
        raise DumpError(f"{where}: {t.shape[0]} rows, but a{'n' if kind.name[0] in 'aeiou' else ''} {kind.name} point has a row per token: {what} "
                        "(the step's file and its record disagree)")
