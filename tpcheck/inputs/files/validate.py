"""Every file tpcheck reads is untrusted: the one reader of its JSON and the checks its fields go through.

``read_json(path, error)`` reads a file as strict JSON (UTF-8, no NaN/Infinity, nesting at most ``MAX_DEPTH``
deep, integers of at most ``MAX_INT_DIGITS`` digits) and raises ``error`` (the file kind's own ``ValueError``
subclass: exit 2) naming the file; ``field(obj, key, kind, where, error)`` and ``int_in`` check one field's
type and bounds before it is used, so no number from a file reaches a ``range()`` or an allocation unbounded.
``tensor_digest`` is the content hash goldens and dumps record per tensor (sha256 of the tensor's bytes;
measured on the ``small`` preset: 8 ms per 5.1 MiB float64 prefill step, about 1% of the golden's forward)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

MAX_DEPTH = 64  # no tpcheck file nests deeper than ~6; a deeper one is hostile or not ours
MAX_INT_DIGITS = 30  # every count, index and token id fits in 2**64 (20 digits)
MAX_LAYERS = 10_000  # a bound before the checkpoint is known (no model has 1000 layers); the model's is tighter
MAX_TP = 4096


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _constant(text: str):
    raise ValueError(f"{text} is not JSON (strict JSON has no NaN or Infinity)")


def parse_json(text: str, where: str, error: type[Exception] = ValueError, allow_nan: bool = False):
    """``text`` as strict, bounded JSON (see the module docstring); ``error`` names ``where``. ``allow_nan``:
    NaN / Infinity read as floats (only for documents written before tpcheck's JSON was strict)."""
    try:
        data = json.loads(text, parse_int=_int, parse_constant=float if allow_nan else _constant)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and our own refusals
        raise error(f"{where}: not valid JSON: {e}") from None
    depth, stack = 0, [(data, 1)]
    while stack:
        obj, d = stack.pop()
        if d > MAX_DEPTH:
            raise error(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
        depth = max(depth, d)
        if isinstance(obj, dict):
            stack += [(v, d + 1) for v in obj.values()]
        elif isinstance(obj, list):
            stack += [(v, d + 1) for v in obj]
    return data


def read_json(path: str | Path, error: type[Exception] = ValueError, what: str = "file", allow_nan: bool = False):
    """The JSON in ``path`` (strict and bounded); an unreadable, non-UTF-8 or invalid file is ``error`` naming it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_json(text, str(path), error, allow_nan)


_KINDS = {"int": int, "str": str, "bool": bool, "dict": dict, "list": list, "number": (int, float)}


def field(obj: dict, key: str, kind: str, where: str, error: type[Exception] = ValueError, default=...):
    """``obj[key]``, checked to be a ``kind`` (``_KINDS``; a bool is not an int or a number); missing: ``default``
    when given, else ``error`` naming ``where`` and the key."""
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        if default is not ...:
            return default
        raise error(f"{where}: no {key!r}")
    v = obj[key]
    ok = isinstance(v, _KINDS[kind]) and (kind == "bool" or not isinstance(v, bool))
    if kind == "number" and ok and not math.isfinite(v):
        ok = False
    if not ok:
        raise error(f"{where}: {key!r} must be a{'n' if kind[0] in 'aeiou' else ''} {kind}, got {_short(v)}")
    return v


def int_in(v, lo: int, hi: int, where: str, error: type[Exception] = ValueError) -> int:
    """``v`` when it is an int in [lo, hi], else ``error`` naming ``where``."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise error(f"{where} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def token_lists(v, vocab: int | None, where: str, error: type[Exception] = ValueError) -> list[list[int]]:
    """A list of lists of token ids (each in [0, vocab) when ``vocab`` is known)."""
    if not isinstance(v, list) or not all(isinstance(p, list) for p in v):
        raise error(f"{where} must be a list of token-id lists, got {_short(v)}")
    hi = (vocab - 1) if vocab else 2**63
    for i, p in enumerate(v):
        for t in p:
            int_in(t, 0, hi, f"{where}[{i}]: token id", error)
    return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def tensor_bytes(t):
    """A tensor's bytes (row-major, its own dtype) as a buffer: a view of a contiguous CPU tensor, not a copy (a
    dump hashes and writes every tensor of every step)."""
    import torch  # reading a JSON result imports no torch; hashing a tensor has one already
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def tensor_digest(t) -> str:
    """sha256 of a tensor's bytes (``tensor_bytes``), the content hash goldens and dumps record."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def tensor_record(t, digest: str | None = None) -> dict:
    """What a file claims about one tensor: its dtype, shape and content hash (``digest``: already computed)."""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "sha256": tensor_digest(t) if digest is None else digest}


def verify_tensor(t, record, where: str, error: type[Exception] = ValueError) -> None:
    """Refuse (``error`` naming ``where``) a tensor whose dtype, shape or content differs from its record."""
    if not isinstance(record, dict):
        raise error(f"{where}: no integrity record (dtype, shape, sha256)")
    got = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    for key in ("dtype", "shape"):
        if record.get(key) != got[key]:
            raise error(f"{where}: {key} {got[key]} but its record says {_short(record.get(key))}")
    if record.get("sha256") != tensor_digest(t):
        raise error(f"{where}: content hash differs from its record (the file was changed or corrupted)")
