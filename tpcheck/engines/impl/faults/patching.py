"""Helpers the patches use inside a rank: marking a module as faulty, re-reading checkpoint tensors,
seeded random tensors."""
from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn
from impl.loader import checkpoint_files

MARK = "_tpcheck_faults"  # on every modified module: the list of fault names applied to it


def mark(module: nn.Module, name: str) -> bool:
    """Record ``name`` on ``module``; False if it was already there (the fault is not applied twice)."""
    marks = module.__dict__.setdefault(MARK, [])
    if name in marks:
        return False
    marks.append(name)
    return True


def marks(module: nn.Module) -> list[str]:
    """The fault names marked on ``module`` itself."""
    return list(module.__dict__.get(MARK, []))


def read_tensors(runner, names: list[str], cast: bool = True) -> dict[str, torch.Tensor]:
    """Full checkpoint tensors by name, cast to the runner's dtype (``cast=False``: as stored, e.g. float32
    quantization scales)."""
    want, out = set(names), {}
    for fname, in_file in checkpoint_files(runner.cfg.model_dir).items():
        hits = want.intersection(in_file)
        if hits:
            with safe_open(fname, framework="pt") as f:
                for n in hits:
                    out[n] = f.get_tensor(n).to(runner.dtype) if cast else f.get_tensor(n)
    missing = want - set(out)
    if missing:
        raise ValueError(f"checkpoint {runner.cfg.model_dir} lacks {sorted(missing)}")
    return out


def seeded_randn(shape, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)
