"""A vLLM ``general_plugins`` entry point: ``TPCHECK_DUMP_FAULT=NAME@LAYER[:RANK]`` (with ``TPCHECK_DUMP``) seeds
one of ``--engine vllm``'s in-rank faults (``tpcheck.engines.vllm.faults.VLLM_FAULTS``, or a pipeline one) into
decoder layer ``LAYER`` on TP rank ``RANK`` (default 0) of the user's own, unchanged script::

    TPCHECK_DUMP=runs/bad TPCHECK_DUMP_FAULT=o-proj-partial@1:1 python my_vllm_script.py
    tpcheck compare runs/bad --model CKPT        # FAIL, origin layers.1.attn.out

What proves, on that script's own requests, that ``compare`` finds a wrong rank where it starts. Declared in
pyproject (``tpcheck_fault``) beside the dump's plugin; without the variable it returns at once, importing nothing.
The fault is applied through the dump plugin's ``AFTER_LOAD`` (once the worker's model is loaded, before the
capture's hooks, which it precedes: its hooks are prepended); a name, layer or rank it cannot apply stops the
worker with an error naming the variable."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("tpcheck.engines.vllm.fault_plugin")

ENV_FAULT = "TPCHECK_DUMP_FAULT"


def parse_fault(spec: str, num_layers: int) -> tuple[str, int, int]:
    """``NAME@LAYER[:RANK]`` as ``(name, layer, rank)``; a ``ValueError`` naming ``TPCHECK_DUMP_FAULT`` otherwise."""
    from tpcheck.engines.vllm.faults import VLLM_FAULTS
    from tpcheck.engines.vllm.pp import VLLM_PP_FAULTS
    name, _, where = spec.partition("@")
    layer, _, rank = where.partition(":")
    known = [*VLLM_FAULTS, *VLLM_PP_FAULTS]
    if name not in known:
        raise ValueError(f"{ENV_FAULT}={spec!r}: unknown fault {name!r}; known: {', '.join(known)}")
    if not layer.isdigit() or int(layer) >= num_layers or (rank and not rank.isdigit()):
        raise ValueError(f"{ENV_FAULT}={spec!r}: want NAME@LAYER[:RANK], LAYER a decoder layer of 0..{num_layers - 1}")
    return name, int(layer), int(rank or 0)


def seed(worker) -> None:
    """``TPCHECK_DUMP_FAULT``'s fault applied on this worker's rank (nothing on the other ranks)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from tpcheck.engines.vllm.faults import apply_fault
    model = worker.model_runner.get_model()
    name, layer, rank = parse_fault(os.environ[ENV_FAULT], len(model.model.layers))
    tp = get_tensor_model_parallel_world_size()
    if rank >= tp:
        raise ValueError(f"{ENV_FAULT}={os.environ[ENV_FAULT]!r}: rank {rank} of a tp {tp} engine")
    if rank == get_tensor_model_parallel_rank():
        apply_fault(model, worker, name, layer)
        logger.warning(f"tpcheck: fault {name} seeded in layer {layer} on TP rank {rank} ({ENV_FAULT})")


def register() -> None:
    """The entry point: with ``TPCHECK_DUMP_FAULT`` and ``TPCHECK_DUMP``, ``seed`` each worker once it is loaded."""
    if not os.environ.get(ENV_FAULT):
        return
    if not os.environ.get("TPCHECK_DUMP"):
        logger.warning(f"tpcheck: {ENV_FAULT} without TPCHECK_DUMP: nothing is seeded (the fault is for a dump)")
        return
    from tpcheck.engines.vllm.plugin import AFTER_LOAD
    if seed not in AFTER_LOAD:  # plugins may be loaded more than once per process
        AFTER_LOAD.append(seed)
