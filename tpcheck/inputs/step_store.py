"""One store for tensors kept per step: a dump's rank directories (``tpcheck.capture.dump``) and a saved golden
(``tpcheck.reference.saved``) write each step as a safetensors file with, in JSON, a record per tensor (dtype, shape,
sha256: ``tpcheck.inputs.validate.tensor_record``), the JSON replaced atomically; a reader loads a step refusing an
unreadable file (its own error class, naming the file) and checks each tensor against its record. Safetensors and
JSON only: nothing is unpickled."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tpcheck.inputs.validate import tensor_bytes, tensor_record


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
    (``tests/test_tpcheck/test_step_store.py``)."""
    if any(t.dtype not in _DTYPES for t in tensors.values()):
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
        return {n: tensor_record(t) for n, t in tensors.items()}
    header: dict = {}
    views, records, offset = [], {}, 0
    for name, t in tensors.items():
        raw = tensor_bytes(t)
        n = len(raw) if isinstance(raw, bytes) else raw.nbytes
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        records[name] = tensor_record(t, hashlib.sha256(raw).hexdigest())
        views.append(raw)
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data start 8-byte aligned, as the library pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in views:
            f.write(raw)
    return records


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
