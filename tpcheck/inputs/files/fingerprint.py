"""A checkpoint directory's sampled content fingerprint, recorded by saved goldens and dumps so that a replay or a
``compare`` refuses another checkpoint's data: ``config.json`` and, per weight file, its name, size and 16
sampled 64 KiB blocks (not a hash of every byte: a 70B checkpoint would take minutes to read; weights changed in
place at the same size and outside the samples go unseen, so keep one directory per checkpoint)."""
from __future__ import annotations

import hashlib
from pathlib import Path

_SAMPLES, _BLOCK = 16, 64 * 1024


def fingerprint(model_dir: str | Path) -> str:
    """The sampled content fingerprint of checkpoint directory ``model_dir`` (the module docstring)."""
    root = Path(model_dir)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for i in range(_SAMPLES):
                fh.seek(max(0, (size - _BLOCK) * i // max(1, _SAMPLES - 1)))
                h.update(fh.read(_BLOCK))
    return h.hexdigest()
