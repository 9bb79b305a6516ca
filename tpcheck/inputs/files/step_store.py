"""One store for tensors kept per step: a dump's rank directories (``tpcheck.capture.dump``) and a saved golden
(``tpcheck.reference.saved``) write each step as a safetensors file with, in JSON, a record per tensor (dtype, shape,
sha256: ``tpcheck.inputs.files.validate.tensor_record``), the JSON replaced atomically; a reader loads a step refusing an
unreadable file (its own error class, naming the file) and checks each tensor against its record. Safetensors and
JSON only: nothing is unpickled."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tpcheck.inputs.files.validate import tensor_bytes, tensor_record


# torch dtype -> safetensors' name for it (the format's spec); a step holding another dtype is written by the library
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def save_step(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Write ``tensors`` (on the CPU) to the safetensors file ``path``; their records, for the JSON.

    Written here, not by ``safetensors.torch.save_file``: the format is an 8-byte header length, a JSON header
    (each tensor's dtype, shape and byte range) and the tensors' bytes one after another, and each tensor's bytes
    are hashed and written from one view of them. Why: a dump writes every point of every step, hundreds of small
    tensors a step, and the library's per-tensor Python (shared-storage checks, a numpy array built per tensor) came
    on top of the hashing: a decode step of qwen2.5-0.5b's every point (313 tensors, 7.4 MiB) took 10.9 ms with
    ``save_file`` and the records, 8.7 ms here (medians of 15, this machine), of which ~6 ms is the sha256 itself.
    The library reads these files (``load_step``), so a malformed one is refused, never misread
    (``tests/test_tpcheck/inputs/files/test_step_store.py``)."""
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
        return {n: tensor_record(t) for n, t in tensors.items()}
    header: dict = {}
    views, sizes, offset = [], [], 0
    for name, t in tensors.items():
        raw = tensor_bytes(t)
        n = len(raw) if isinstance(raw, bytes) else raw.nbytes
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        views.append(raw)
        sizes.append(n)
        offset += n
    digests = _digests(views, sizes)  # hashed by other threads while this one writes, where there are (_digests)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data start 8-byte aligned, as the library pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in views:
            f.write(raw)
    return {name: tensor_record(t, d) for (name, t), d in zip(tensors.items(), digests())}


# threads that hash a large step's tensors side by side (hashlib lets go of the GIL on buffers over 2 KiB): a
# quarter of the cores, at most 4, none under 8 cores (there the engine's ranks hold the cores: on this project's 2
# cores a dump's writer thread already bought nothing, README); a step under PARALLEL_BYTES is hashed in the calling
# thread
HASH_THREADS = min(4, (os.cpu_count() or 1) // 4) if (os.cpu_count() or 1) >= 8 else 0
PARALLEL_BYTES = 4 << 20
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)


def _digests(views: list, sizes: list[int]) -> Callable[[], list[str]]:
    """A function giving the sha256 of each buffer, in order. Over ``PARALLEL_BYTES`` in all and with
    ``HASH_THREADS``, the buffers are split into that many runs of neighbours of about equal bytes, each run hashed
    by one thread from now on (the caller writes the file meanwhile; the function waits for them); else they are
    hashed when it is called. Why: sha256 runs at ~1.2-1.9 GB/s a core, and a dump of every point of every step is
    bound by it where the host has cores to spare (qwen2.5-0.5b on an H200: 1.9 GB over 64 steps, 1.46 s of sha256
    and 0.85 s of writes against a 1.85 s ``generate``)."""
    total = sum(sizes)
    if HASH_THREADS < 2 or total < PARALLEL_BYTES or len(views) < 2:
        return lambda: [hashlib.sha256(v).hexdigest() for v in views]
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():  # a forked process has none of its parent's threads: its own pool
        _POOL = (os.getpid(), ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="tpcheck-hash"))
    runs, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc * HASH_THREADS >= total * (len(runs) + 1) and i + 1 < len(views):
            runs.append((start, i + 1))
            start = i + 1
    runs.append((start, len(views)))
    jobs = [_POOL[1].submit(lambda a, b: [hashlib.sha256(v).hexdigest() for v in views[a:b]], a, b) for a, b in runs]
    return lambda: [d for job in jobs for d in job.result()]


def write_json_atomic(path: Path, obj) -> None:
    """``obj`` as JSON in ``path``, through a temporary file: a crash mid-write leaves the previous file (or none),
    never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def load_step(path: Path, error: type[Exception]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``; an unreadable one is ``error`` naming it."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise error(f"{path}: not a readable safetensors file ({e})") from None
