"""The tensor-parallel group: one process per rank on torch.distributed (gloo on CPU, NCCL on CUDA).

Devices (``rank_device``, ``shares_device``): ``device="cuda"`` puts rank ``r`` on GPU ``r mod n`` of the
node's ``n``; with more ranks than GPUs (tp 2 / 4 on one GPU) ranks share a GPU, which NCCL refuses (one rank per
device), so the group is gloo and every collective of a CUDA tensor is staged through host memory (``_staged``:
copied to the host, reduced or gathered there, copied back): correct and slow, for testing TP on one lent GPU.
``cuda:K`` puts every rank on GPU ``K`` (sharing it from 2 ranks).

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

from impl import batch_invariant


_STAGE: dict = {"group": None, "ranks": None, "pp_rank": 0, "pp_size": 1}  # group None: the world is the TP group
_DEVICE: dict = {"device": "cpu", "staged": False}  # this rank's device; whether collectives stage through the host


def rank_device(device: str, rank: int, gpus: int) -> str:
    """The device of global rank ``rank`` when the run asks for ``device`` on a node with ``gpus`` GPUs: ``cpu``
    as is; ``cuda`` -> ``cuda:{rank mod gpus}`` (ranks past the GPU count share them); ``cuda:K`` -> ``cuda:K``
    for every rank. A CUDA device on a node without one (or ``K >= gpus``) is a ``ValueError`` naming it."""
    if not device.startswith("cuda"):
        return device
    if gpus < 1:
        raise ValueError(f"device {device!r}: this node has no CUDA GPU (torch.cuda.device_count() is 0)")
    _, _, index = device.partition(":")
    if not index:
        return f"cuda:{rank % gpus}"
    if not index.isdigit() or int(index) >= gpus:
        raise ValueError(f"device {device!r}: this node has {gpus} CUDA GPU(s) (cuda:0-cuda:{gpus - 1})")
    return device


def shares_device(device: str, world_size: int, gpus: int) -> bool:
    """Whether some ranks of a ``world_size`` group on ``device`` share a GPU (``rank_device``): then the group is
    gloo with host-staged collectives, since NCCL needs one rank per device. Every rank computes the same answer
    (the same node), so every rank picks the same backend."""
    if not device.startswith("cuda") or world_size < 2:
        return False
    return ":" in device or world_size > gpus


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_device(device: str) -> str:
    """This process's device for a run on ``device`` (``rank_device`` of its global rank; rank 0 without a group):
    what ``init_tp`` set as the current CUDA device, so a model loaded there meets its collectives."""
    gpus = _gpu_count() if device.startswith("cuda") else 0
    return rank_device(device, dist.get_rank() if dist.is_initialized() else 0, gpus)


def init_tp(rank: int, world_size: int, store_path: str | None = None, timeout_s: float = 120.0,
            device: str = "cpu", pp_size: int = 1) -> None:
    """Join the TP group: through a FileStore at ``store_path`` (no port to pick, so no race between
    parallel test workers), or through ``env://`` when launched by torchrun (``store_path`` None). With
    ``pp_size > 1``, ``world_size / pp_size`` consecutive ranks form each stage's TP group."""
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(f"world_size={world_size} is not a multiple of pp_size={pp_size}")
    gpus = _gpu_count() if device.startswith("cuda") else 0
    mine = rank_device(device, rank, gpus)
    staged = shares_device(device, world_size, gpus)
    if mine.startswith("cuda"):
        torch.cuda.set_device(torch.device(mine))  # NCCL and broadcast_object_list use the current device
    _DEVICE.update(device=mine, staged=staged)
    backend = "nccl" if device.startswith("cuda") and not staged else "gloo"
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
    _DEVICE.update(device="cpu", staged=False)


def _staged(x: torch.Tensor) -> bool:
    """Whether a collective of ``x`` goes through a host copy: gloo on ranks that share a GPU (it has no CUDA
    all-gather, gather or send, and its CUDA all-reduce is not NCCL's either way). ``_DEVICE["staged"]`` set
    on a CPU rank exercises the same path (tests)."""
    return _DEVICE["staged"]


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
    """Sum over the stage's TP ranks, in place, in x's own dtype (batch-invariant mode: ``_rank_order_sum``)."""
    if get_tp_size() > 1:
        if batch_invariant.enabled():
            x.copy_(_rank_order_sum(x))
        elif _staged(x):
            host = x.to("cpu", copy=True)
            dist.all_reduce(host, group=_STAGE["group"])
            x.copy_(host)
        else:
            dist.all_reduce(x, group=_STAGE["group"])
    return x


def _rank_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` gathered and added in rank order, ``((x_0 + x_1) + x_2) + ...``: each element summed in
    one order whatever the tensor's size. A ring or tree all-reduce cuts the buffer into chunks by its size and
    starts each chunk's sum at another rank, so with more than two ranks an element's bits depend on where it falls
    in the step's tensor, i.e. on the batch (found at tp 4 by ``tpcheck invariance``); two addends commute exactly."""
    return rank_order_sum(all_gather(x.unsqueeze(0), dim=0), 0)


def rank_order_sum(partials: torch.Tensor, start: int) -> torch.Tensor:
    """``partials[start] + partials[start + 1] + ...`` (cyclically over dim 0), each add rounded to their dtype."""
    n = partials.shape[0]
    acc = partials[start].clone()
    for k in range(1, n):
        acc = acc + partials[(start + k) % n]
    return acc


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
        dist.send(t.to("cpu", copy=True) if _staged(t) else t.contiguous(), dst=dst)


def recv_prev(names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Receive ``names`` (each ``shape``, ``dtype``) from the same TP rank of the previous stage; the receiver
    knows the shapes from the batch every rank was given, so no metadata travels."""
    src = _neighbour(-1)
    out = {}
    for name in names:
        out[name] = torch.empty(shape, dtype=dtype, device=device)
        if _staged(out[name]):
            host = torch.empty(shape, dtype=dtype)
            dist.recv(host, src=src)
            out[name].copy_(host)
        else:
            dist.recv(out[name], src=src)
    return out


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; every rank gets the result."""
    n = get_tp_size()
    if n == 1:
        return x
    if _staged(x):
        return _all_gather(x.to("cpu", copy=True), dim).to(x.device)
    return _all_gather(x, dim)


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_STAGE["group"])
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every TP rank's ``x`` along ``dim`` on TP rank ``dst`` of the stage only (others get None)."""
    n = get_tp_size()
    if n == 1:
        return x
    device = x.device
    if _staged(x):
        x = x.to("cpu", copy=True)
    parts = [torch.empty_like(x) for _ in range(n)] if get_tp_rank() == dst else None
    dist.gather(x.contiguous(), parts, dst=_global(dst), group=_STAGE["group"])
    return torch.cat(parts, dim=dim).to(device) if parts is not None else None


def broadcast_object(obj, src: int = 0):
    """Send a small picklable object from ``src`` to every rank (e.g. the sampled token ids)."""
    if get_tp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_global(src), group=_STAGE["group"])
    return box[0]
