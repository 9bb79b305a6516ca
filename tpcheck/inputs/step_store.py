"""One store for tensors kept per step: a dump's rank directories (``tpcheck.capture.dump``) and a saved golden
(``tpcheck.reference.saved``) write each step as a safetensors file with, in JSON, a record per tensor (dtype, shape,
sha256: ``tpcheck.inputs.validate.tensor_record``), the JSON replaced atomically; a reader loads a step refusing an
unreadable file (its own error class, naming the file) and checks each tensor against its record. Safetensors and
JSON only: nothing is unpickled."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tpcheck.inputs.validate import tensor_record


def save_step(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Write ``tensors`` (contiguous, on the CPU) to the safetensors file ``path``; their records, for the JSON."""
    save_file(tensors, str(path))
    return {n: tensor_record(t) for n, t in tensors.items()}


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
