"""SGLang's older forward-hook dumps (``--debug-tensor-dump-output-folder``,
``python/sglang/srt/debug_utils/tensor_dump_forward_hook.py``), read as the files of its newer dumper.

The layout, as its source writes it: one directory per rank, ``TP{tp_rank}_PP{pp_rank}_Rank{rank}_pid{pid}``
(``rank = tp_size * pp_rank + tp_rank``), one ``torch.save`` file per forward pass, ``Pass{n:05d}.pt``, holding a
dict ``{module name: its output}``: a hook on every leaf module (``model.layers.0.self_attn.qkv_proj``, ...) stores
its output on the CPU (a tuple's tensors as a list, ``None`` dropped, a list of one collapsed to the tensor; a
``LogitsProcessorOutput`` as its ``next_token_logits``), and the top module's hook (``model``) adds the pass's
``ForwardBatch`` as ``model.forward_batch_info.input_ids`` / ``seq_lens`` / ``positions``, writes the file, and
only then records the top module's own output. So ``model`` and the modules that run after it (the
``logits_processor``) land in the *next* pass's file (``Pass00000.pt`` has none; the last pass's are never written):
read here as the pass before (``LATE``). No dims, no world size, no request ids: the tp size is the number of rank
directories, each name's dims come from its rule, and requests are followed over passes by their positions
(``tpcheck.engines.sglang_dump.batches.RequestIds``).

Each entry is read under the name SGLang's newer non-intrusive dumper gives the same module's output, so one rule
file serves both layouts: ``K`` (a tensor) as ``non_intrusive__K.output``, ``K`` (a list) as
``non_intrusive__K.output.{i}``; ``rules_passes.toml`` (read before the shipped rules) adds what only this layout
needs (no parent module's output is dumped: a dense MLP's output is its ``down_proj``'s). The files are pickles and
a dump is untrusted input: loaded with ``torch.load(weights_only=True)``, a file holding anything but a dict of
tensors (or lists of tensors) refused, naming it."""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch

from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.sglang_dump.files import DumpFile, safe_load

RULES = Path(__file__).with_name("rules_passes.toml")
RANK_DIR = re.compile(r"TP(?P<tp>\d+)_PP(?P<pp>\d+)_Rank(?P<rank>\d+)_pid(?P<pid>\d+)")
PASS_FILE = re.compile(r"Pass(?P<n>\d+)\.pt")
BATCH = ".forward_batch_info."
PREFIX = "non_intrusive__"
_CACHE: OrderedDict[Path, dict] = OrderedDict()
_CACHE_FILES = 8  # one step's files of every rank (tp <= 8) stay loaded while its points are assembled


def entry_name(key: str, index: int | None) -> str:
    """A Pass file's entry (``index``: its place in a list) under the non-intrusive dumper's name."""
    return f"{PREFIX}{key}.output" + ("" if index is None else f".{index}")


def entry_key(name: str) -> tuple[str, int | None]:
    """``entry_name``'s inverse: (module name, list index or None); a name it cannot give is a DumpError."""
    m = re.fullmatch(rf"{PREFIX}(?P<key>.+)\.output(?:\.(?P<i>\d+))?", name)
    if m is None:
        raise DumpError(f"{name!r} is not a module's output: SGLang's forward-hook dumps hold module outputs only")
    return m.group("key"), None if m.group("i") is None else int(m.group("i"))


def is_late(key: str, top: str) -> bool:
    """Recorded after the top module's hook wrote the pass: ``top`` itself and modules outside it."""
    return key == top or not key.startswith(top + ".")


def rank_dirs(root: Path) -> tuple[int, dict[int, Path]]:
    """(tp size, {tp rank: its directory}); two directories of one rank (a restarted server: another pid), a
    ``Rank`` that is not ``tp_size * pp_rank + tp_rank``, pipeline stages and missing ranks are DumpErrors."""
    found: dict[tuple[int, int], list[Path]] = {}
    for d in sorted(root.iterdir()):
        if d.is_dir() and (m := RANK_DIR.fullmatch(d.name)):
            found.setdefault((int(m.group("pp")), int(m.group("tp"))), []).append(d)
    if not found:
        raise DumpError(f"{root}: no TP*_PP*_Rank*_pid* directories of SGLang's forward-hook dumper")
    for (_, tp), dirs in found.items():
        if len(dirs) > 1:
            raise DumpError(f"{dirs[1]}: tp rank {tp} has {len(dirs)} directories ({', '.join(d.name for d in dirs)}): "
                            "passes of several server processes; keep one run's")
    if any(pp for pp, _ in found):
        raise DumpError(f"{root}: pipeline stages (PP > 0): dumps of pipelined runs are not read yet")
    tp = max(t for _, t in found) + 1
    missing = sorted(set(range(tp)) - {t for _, t in found})
    if missing:
        raise DumpError(f"{root}: no directory of tp rank(s) {missing} (TP{missing[0]}_PP0_Rank{missing[0]}_pid*): a "
                        "rank that did not dump, or its files were not copied")
    for (_, t), (d,) in found.items():
        if int(RANK_DIR.fullmatch(d.name).group("rank")) != t:
            raise DumpError(f"{d}: Rank {RANK_DIR.fullmatch(d.name).group('rank')} is not tp rank {t} of stage 0")
    return tp, {t: d for (_, t), (d,) in found.items()}


