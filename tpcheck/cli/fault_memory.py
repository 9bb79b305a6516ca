"""The fault matrix's memory check: the tensor bytes each rank holds (``rank_memory``, run inside the ranks) against
its share of the checkpoint (``expected_share``, from impl's shard plan), clean and with a memory fault applied
(``memory_check``). ``tpcheck.cli.fault_matrix`` re-exports these names."""
from __future__ import annotations

import math
import types

import torch

from impl.config import load_config
from impl.shard_plan import shard_plan
from tpcheck.engines.impl.faults import injected

# memory gate, after benchmarks/load_memory.py: a rank may hold its share of the checkpoint x 1.15, plus slack
MEM_FACTOR = 1.15
MEM_SLACK = 64 << 10


# ---- the memory check -----------------------------------------------------------------------------------

def _tensors_reachable(root, skip: set[int]) -> dict[int, int]:
    """``{storage pointer: bytes}`` of every tensor reachable from ``root`` through object attributes,
    modules, dicts, lists, tuples and sets (storages in ``skip`` left out)."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in skip:
                out[st.data_ptr()] = st.nbytes()
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif hasattr(o, "__dict__") and not isinstance(o, (type, types.ModuleType, types.FunctionType,
                                                             types.MethodType)):
            stack += list(vars(o).values())
    return out


def rank_memory(runner) -> dict:
    """Inside a rank: bytes of the tensors this rank's runner keeps referenced (parameters, buffers,
    anything a fault hangs on it), the KV cache excepted; the parameters alone; RssAnon from /proc."""
    kv = {t.untyped_storage().data_ptr() for a in runner.attention_layers() for t in (a.k_cache, a.v_cache)
          if t.numel()}
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in runner.model.parameters()}
    held = _tensors_reachable(runner, kv)
    rss_anon = None
    try:
        with open("/proc/self/status") as f:
            rss_anon = next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), None)
    except OSError:
        pass
    return {"rank": runner.rank, "tensor_bytes": sum(held.values()), "param_bytes": sum(params.values()),
            "rss_anon": rss_anon}


def expected_share(model_dir, tp: int, dtype: str) -> tuple[int, int]:
    """(bytes one rank should hold, bytes of the whole checkpoint), both at ``dtype``, from the checkpoint's
    tensor names and shapes and impl's shard plan (``impl.shard_plan.ShardPlan.tensor_elements``)."""
    from impl.loader import checkpoint_files, open_safetensors
    cfg = load_config(model_dir)
    plan = shard_plan(cfg, tp)
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    share = total = 0
    for fname, names in checkpoint_files(model_dir).items():
        with open_safetensors(fname) as f:
            for name in names:
                shape = list(f.get_slice(name).get_shape())
                total += math.prod(shape) * item
                share += plan.tensor_elements(name, shape, cfg.tie_word_embeddings) * item
    return share, total


def memory_check(llm, inject: list[str] = (), layer: int | None = None) -> dict:
    """Per-rank tensor bytes of ``llm`` clean and, with ``inject``, with the faults applied (the engine is
    restored after). ``flagged``: some rank holds more than ``MEM_FACTOR`` x its share + ``MEM_SLACK``;
    ``excess``: the largest held / that limit."""
    share, total = expected_share(llm.model_dir, llm.tp_size, str(llm.dtype).removeprefix("torch."))
    limit = MEM_FACTOR * share + MEM_SLACK
    clean = llm.call("tpcheck.cli.fault_matrix:rank_memory")
    ranks = clean
    if inject:
        with injected(llm, list(inject), layer):
            ranks = llm.call("tpcheck.cli.fault_matrix:rank_memory")
    worst = max(ranks, key=lambda r: r["tensor_bytes"])
    return {"share_bytes": share, "checkpoint_bytes": total, "limit_bytes": limit, "clean": clean, "ranks": ranks,
            "flagged": worst["tensor_bytes"] > limit, "excess": worst["tensor_bytes"] / limit,
            "worst_rank": worst["rank"], "worst_over_checkpoint": worst["tensor_bytes"] / total,
            "share_over_checkpoint": share / total}


def _memory_note(m: dict) -> str:
    r = m["worst_rank"]
    held = next(x for x in m["ranks"] if x["rank"] == r)["tensor_bytes"]
    before = next(x for x in m["clean"] if x["rank"] == r)["tensor_bytes"]
    return (f"rank {r} holds {held / 1024:.0f} KiB = {m['worst_over_checkpoint']:.2f}x checkpoint "
            f"(clean {before / 1024:.0f} KiB; share {m['share_over_checkpoint']:.2f}x)")
