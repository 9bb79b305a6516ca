"""Functions run inside TP workers through ``LLM.call("worker_fns:NAME", ...)`` (tests/ is on the
workers' sys.path: spawn copies the parent's)."""
import os
import time

import torch

from impl.distributed import all_reduce


def exit_on_rank(runner, rank: int, code: int = 3):
    if runner.rank == rank:
        os._exit(code)
    return runner.rank


def sleep_on_rank(runner, rank: int, seconds: float):
    if runner.rank == rank:
        time.sleep(seconds)
    return runner.rank


def raise_on_rank(runner, rank: int):
    if runner.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    return runner.rank


def fail_then_collective(runner, rank: int):
    """Rank ``rank`` fails while its peers wait for it in an all-reduce."""
    if runner.rank == rank:
        raise ValueError("failed before the all-reduce")
    all_reduce(torch.ones(1))
    return runner.rank


def pid(runner):
    return os.getpid()


def runtime_error_on_rank(runner, rank: int):
    """An engine bug: a RuntimeError inside one rank (e.g. a dtype mismatch in an index_put)."""
    if runner.rank == rank:
        torch.zeros(4).index_put_((torch.tensor([0]),), torch.ones(1, dtype=torch.float64))
    return runner.rank


def hf_tp_swap_q_halves(rank, layer: int, on_rank: int = 1):
    """A broken Hugging Face TP rank (``tpcheck.engines.hf_tp.ranks.HFTPRank``): on ``on_rank``, layer ``layer``'s local
    q_proj shard has its two halves (rows and bias) swapped, as a loader that slices the wrong way would."""
    if rank.rank != on_rank:
        return False
    proj = rank.model.model.layers[layer].self_attn.q_proj
    with torch.no_grad():
        for p in (proj.weight, proj.bias):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.cat(local.chunk(2, dim=0)[::-1]))
    return True


def hf_tp_zero_o_proj(rank, layer: int, on_rank: int = 1):
    """On ``on_rank``, layer ``layer``'s o_proj shard is zeros (a shard never loaded)."""
    if rank.rank != on_rank:
        return False
    w = rank.model.model.layers[layer].self_attn.o_proj.weight
    with torch.no_grad():
        (w.to_local() if hasattr(w, "to_local") else w).zero_()
    return True


def loaded_tensors(runner):
    """``{checkpoint tensor: elements read}`` of this rank's load (other expert groups' experts absent)."""
    return runner.loaded_tensors


def moe_route_second_best(runner, layer: int):
    """Inside a rank: decoder layer ``layer``'s MoE top-k picks the experts ranked 2..k+1 instead of 1..k (a
    routing bug whose router logits are right)."""
    topk = runner.model.model.layers[layer].mlp.topk
    orig = topk.forward

    def forward(router_logits):
        weights, ids = orig(router_logits)
        probs = torch.softmax(router_logits.float(), dim=-1)
        ids = probs.topk(ids.shape[-1] + 1, dim=-1).indices[:, 1:]
        return probs.gather(-1, ids).to(weights.dtype), ids

    topk.forward = forward
    return runner.rank


def pending_points(runner) -> list[str]:
    """The points impl's installed capture holds for a step not yet closed (``tpcheck.engines.impl.ranks``)."""
    st = getattr(runner.model, "_tpcheck", None)
    return [] if st is None else sorted(st["capture"]._pending)


def capture_names(runner) -> list[str]:
    """The points impl's installed capture hooks can give (``tpcheck.engines.impl.ranks``)."""
    st = getattr(runner.model, "_tpcheck", None)
    return [] if st is None else sorted(st["capture"].names)


def staged_collectives(runner, staged: bool) -> dict:
    """Inside a rank: impl's collectives on rank-specific tensors, through the host-staged path of ranks that share a
    GPU (``impl.distributed._staged``) when ``staged``, else directly; with this rank's device."""
    from impl import distributed as d
    old = d._DEVICE["staged"]
    d._DEVICE["staged"] = staged
    try:
        r = d.get_tp_rank()
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) + r / 3
        summed = d.all_reduce(x.clone())
        return {"x": x, "all_reduce": summed, "all_gather": d.all_gather(x, dim=-1), "gather": d.gather(x, dim=0),
                "device": str(runner.device)}
    finally:
        d._DEVICE["staged"] = old


def staged_logits(runner, staged: bool, ids: list[int]):
    """Inside a rank: the logits of ``ids`` with every collective of the forward host-staged (``staged``) or not."""
    from impl import distributed as d
    old = d._DEVICE["staged"]
    d._DEVICE["staged"] = staged
    try:
        return runner.logits(ids)
    finally:
        d._DEVICE["staged"] = old


def received_devices(runner, tree) -> list[str]:
    """Inside a rank: the devices of the tensors an ``Executor.call`` argument arrived with."""
    from tpcheck.inputs.devices import devices_of
    return sorted(devices_of(tree))
