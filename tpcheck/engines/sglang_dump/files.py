"""One SGLang dumper file: its name parsed, its contents loaded safely.

SGLang's dumper (``python/sglang/srt/debug_utils/dumper.py``; vLLM's port ``vllm/utils/debug_utils/dumper.py``
writes the same) saves one ``torch.save`` file per dumped value, under ``{DUMPER_DIR}/{exp_name}/``, named by
its tags ``key=value`` joined by ``___``::

    step=3___rank=1___dump_index=57___name=input_ids___recompute_status=disabled___layer_id=0.pt

(``step``, ``rank`` (the world rank), ``dump_index``, ``name``, ``recompute_status``, the user's keys and the
context's, with ``include_parallel_rank_in_filename`` also ``pp_rank tp_rank cp_rank ep_rank etp_rank``). The
file holds ``{"value": tensor-or-object, "meta": {those tags, world_rank, world_size, tokenizer_path,
<plugin>_parallel_info, dims, ...}}``; older dumps hold the bare value.

These files are pickles, and a dump is untrusted input: ``load_file`` unpickles with
``torch.load(weights_only=True)`` (tensors, containers, numbers and strings only: no code runs), then refuses
anything but a tensor (or, for an auxiliary value such as ``rids``, a list of strings or numbers) and plain
metadata, naming the file."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch

from tpcheck.capture.dump_format import DumpError

#: tags every file name carries (SGLang's ``_Dumper._dump_single``); older dumps named the step ``curr_step``
REQUIRED_TAGS = ("step", "rank", "name")
_STEP_ALIASES = ("step", "curr_step")
_PLAIN = (str, int, float, bool, type(None))
_MAX_DEPTH = 6


@dataclass(frozen=True)
class DumpFile:
    """A file's parsed name: ``step``, ``rank`` (world rank), ``name`` and every tag as written (strings). An entry
    of an older forward-hook dump's Pass file (``tpcheck.engines.sglang_dump.passes``) has ``entry`` (its key and
    list index in the file) and ``meta`` (what its directory says of the rank)."""

    path: Path
    step: int
    rank: int
    name: str
    tags: dict[str, str]
    entry: tuple[str, int | None] | None = None
    meta: dict | None = None
    loader: Callable[["DumpFile"], tuple[object, dict]] | None = None  # loads an entry: (value, meta)

    @property
    def dump_index(self) -> int:
        """The dumper's running counter (call order within a rank); 0 where the name has none."""
        return int(self.tags.get("dump_index", "0"))


def parse_filename(path: Path) -> DumpFile:
    """``key=value___key=value...pt`` -> ``DumpFile``; a name without ``step``, ``rank`` and ``name`` tags, a tag
    without ``=``, or a step / rank that is not a number is a DumpError naming the file."""
    if path.suffix != ".pt":
        raise DumpError(f"{path}: not a .pt file of SGLang's dumper")
    tags: dict[str, str] = {}
    for part in path.stem.split("___"):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise DumpError(f"{path}: file name part {part!r} is not key=value (SGLang's dumper names files "
                            "key=value___key=value...pt)")
        if key in tags:
            raise DumpError(f"{path}: tag {key!r} appears twice in the file name")
        tags[key] = value
    step_key = next((k for k in _STEP_ALIASES if k in tags), None)
    missing = [k for k in ("rank", "name") if k not in tags] + ([] if step_key else ["step"])
    if missing:
        raise DumpError(f"{path}: file name lacks the tags {missing} (SGLang's dumper writes step, rank, name)")
    try:
        step, rank = int(tags[step_key]), int(tags["rank"])
    except ValueError:
        raise DumpError(f"{path}: step {tags[step_key]!r} / rank {tags['rank']!r} must be integers") from None
    if step < 0 or rank < 0:
        raise DumpError(f"{path}: step and rank must be >= 0")
    return DumpFile(path, step, rank, tags["name"], tags)


def scan(root: Path) -> list[DumpFile]:
    """Every dumper file directly under ``root`` (sorted by rank, then call order), each name parsed."""
    files = [parse_filename(p) for p in sorted(root.iterdir()) if p.suffix == ".pt" and p.is_file()]
    if not files:
        raise DumpError(f"{root}: no .pt files of SGLang's dumper")
    return sorted(files, key=lambda f: (f.rank, f.step, f.dump_index, f.name))


def safe_load(path: Path, holds: str = "tensors and plain metadata") -> object:
    """``torch.load(path, weights_only=True)`` (no code runs: a dump is untrusted input); a file that is not a
    torch.save file, or pickles anything but what ``weights_only`` allows, is a DumpError naming it (``holds``: what
    such a file should hold, for the message)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DumpError(f"{path}: refused: it holds something other than {holds}, or is not a torch.save file "
                        f"(loaded with weights_only=True: nothing in a dump is executed): {first[:300]}") from None


def load_file(f: DumpFile) -> tuple[object, dict]:
    """(value, meta) of a file, unpickled safely: ``torch.load(weights_only=True)`` (no code runs), the value a
    tensor (or a flat list of strings / numbers: ``rids``), the meta plain data (strings, numbers, lists, dicts).
    The meta's ``name``, ``rank`` and ``step``, where present, must be the file name's. Anything else is a
    DumpError naming the file."""
    if f.loader is not None:
        return f.loader(f)
    obj = safe_load(f.path)
    if isinstance(obj, dict) and set(obj) == {"value", "meta"}:
        value, meta = obj["value"], obj["meta"]
    elif isinstance(obj, dict) and "value" in obj:
        raise DumpError(f"{f.path}: a dict with keys {sorted(map(str, obj))[:8]}; SGLang's dumper writes exactly "
                        "{'value', 'meta'}")
    else:
        value, meta = obj, {}  # an older dumper's bare value
    if not isinstance(meta, dict):
        raise DumpError(f"{f.path}: meta is a {type(meta).__name__}, not a dict")
    _check_plain(meta, f.path, "meta", 0)
    if not isinstance(value, torch.Tensor):
        if not (isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value)):
            raise DumpError(f"{f.path}: value is a {type(value).__name__}; a dump point must be a tensor (or a "
                            "list of request ids)")
        value = [v for v in value]
    for key, want in (("name", f.name), ("rank", f.rank), ("step", f.step)):
        if key in meta and str(meta[key]) != str(want):
            raise DumpError(f"{f.path}: meta says {key}={meta[key]!r}, the file name {want!r} (files renamed or "
                            "copied between runs)")
    return value, meta


def _check_plain(v, path: Path, where: str, depth: int) -> None:
    """Refuse metadata that is not plain data (a tensor, a dtype, another object), naming its key."""
    if depth > _MAX_DEPTH:
        raise DumpError(f"{path}: {where} nests deeper than {_MAX_DEPTH} levels")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, (str, int)):
                raise DumpError(f"{path}: {where} has a key of type {type(k).__name__}")
            _check_plain(x, path, f"{where}.{k}", depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_plain(x, path, f"{where}[{i}]", depth + 1)
    elif not isinstance(v, _PLAIN):
        raise DumpError(f"{path}: {where} is a {type(v).__name__}; metadata must be plain data (strings, numbers, "
                        "lists, dicts)")
