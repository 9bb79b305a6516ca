"""The tensor-parallel group: one process per rank on torch.distributed (gloo on CPU, NCCL on CUDA).

With pipeline parallelism (``pp_size > 1``, ``impl.pipeline``) the world is ``pp * tp`` ranks, global rank
``stage * tp + tp_rank``; each stage is its own TP process group, and every collective here runs within the
caller's stage (``get_tp_rank`` / ``get_tp_size`` are stage-local). ``send_next`` / ``recv_prev`` move a stage's
``IntermediateTensors`` to the same TP rank of the next stage. With ``pp_size`` 1 the TP group is the default
(world) group, exactly as before pipeline parallelism existed.

Without an initialised process group every call degrades to tp_size 1 (rank 0, identity collectives), so a
layer can be run in-process in unit tests."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


_STAGE: dict = {"group": None, "ranks": None, "pp_rank": 0, "pp_size": 1}  # group None: the world is the TP group


def init_tp(rank: int, world_size: int, store_path: str | None = None, timeout_s: float = 120.0,
            device: str = "cpu", pp_size: int = 1) -> None:
    """Join the TP group: through a FileStore at ``store_path`` (no port to pick, so no race between
    parallel test workers), or through ``env://`` when launched by torchrun (``store_path`` None). With
    ``pp_size > 1``, ``world_size / pp_size`` consecutive ranks form each stage's TP group."""
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(f"world_size={world_size} is not a multiple of pp_size={pp_size}")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    kwargs = dict(backend=backend, timeout=timedelta(seconds=timeout_s))
    if store_path is None:
        dist.init_process_group(init_method="env://", **kwargs)
    else:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)
    if pp_size > 1:
        tp = world_size // pp_size
        me = dist.get_rank()
        for stage in range(pp_size):  # torch needs every rank to create every group, in the same order
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks)
            if me in ranks:
                _STAGE.update(group=group, ranks=ranks, pp_rank=stage, pp_size=pp_size)


def close_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _STAGE.update(group=None, ranks=None, pp_rank=0, pp_size=1)


def get_tp_rank() -> int:
    if not dist.is_initialized():
        return 0
    return dist.get_rank(_STAGE["group"]) if _STAGE["group"] is not None else dist.get_rank()


def get_tp_size() -> int:
    if not dist.is_initialized():
        return 1
    return len(_STAGE["ranks"]) if _STAGE["group"] is not None else dist.get_world_size()


def get_pp_rank() -> int:
    """This rank's pipeline stage (0 without pipeline parallelism)."""
    return _STAGE["pp_rank"]


def get_pp_size() -> int:
    return _STAGE["pp_size"]


def _global(tp_rank: int) -> int:
    """The global rank of TP rank ``tp_rank`` of this rank's stage."""
    return _STAGE["ranks"][tp_rank] if _STAGE["group"] is not None else tp_rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the stage's TP ranks, in place, in x's own dtype."""
    if get_tp_size() > 1:
        dist.all_reduce(x, group=_STAGE["group"])
    return x


def _neighbour(offset: int) -> int:
    """The global rank of this TP rank in stage ``pp_rank + offset``."""
    stage = _STAGE["pp_rank"] + offset
    if not 0 <= stage < _STAGE["pp_size"]:
        raise RuntimeError(f"pipeline stage {_STAGE['pp_rank']} has no stage {stage} to talk to "
                           f"(pp_size={_STAGE['pp_size']})")
    return stage * get_tp_size() + get_tp_rank()


def send_next(tensors: dict[str, torch.Tensor]) -> None:
    """Send ``tensors`` (in their order) to the same TP rank of the next stage."""
    dst = _neighbour(1)
    for t in tensors.values():
        dist.send(t.contiguous(), dst=dst)


def recv_prev(names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Receive ``names`` (each ``shape``, ``dtype``) from the same TP rank of the previous stage; the receiver
    knows the shapes from the batch every rank was given, so no metadata travels."""
    src = _neighbour(-1)
    out = {}
    for name in names:
        out[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[name], src=src)
    return out


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; every rank gets the result."""
    n = get_tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=_STAGE["group"])
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every TP rank's ``x`` along ``dim`` on TP rank ``dst`` of the stage only (others get None)."""
    n = get_tp_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)] if get_tp_rank() == dst else None
    dist.gather(x.contiguous(), parts, dst=_global(dst), group=_STAGE["group"])
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_object(obj, src: int = 0):
    """Send a small picklable object from ``src`` to every rank (e.g. the sampled token ids)."""
    if get_tp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_global(src), group=_STAGE["group"])
    return box[0]
