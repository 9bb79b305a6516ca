"""The dump format's pieces shared by its writer and its reader: the error it raises, placements as JSON."""
from __future__ import annotations

from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.inputs.validate import MAX_TP, field, int_in


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
