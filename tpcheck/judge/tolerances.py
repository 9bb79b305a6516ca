"""Tolerance configuration: the gate rule's k factor and floor per point kind and per dtype, and absolute
bounds where a user wants them, read from ``[tool.tpcheck]`` in ``pyproject.toml`` or a ``--tolerances`` file.

The gate (``tpcheck.measure.metrics``) passes a point when ``rel_err <= k * ref_rel_err + floor``; ``ref_rel_err``
is Hugging Face's own error at the same dtype. The defaults are ``tpcheck.measure.metrics.K_FACTOR`` / ``FLOOR``.

Schema (in ``pyproject.toml``; a ``--tolerances FILE.toml`` holds the same tables without the ``tool.tpcheck``
prefix, i.e. starting at ``[tolerances]``; a file that has ``[tool.*]`` tables is read from ``[tool.tpcheck]``,
and is an error without one; only the default ``./pyproject.toml`` may lack it)::

    [tool.tpcheck.tolerances]
    k = {float32 = 2.0, bfloat16 = 4.0}       # default k per dtype (a bare number: every dtype)
    floor = {bfloat16 = 2e-3}                 # default floor per dtype (a bare number: every dtype)

    [tool.tpcheck.tolerances.kinds."attn.q"]  # one point kind: "embed", "attn.q", "mlp.out", "logits", ...
    k = 3.0                                   # number, or {dtype = number}
    floor = {float32 = 1e-5}
    rel_max = 1e-2                            # absolute bound on rel_err: replaces k * ref_rel_err + floor
    abs_max = {bfloat16 = 0.5}                # absolute bound on max |diff|: checked as well as the rel gate

Keys: ``tolerances`` under ``[tool.tpcheck]``; ``k``, ``floor``, ``kinds`` under ``tolerances``; ``k``,
``floor``, ``rel_max``, ``abs_max`` under a kind. Dtypes: ``float32``, ``float64``, ``bfloat16``,
``float16``. Kinds: the second part of a point name (``tpcheck.capture.points.split_point``). Values are numbers
>= 0. Anything else (a misspelt key, kind or dtype) is an error naming the key and the file.

Precedence for one point: the kind's per-dtype value, then the kind's bare value, then the top-level
per-dtype value, then the default. An explicit ``--tolerances`` file replaces ``pyproject.toml`` (no merge)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tpcheck.measure.metrics import FLOOR, K_FACTOR
from tpcheck.capture.points import KINDS as POINT_KINDS

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

DTYPES = tuple(K_FACTOR)
KINDS = tuple(POINT_KINDS)
TOOL_KEYS = ("tolerances",)          # keys allowed under [tool.tpcheck]
TOP_KEYS = ("k", "floor", "kinds")   # keys allowed under [tool.tpcheck.tolerances]
KIND_KEYS = ("k", "floor", "rel_max", "abs_max")


class ToleranceError(ValueError):
    """A tolerance file that cannot be read or does not follow the schema."""


Value = dict  # dtype -> float, with "*" for "every dtype"


@dataclass
class Tolerances:
    """The gate's numbers: ``threshold(kind, dtype, ref_err)`` is ``k * ref_err + floor`` (or ``rel_max``) and
    ``abs_max`` an optional bound on max |diff|, per point kind and dtype (precedence in the module
    docstring); ``Tolerances()`` is the defaults (``tpcheck.measure.metrics.K_FACTOR`` / ``FLOOR``).
    ``tpcheck.judge`` applies them."""

    default_k: Value = field(default_factory=dict)      # dtype|"*" -> k
    default_floor: Value = field(default_factory=dict)  # dtype|"*" -> floor
    kinds: dict[str, dict[str, Value]] = field(default_factory=dict)  # kind -> key -> dtype|"*" -> value
    source: str = "default tolerances"

    def _kind(self, kind: str, key: str, dtype: str) -> float | None:
        v = self.kinds.get(kind, {}).get(key)
        if v is None:
            return None
        return v.get(dtype, v.get("*"))

    def k_for(self, kind: str, dtype: str) -> float:
        v = self._kind(kind, "k", dtype)
        if v is None:
            v = self.default_k.get(dtype, self.default_k.get("*"))
        return K_FACTOR[dtype] if v is None else v

    def floor_for(self, kind: str, dtype: str) -> float:
        v = self._kind(kind, "floor", dtype)
        if v is None:
            v = self.default_floor.get(dtype, self.default_floor.get("*"))
        return FLOOR[dtype] if v is None else v

    def rel_max(self, kind: str, dtype: str) -> float | None:
        return self._kind(kind, "rel_max", dtype)

    def abs_max(self, kind: str, dtype: str) -> float | None:
        return self._kind(kind, "abs_max", dtype)

    def threshold(self, kind: str, dtype: str, ref_err: float) -> float:
        bound = self.rel_max(kind, dtype)
        if bound is not None:
            return bound
        floor = self.floor_for(kind, dtype)
        return self.k_for(kind, dtype) * ref_err + floor if math.isfinite(ref_err) else floor

    def describe(self, kind: str, dtype: str, ref_err: float) -> str:
        """How the threshold of one point is made, for messages."""
        bound = self.rel_max(kind, dtype)
        if bound is not None:
            return f"rel_max {bound:.3g}"
        return f"k {self.k_for(kind, dtype):.3g} x HF {ref_err:.3g} + floor {self.floor_for(kind, dtype):.3g}"


def _number(v, where: str, file: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ToleranceError(f"{file}: {where} must be a finite number >= 0, got {v!r}")
    return float(v)


def _value(v, where: str, file: str) -> Value:
    """A bare number (every dtype) or a ``{dtype = number}`` table."""
    if isinstance(v, dict):
        out = {}
        for d, x in v.items():
            if d not in DTYPES:
                raise ToleranceError(f"{file}: unknown key '{where}.{d}' (dtypes: {', '.join(DTYPES)})")
            out[d] = _number(x, f"{where}.{d}", file)
        return out
    return {"*": _number(v, where, file)}


def _unknown(table: dict, known: tuple, prefix: str, file: str) -> None:
    for key in table:
        if key not in known:
            raise ToleranceError(f"{file}: unknown key '{prefix}{key}' (expected one of: {', '.join(known)})")


def parse_tolerances(data: dict, file: str = "<tolerances>", prefix: str = "tolerances") -> Tolerances:
    """Build ``Tolerances`` from the ``tolerances`` table (already parsed TOML)."""
    if not isinstance(data, dict):
        raise ToleranceError(f"{file}: '{prefix}' must be a table")
    _unknown(data, TOP_KEYS, prefix + ".", file)
    tol = Tolerances(source=f"tolerances from {file}")
    if "k" in data:
        tol.default_k = _value(data["k"], f"{prefix}.k", file)
    if "floor" in data:
        tol.default_floor = _value(data["floor"], f"{prefix}.floor", file)
    kinds = data.get("kinds", {})
    if not isinstance(kinds, dict):
        raise ToleranceError(f"{file}: '{prefix}.kinds' must be a table of point kinds")
    for kind, table in kinds.items():
        where = f'{prefix}.kinds."{kind}"'
        if kind not in KINDS:
            raise ToleranceError(f"{file}: unknown key '{where}': not a point kind (kinds: {', '.join(KINDS)})")
        if not isinstance(table, dict):
            raise ToleranceError(f"{file}: '{where}' must be a table with keys {', '.join(KIND_KEYS)}")
        _unknown(table, KIND_KEYS, where + ".", file)
        tol.kinds[kind] = {key: _value(v, f"{where}.{key}", file) for key, v in table.items()}
    return tol


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ToleranceError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ToleranceError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ToleranceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ToleranceError(f"{path}: nested too deeply") from None


def _from_tool(data: dict, file: str) -> Tolerances:
    tool = data.get("tool", {}).get("tpcheck")
    if tool is None:
        return Tolerances(source="default tolerances")
    if not isinstance(tool, dict):
        raise ToleranceError(f"{file}: 'tool.tpcheck' must be a table")
    _unknown(tool, TOOL_KEYS, "tool.tpcheck.", file)
    if "tolerances" not in tool:
        return Tolerances(source="default tolerances")
    return parse_tolerances(tool["tolerances"], file, "tool.tpcheck.tolerances")  # source: the file


def load_tolerances(path: str | Path | None = None, pyproject: str | Path | None = "pyproject.toml") -> Tolerances:
    """Tolerances from ``path`` (a ``--tolerances`` file: must exist; one with ``[tool.*]`` tables must have
    ``[tool.tpcheck]``) or else from ``pyproject``'s ``[tool.tpcheck]`` (skipped when the file does not exist
    or has no ``[tool.tpcheck]``); the defaults when neither has any."""
    if path is not None:
        path = Path(path)
        data = _read_toml(path)
        if "tool" in data:
            tool = data["tool"]
            if not isinstance(tool, dict) or "tpcheck" not in tool:  # e.g. a pyproject.toml with only [tool.ruff]
                has = ", ".join(f"[tool.{k}]" for k in tool) if isinstance(tool, dict) and tool else "a 'tool' key"
                raise ToleranceError(f"{path}: [tool.tpcheck] is missing: the file has {has} but no [tool.tpcheck] "
                                     "table (a --tolerances file holds [tool.tpcheck.tolerances] or a top-level "
                                     "[tolerances] table)")
            return _from_tool(data, str(path))
        _unknown(data, TOOL_KEYS, "", str(path))
        if "tolerances" not in data:
            return Tolerances(source=f"tolerances from {path} (none set: the defaults)")
        return parse_tolerances(data["tolerances"], str(path), "tolerances")
    if pyproject is not None and Path(pyproject).is_file():
        return _from_tool(_read_toml(Path(pyproject)), str(pyproject))
    return Tolerances()
