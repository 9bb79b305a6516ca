"""The tensor-parallel group: one process per rank on torch.distributed (gloo on CPU, NCCL on CUDA).

Without an initialised process group every call degrades to tp_size 1 (rank 0, identity collectives), so a
layer can be run in-process in unit tests."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_tp(rank: int, world_size: int, store_path: str | None = None, timeout_s: float = 120.0,
            device: str = "cpu") -> None:
    """Join the TP group: through a FileStore at ``store_path`` (no port to pick, so no race between
    parallel test workers), or through ``env://`` when launched by torchrun (``store_path`` None)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    kwargs = dict(backend=backend, timeout=timedelta(seconds=timeout_s))
    if store_path is None:
        dist.init_process_group(init_method="env://", **kwargs)
    else:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)


def close_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place, in x's own dtype."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; every rank gets the result."""
    n = get_tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on rank ``dst`` only (others get None)."""
    n = get_tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)] if get_tp_rank() == dst else None
    dist.gather(x.contiguous(), parts, dst=dst)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_object(obj, src: int = 0):
    """Send a small picklable object from ``src`` to every rank (e.g. the sampled token ids)."""
    if get_tp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
