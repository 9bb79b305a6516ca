"""A pipeline stage's side of its stage boundaries, inside a rank: the hand-off points it sends or receives
(``HandoffHooks``: impl's ranks, ``tpcheck.engines.impl.ranks``; vLLM's, ``tpcheck.engines.vllm.stages``) and the
stage file of a pipelined dump (``write_stage``; ``tpcheck.engines.dump.stages`` reads it)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from impl.placements import Replicate
from tpcheck.capture.core import handoff
from tpcheck.inputs.files.step_store import write_json_atomic

STAGE_FILE = "stage.json"


class HandoffHooks:
    """A pipeline stage's side of its boundaries as ``layers.{i}.handoff`` points (``tpcheck.capture.core.handoff``,
    ``[hidden_states | residual]``, ``Replicate()``: every TP rank holds both whole), hooked on the stage's model
    (``module``): after layer ``received`` (the previous stage's last), the ``IntermediateTensors`` the model is
    called with (its ``kwarg``, or its third argument), before any of its layers touches them; after layer ``sent``
    (its own last), the ones it returns to send. None: no such boundary; nor one the ``points`` regex (``--points``)
    does not keep. Which of the two a point is, the harness tells by the stage that reported it
    (``tpcheck.engines.impl.adapter.stage_points``)."""

    def __init__(self, module, received: int | None, sent: int | None, kwarg: str, points: str | None = None):
        self._got: dict[str, torch.Tensor] = {}
        self.armed = True  # False: the hooks copy nothing (``tpcheck.capture.core.Capture.armed``)
        self._handles = []
        keep = None if points is None else re.compile(points)
        received, sent = (None if i is None or (keep is not None and not keep.fullmatch(f"layers.{i}.handoff"))
                          else i for i in (received, sent))
        if received is not None:
            self._handles.append(module.register_forward_pre_hook(self._received(received, kwarg), with_kwargs=True))
        if sent is not None:
            self._handles.append(module.register_forward_hook(self._sent(sent)))

    def _received(self, layer: int, kwarg: str):
        def hook(module, args, kwargs):
            inter = kwargs.get(kwarg, args[2] if len(args) > 2 else None)
            if inter is not None and self.armed:
                self._got[f"layers.{layer}.handoff"] = handoff(inter["hidden_states"], inter["residual"]).cpu()
        return hook

    def _sent(self, layer: int):
        def hook(module, args, out):
            if self.armed:
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


def write_stage(root: str | Path, stage: int, pp: int, layers: tuple[int, int]) -> None:
    """Record stage ``stage`` of ``pp``, holding decoder layers ``[start, end)``, in ``root/stage{stage}``."""
    d = Path(root) / f"stage{stage}"
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / STAGE_FILE, {"stage": stage, "pp": pp, "layers": [int(layers[0]), int(layers[1])]})
