"""One point of one step, from every rank's file, into tpcheck's dump model: ``(placement, [TP rank 0's tensor,
...])`` with each tensor ``[rows, features]`` (``tpcheck.capture.points``), exactly what
``tpcheck.engines.dump.replay.Dump.points`` gives for tpcheck's own dumps, so the same unsharding
(``tpcheck.measure.unshard``), replica rule and verdict judge it.

The parallel axes come from each file's meta: ``{axis}_rank`` / ``{axis}_size`` in its plugin's parallel info
(``sglang_parallel_info``, ``vllm_parallel_info`` or ``megatron_parallel_info``; ``recompute_pseudo_*`` at the
top level), as SGLang's comparator reads them. The annotation (``tpcheck.engines.sglang_dump.dims``) drives
the rest, axis by axis, innermost split first:

* an axis other than tp that a dim splits: the ranks' tensors concatenated along that dim in rank order
  (``zigzag``: Megatron's balanced chunks put back in order), or summed in rank order (``partial``);
* an axis other than tp that no dim splits: replicated: every rank's tensor must be bit-identical (else the
  annotation is wrong, or the ranks ran different data: a DumpError naming both files);
* tp: left to tpcheck's own unsharding as a placement: a split feature dim ``Shard(-1)`` (it must lead the
  features: rows are tokens, features flattened heads major), a split token dim ``Shard(0)``, ``partial``
  ``Partial()``, none ``Replicate()`` (replicas measured and each judged: ``tpcheck.measure.unshard``)."""
from __future__ import annotations

import functools
import math
import operator
from itertools import product

import torch

from impl.placements import Partial, Replicate, Shard
from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.sglang_dump.dims import AXES, Dim, Dims

PARALLEL_INFO_KEYS = ("sglang_parallel_info", "vllm_parallel_info", "megatron_parallel_info")

Entry = tuple[str, torch.Tensor, dict[str, tuple[int, int]]]  # (file, tensor, {axis: (rank, size)})


def axis_coords(meta: dict, where: str) -> dict[str, tuple[int, int]]:
    """``{axis: (rank, size)}`` of the axes of size > 1 a file's meta records. Two plugins' parallel infos, or a
    rank outside its size, is a DumpError naming the file; an info that is only an error sentinel
    (``{"distributed_error": True}``) counts as none."""
    infos = [k for k in PARALLEL_INFO_KEYS if isinstance(meta.get(k), dict) and meta[k]
             and not any(str(x).endswith("_error") for x in meta[k])]
    if len(infos) > 1:
        raise DumpError(f"{where}: meta holds {infos}: one plugin's parallel info is expected")
    info = meta[infos[0]] if infos else {}
    out = {}
    for axis in AXES:
        src = info if f"{axis}_rank" in info else meta
        rank, size = src.get(f"{axis}_rank"), src.get(f"{axis}_size")
        if rank is None or size is None:
            continue
        if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
            raise DumpError(f"{where}: {axis}_rank {rank!r} / {axis}_size {size!r} are not a rank within a size")
        if size > 1:
            out[axis] = (rank, size)
    return out


def assemble(name: str, entries: list[Entry], dims: Dims | None) -> tuple[object, list[torch.Tensor]]:
    """The point ``name`` from every rank's ``entries``: (its tp placement, one ``[rows, features]`` tensor per tp
    rank). Missing ranks, ranks that disagree on an axis's size, a dims annotation that does not fit the tensor,
    and replicas that differ are DumpErrors naming the file."""
    dims = dims or _flat_tokens(entries[0][1].dim())
    sizes = _axis_sizes(name, entries)
    for where, t, _ in entries:
        if t.dim() != len(dims.dims):
            raise DumpError(f"{where}: dims {dims.text!r} name {len(dims.dims)} dims, the tensor has {t.dim()} "
                            f"(shape {list(t.shape)}): the annotation does not fit")
    _check_complete(name, entries, sizes)
    pool = [(w, t, {a: r for a, (r, _) in c.items()}) for w, t, c in entries]
    split_axes = {s.axis for _, s in dims.sharded()}
    for axis in sorted(set(sizes) - split_axes - {"tp"}):
        pool = _merge(pool, axis, lambda group, a=axis: _replicated(name, a, group, dims))
    for dim, split in dims.sharded():
        if split.axis != "tp" and split.axis in sizes:
            pool = _merge(pool, split.axis, lambda group, d=dim, s=split: _combine(group, d, s))
    by_tp = sorted(pool, key=lambda e: e[2].get("tp", 0))
    placement = _tp_placement(name, dims, sizes.get("tp", 1), by_tp[0][0], by_tp[0][1])
    return placement, [_rows(t, dims, w) for w, t, _ in by_tp]


def _flat_tokens(ndim: int) -> Dims:
    """No annotation (the non-intrusive dumper writes none, and no rule gives one): the first dim is the tokens,
    nothing is split (every axis replicated), as SGLang's comparator reads such a tensor."""
    return Dims((Dim("t"),) + tuple(Dim(f"d{i}") for i in range(1, max(ndim, 1))),
                text="(none: the first dim is the tokens, every axis replicated)")


