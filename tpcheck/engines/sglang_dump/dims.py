"""The dims annotation of SGLang's dumper (``dumper.dump(name, x, dims="t h[tp]")``, ``meta["dims"]``): what
each dim of a rank's tensor is, and how it is split over the parallel axes.

Grammar (SGLang comparator v2, ``python/sglang/srt/debug_utils/comparator/dims_spec/``): whitespace-separated
tokens, one per tensor dim, then an optional ``#`` declaration::

    dims   := token+ [ "#" decl* ]
    token  := name | name "[" mod ("," mod)* "]" | "(" name ("*" name)+ ")" ["[" mods "]"] | "1"
    mod    := axis [ ":" qual ("+" qual)* ]      axis: tp cp ep sp recompute_pseudo; qual: zigzag natural partial
    decl   := "dp:=" group | axis ":replicated"

``t`` is the flat token dim, ``b s`` batch and sequence (their product the rows); ``(a*b)`` one tensor dim that
fuses two named ones; ``1`` a dim of size 1. ``h[tp]``: rank r holds chunk r of ``h`` along that axis, in rank
order; ``s[cp:zigzag]``: chunks ``r`` and ``2n-1-r`` of ``2n`` (Megatron's load balancing); ``h[tp:partial]``:
the full tensor is the sum over the axis (a value before its all-reduce). An axis whose size is above 1 and
that no dim names is replicated (every rank holds the whole, checked). The older spelling (comparator v1,
``comparator/dims.py``) put one axis and its qualifiers in parentheses: ``h(tp)``, ``s(cp,zigzag)``,
``h(tp,partial)``; both are read."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tpcheck.capture.dump_format import DumpError

AXES = ("tp", "cp", "ep", "sp", "recompute_pseudo")
ORDERINGS = ("zigzag", "natural")
TOKEN_DIMS = ("t", "b", "s")
SQUEEZE = "1"
_NAME = r"[A-Za-z_]\w*"
_NEW = re.compile(rf"^(?P<name>{_NAME})(?:\[(?P<mods>[^\]]+)\])?$")
_OLD = re.compile(rf"^(?P<name>{_NAME})\((?P<mods>[^)]+)\)$")
_FUSED = re.compile(r"^\((?P<inner>[^)]+)\)(?:\[(?P<mods>[^\]]+)\])?$")
_DP = re.compile(r"^dp:=(\w+)$")
_REPLICATED = re.compile(r"^(\w+):replicated$")


@dataclass(frozen=True)
class Split:
    """How one dim is split over one parallel axis: in chunks (rank order; ``zigzag``: Megatron's balanced
    order), or ``partial``: the ranks' tensors sum to the whole."""

    axis: str
    zigzag: bool = False
    partial: bool = False


@dataclass(frozen=True)
class Dim:
    name: str                    # a fused dim's names joined by "*"
    splits: tuple[Split, ...] = ()


@dataclass(frozen=True)
class Dims:
    """A parsed annotation: ``dims`` one per tensor dim, ``replicated`` the axes declared replicated,
    ``dp_group`` the ``dp:=`` alias (None: none), ``text`` as written."""

    dims: tuple[Dim, ...]
    replicated: frozenset[str] = frozenset()
    dp_group: str | None = None
    text: str = ""

    @property
    def token_dims(self) -> int:
        """How many leading dims are tokens (``t``, or ``b s``): their product is the rows."""
        n = 0
        while n < len(self.dims) and self.dims[n].name in TOKEN_DIMS:
            n += 1
        return n

    def sharded(self) -> list[tuple[int, Split]]:
        """(tensor dim, split) of every split, innermost first within a dim (the order SGLang undoes them)."""
        return [(i, s) for i, d in enumerate(self.dims) for s in reversed(d.splits)]


def parse_dims(text: str, where: str) -> Dims:
    """Parse an annotation (either spelling); a malformed one is a DumpError naming ``where`` (the file)."""
    if not isinstance(text, str):
        raise DumpError(f"{where}: dims must be a string, got {type(text).__name__}")
    shape, _, decl = text.partition("#")
    tokens = shape.split()
    if not tokens:
        raise DumpError(f"{where}: dims {text!r} names no dim")
    dims = tuple(_dim(tok, where, text) for tok in tokens)
    names = [n for d in dims if d.name != SQUEEZE for n in d.name.split("*")]
    if len(set(names)) != len(names):
        raise DumpError(f"{where}: dims {text!r} names a dim twice")
    axes = [s.axis for d in dims for s in d.splits]
    if len(set(axes)) != len(axes):
        raise DumpError(f"{where}: dims {text!r} splits one axis over two dims")
    replicated, dp = _declarations(decl, where, text)
    if replicated & set(axes):
        raise DumpError(f"{where}: dims {text!r} declares {sorted(replicated & set(axes))} both split and replicated")
    return Dims(dims, frozenset(replicated), dp, text)