def load_pass(path: Path) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """A Pass file's dict, unpickled safely (``weights_only``: no code runs) and checked: string keys, each value a
    tensor or a list of tensors; anything else a DumpError naming the file. The last few stay cached."""
    if path in _CACHE:
        _CACHE.move_to_end(path)
        return _CACHE[path]
    obj = safe_load(path, "tensors")
    if not isinstance(obj, dict):
        raise DumpError(f"{path}: holds a {type(obj).__name__}; SGLang's forward-hook dumper writes a dict "
                        "{module name: output}")
    for k, v in obj.items():
        if not isinstance(k, str):
            raise DumpError(f"{path}: a key of type {type(k).__name__}; module names are strings")
        if not (isinstance(v, torch.Tensor) or (isinstance(v, list) and v
                                                 and all(isinstance(t, torch.Tensor) for t in v))):
            raise DumpError(f"{path}: {k} is a {type(v).__name__}; an entry is a tensor or a list of tensors")
    _CACHE[path] = obj
    while len(_CACHE) > _CACHE_FILES:
        _CACHE.popitem(last=False)
    return obj


def scan(root: Path) -> list[DumpFile]:
    """Every entry of every Pass file of every rank as a ``DumpFile`` (its ``entry`` the key and list index, its
    ``meta`` the rank's place: ``world_size`` and ``sglang_parallel_info``), the batch entries under the names
    ``input_ids`` / ``seq_lens`` / ``positions``, the late entries at the pass before."""
    tp, dirs = rank_dirs(root)
    out: list[DumpFile] = []
    passes0 = None
    for rank, d in sorted(dirs.items()):
        passes = sorted((int(m.group("n")), p) for p in d.iterdir() if (m := PASS_FILE.fullmatch(p.name)))
        if not passes:
            raise DumpError(f"{d}: no Pass*.pt files")
        if passes0 is None:
            passes0 = [n for n, _ in passes]
        elif [n for n, _ in passes] != passes0:
            raise DumpError(f"{d}: passes {_span([n for n, _ in passes])}, tp rank 0's {_span(passes0)}: every rank "
                            "runs every forward pass")
        meta = {"world_size": tp, "world_rank": rank, "sglang_parallel_info": {
            "tp_rank": rank, "tp_size": tp, "pp_rank": 0, "pp_size": 1}}
        for n, path in passes:
            out += _entries(path, n, rank, meta)
    return sorted(out, key=lambda f: (f.rank, f.step, f.name))


def _entries(path: Path, n: int, rank: int, meta: dict) -> list[DumpFile]:
    obj = load_pass(path)
    batch = [k for k in obj if BATCH in k]
    top = batch[0].split(BATCH)[0] if batch else "model"
    out = []
    for order, (key, v) in enumerate(obj.items()):  # the hooks' order: the order the modules ran
        if BATCH in key:
            if not key.startswith(top + BATCH):
                raise DumpError(f"{path}: {key} and {batch[0]}: two top modules")
            name, at = key.split(BATCH, 1)[1], None
        else:
            name, at = None, key
        step = n - 1 if at is not None and is_late(at, top) else n
        if step < 0:
            raise DumpError(f"{path}: {key} in the first pass; the dumper records it after writing a pass, so it "
                            "belongs to a pass before the first")
        for index in ([None] if at is None or isinstance(v, torch.Tensor) else range(len(v))):
            full = name if at is None else entry_name(at, index)
            late = step < n  # recorded after the pass before had run through: last of that pass
            tags = {"pass": str(n), "dump_index": str(order + (1_000_000 if late else 0))}
            out.append(DumpFile(path, step, rank, full, tags, entry=(key, index), meta=meta, loader=load_entry))
    return out


def load_entry(f: DumpFile) -> tuple[torch.Tensor, dict]:
    """(tensor, meta) of one entry of a Pass file."""
    key, index = f.entry
    v = load_pass(f.path)[key]
    return (v if index is None else v[index]), dict(f.meta)


def _span(ns: list[int]) -> str:
    return f"{ns[0]}..{ns[-1]} ({len(ns)})" if ns else "none"