def _axis_sizes(name: str, entries: list[Entry]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for where, _, coords in entries:
        for axis, (_, size) in coords.items():
            if sizes.setdefault(axis, size) != size:
                raise DumpError(f"{where}: {name}: {axis}_size {size}, another rank's {sizes[axis]}")
    return sizes


def _check_complete(name: str, entries: list[Entry], sizes: dict[str, int]) -> None:
    """Every combination of axis ranks once: a missing rank (a file not written, or lost) is named."""
    axes = sorted(sizes)
    seen: dict[tuple, str] = {}
    for where, _, coords in entries:
        key = tuple(coords.get(a, (0, 1))[0] for a in axes)
        if key in seen:
            raise DumpError(f"{where}: {name} at {dict(zip(axes, key))} again (also {seen[key]}): two files of "
                            "one rank and step")
        seen[key] = where
    missing = [dict(zip(axes, k)) for k in product(*(range(sizes[a]) for a in axes)) if k not in seen]
    if missing:
        raise DumpError(f"{next(iter(seen.values()))}: {name}: no file of the rank(s) {missing[:4]} "
                        f"({len(missing)} missing of {math.prod(sizes.values())}; a rank that did not dump, or its "
                        "files were not copied)")


def _merge(pool: list, axis: str, combine) -> list:
    """Group the tensors that differ only in ``axis``'s rank, combine each group (in rank order) into one."""
    groups: dict[tuple, list] = {}
    for where, t, coords in pool:
        key = tuple(sorted((a, r) for a, r in coords.items() if a != axis))
        groups.setdefault(key, []).append((coords.get(axis, 0), where, t))
    out = []
    for key, group in groups.items():
        group.sort(key=lambda g: g[0])
        out.append((group[0][1], combine([(w, t) for _, w, t in group]), dict(key)))
    return out


def _replicated(name: str, axis: str, group: list[tuple[str, torch.Tensor]], dims: Dims) -> torch.Tensor:
    w0, t0 = group[0]
    for w, t in group[1:]:
        if t.shape != t0.shape or not torch.equal(t, t0):
            raise DumpError(f"{w}: {name} differs from {w0} along {axis}, which dims {dims.text!r} does not split: "
                            f"annotate the dim it splits (e.g. t[{axis}]), or the ranks ran different data")
    return t0


def _combine(group: list[tuple[str, torch.Tensor]], dim: int, split) -> torch.Tensor:
    tensors = [t for _, t in group]
    if split.partial:
        return functools.reduce(operator.add, tensors)  # rank order, in the dumped dtype
    try:
        whole = torch.cat(tensors, dim=dim)
    except RuntimeError as e:
        raise DumpError(f"{group[0][0]}: the ranks' shards do not concatenate along dim {dim}: {e}") from None
    if not split.zigzag:
        return whole
    n = len(tensors)
    if whole.shape[dim] % (2 * n):
        raise DumpError(f"{group[0][0]}: zigzag over {n} ranks needs dim {dim} divisible by {2 * n}, got "
                        f"{whole.shape[dim]}")
    chunks = whole.chunk(2 * n, dim=dim)  # rank r holds natural chunks r and 2n-1-r, in that order
    order = [2 * i for i in range(n)] + [2 * (n - 1 - i) + 1 for i in range(n)]
    return torch.cat([chunks[i] for i in order], dim=dim)


def _tp_placement(name: str, dims: Dims, tp: int, where: str, t: torch.Tensor):
    split = next(((i, s) for i, s in dims.sharded() if s.axis == "tp"), None)
    if split is None or tp == 1:
        return Replicate()
    dim, s = split
    if s.partial:
        return Partial()
    if s.zigzag:
        raise DumpError(f"{where}: {name}: dims {dims.text!r}: a zigzag tp split is not supported")
    if dim < dims.token_dims:
        if dims.token_dims != 1:
            raise DumpError(f"{where}: {name}: dims {dims.text!r}: tp splits a token dim of a b s layout")
        return Shard(0)
    leading = [dims.dims[j].name for j in range(dims.token_dims, dim) if t.shape[j] != 1]
    if leading:
        raise DumpError(f"{where}: {name}: dims {dims.text!r}: tp splits {dims.dims[dim].name!r} behind {leading}: "
                        "the split dim must lead the features (heads major) to be unsharded as tpcheck's points are")
    return Shard(-1)


def _rows(t: torch.Tensor, dims: Dims, where: str) -> torch.Tensor:
    """``[rows, features]``: the leading token dims flattened into rows, the rest into features."""
    n = dims.token_dims
    if n == 0:
        raise DumpError(f"{where}: dims {dims.text!r} do not start with the tokens (t, or b s): a point is per token")
    rows = math.prod(t.shape[:n])
    return t.reshape(rows, -1) if t.dim() > n else t.reshape(rows, 1)