def _dim(tok: str, where: str, text: str) -> Dim:
    if tok == SQUEEZE:
        return Dim(SQUEEZE)
    if m := _FUSED.match(tok):
        parts = [p.strip() for p in m.group("inner").split("*")]
        if len(parts) < 2 or not all(re.fullmatch(_NAME, p) for p in parts):
            raise DumpError(f"{where}: dims {text!r}: fused dim {tok!r} must be (a*b...) of two or more names")
        return Dim("*".join(parts), _new_mods(m.group("mods"), tok, where, text))
    if m := _NEW.match(tok):
        return Dim(m.group("name"), _new_mods(m.group("mods"), tok, where, text))
    if m := _OLD.match(tok):
        return Dim(m.group("name"), (_old_mod(m.group("mods"), tok, where, text),))
    raise DumpError(f"{where}: dims {text!r}: {tok!r} is not a dim (name, name[axis:qual], (a*b)[axis], 1, or the "
                    "older name(axis,qual))")


def _new_mods(mods: str | None, tok: str, where: str, text: str) -> tuple[Split, ...]:
    """``tp``, ``cp:zigzag``, ``tp:partial``, ``cp:zigzag+partial``, comma-separated."""
    if mods is None:
        return ()
    out = []
    for mod in (m.strip() for m in mods.split(",")):
        axis, _, quals = mod.partition(":")
        out.append(_split(axis.strip(), [q.strip() for q in quals.split("+") if q.strip()], tok, where, text))
    return tuple(out)


def _old_mod(mods: str, tok: str, where: str, text: str) -> Split:
    """The older ``name(axis, qual, ...)``: one axis, its qualifiers in any order."""
    words = [w.strip() for w in mods.split(",") if w.strip()]
    axes = [w for w in words if w in AXES]
    if len(axes) != 1:
        raise DumpError(f"{where}: dims {text!r}: {tok!r} must name exactly one axis of {list(AXES)}")
    return _split(axes[0], [w for w in words if w not in AXES], tok, where, text)


def _split(axis: str, quals: list[str], tok: str, where: str, text: str) -> Split:
    if axis not in AXES:
        raise DumpError(f"{where}: dims {text!r}: unknown axis {axis!r} in {tok!r} (known: {', '.join(AXES)})")
    bad = [q for q in quals if q not in ORDERINGS + ("partial", "sharded")]
    if bad:
        raise DumpError(f"{where}: dims {text!r}: unknown qualifier {bad[0]!r} in {tok!r} (known: zigzag, natural, "
                        "partial)")
    if sum(q in ORDERINGS for q in quals) > 1:
        raise DumpError(f"{where}: dims {text!r}: two orderings in {tok!r}")
    return Split(axis, zigzag="zigzag" in quals, partial="partial" in quals)


def _declarations(decl: str, where: str, text: str) -> tuple[set[str], str | None]:
    replicated: set[str] = set()
    dp = None
    for tok in decl.split():
        if m := _DP.match(tok):
            if dp is not None:
                raise DumpError(f"{where}: dims {text!r}: two dp:= declarations")
            dp = m.group(1)
        elif (m := _REPLICATED.match(tok)) and m.group(1) in AXES:
            replicated.add(m.group(1))
        else:
            raise DumpError(f"{where}: dims {text!r}: {tok!r} after '#' is not dp:=<group> or <axis>:replicated")
    return replicated, dp


def format_dims(dims: Dims, old: bool = False) -> str:
    """An annotation back as text (``old``: the v1 spelling, one axis per dim), so a writer and the tests spell it
    the way the reader parses it."""
    def tok(d: Dim) -> str:
        name = f"({d.name})" if "*" in d.name else d.name
        if not d.splits:
            return name
        if old:
            s = d.splits[0]
            return f"{name}({','.join([s.axis] + ['zigzag'] * s.zigzag + ['partial'] * s.partial)})"
        mods = [s.axis + (":" + "+".join(["zigzag"] * s.zigzag + ["partial"] * s.partial)
                          if s.zigzag or s.partial else "") for s in d.splits]
        return f"{name}[{','.join(mods)}]"
    tail = [f"dp:={dims.dp_group}"] * (dims.dp_group is not None) + [f"{a}:replicated" for a in sorted(dims.replicated)]
    return " ".join([tok(d) for d in dims.dims] + (["#", *tail] if tail else []))
