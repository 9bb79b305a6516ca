"""Where a run computes: the engine's device (``--device``) and the golden's and references' (``--golden-device``).

The device is a parameter, never an assumption (``/work/shared/DESIGN.md``): every path is the same code on
``cpu`` (CI) and on ``cuda``. The names a user gives: ``auto`` (CUDA when this process sees a GPU, else the CPU),
``cpu``, ``cuda`` (impl's ranks one per GPU, ranks past the GPU count sharing them: ``impl.distributed.rank_device``)
and ``cuda:K`` (every rank, and the golden, on GPU ``K``). ``resolve_device`` turns a name into the device that
runs, refusing a GPU this machine does not have (a ``ValueError`` naming the flag: exit 2) rather than falling back
to the CPU in silence.

The boundaries where tensors change device, each with one owner:

* driver <-> impl's ranks: host memory either way (``impl.executor.on_host``); a rank moves what it receives to its
  own device (``tpcheck.engines.impl.ranks.write_prefix``, ``tpcheck.capture.teacher.Teacher``);
* engine points -> the golden's device (``to_device`` in ``tpcheck.pipeline.steps``): statistics are computed
  where the golden is, and only numbers (``float``, ``int``, lists of them) come back to the host."""
from __future__ import annotations

import os

import torch

from tpcheck.inputs.arg_types import device_name


def gpu_count() -> int:
    """CUDA GPUs this process sees (0 on a CPU-only build or machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, flag: str = "--device", gpus: int | None = None) -> str:
    """The device ``name`` runs on: ``auto`` -> ``cuda`` with a GPU, else ``cpu``; ``cpu`` / ``cuda`` / ``cuda:K``
    as given where this machine has them (``gpus``: its GPU count, ``gpu_count()`` unless given), else a
    ``ValueError`` naming ``flag`` (exit 2: asked for a GPU that is not there)."""
    name = device_name(name)
    gpus = gpu_count() if gpus is None else gpus
    if name == "auto":
        return "cuda" if gpus else "cpu"
    if name == "cpu":
        return name
    if not gpus:
        why = "this torch build has no CUDA" if not torch.backends.cuda.is_built() else "no CUDA GPU is visible"
        raise ValueError(f"{flag} {name}: {why} (torch {torch.__version__}; CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run with {flag} cpu")
    _, _, index = name.partition(":")
    if index and int(index) >= gpus:
        raise ValueError(f"{flag} {name}: this machine has {gpus} CUDA GPU(s) (cuda:0-cuda:{gpus - 1})")
    return name


def to_device(tree, device: str | torch.device):
    """``tree`` (dicts, lists, tuples) with every tensor on ``device`` (those already there untouched, no copy)."""
    device = torch.device(device)
    if isinstance(tree, torch.Tensor):
        return tree if _same(tree.device, device) else tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


def _same(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:<current>`` are one device."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        cur = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index


def devices_of(tree) -> set[str]:
    """The devices of every tensor in ``tree`` (tests: what crossed a boundary, and where it lies)."""
    if isinstance(tree, torch.Tensor):
        return {str(tree.device)}
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return set().union(*(devices_of(v) for v in tree)) if tree else set()
    return set()
