"""Teacher forcing (``--isolate``): forward pre-hooks on a model's decoder layers and final norm that replace each
one's hidden-states input with a given tensor, so every layer runs on the golden's input rather than on its
predecessor's output. One implementation for every engine tpcheck drives itself: the Hugging Face reference
(``tpcheck.reference.hf.HFCapture``), Hugging Face's tp_plan ranks (``tpcheck.engines.hf_tp``) and impl's ranks
(``tpcheck.engines.impl.ranks``)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class Teacher:
    """Pre-hooks on ``layers`` (decoder layer ``i``) and ``norm`` (the final norm, ``i = len(layers)``) that, while
    ``inputs`` is set (``{i: [rows, hidden]}``), replace the module's hidden-states input with ``inputs[i]`` (a module
whose ``i`` it lacks keeps its own input: a replayed dump without ``embed`` leaves layer 0 its own embedding), cast
    to ``like.dtype`` on ``like.device`` (read at each call: the model, or impl's runner). ``arg``: the position of
    a decoder layer's hidden states among its positional arguments (HF: 0, ``hidden_states`` when passed by
    keyword; impl's ``layer(positions, x)``: 1); the norm's is its first. ``batch_dim``: add a leading batch dim
    of one (HF's ``[1, rows, hidden]``)."""

    def __init__(self, layers: Sequence[nn.Module], norm: nn.Module, like, arg: int = 0, batch_dim: bool = False):
        self.inputs: dict[int, torch.Tensor] | None = None
        self.like, self.batch_dim = like, batch_dim
        mods = [(m, arg) for m in layers] + [(norm, 0)]
        self._handles = [m.register_forward_pre_hook(self._hook(i, pos), with_kwargs=True)
                         for i, (m, pos) in enumerate(mods)]

    def _hook(self, i: int, pos: int):
        def hook(mod, args, kwargs):
            if self.inputs is None or i not in self.inputs:  # a key left out: the module's own input
                return None
            x = self.inputs[i].to(dtype=self.like.dtype, device=self.like.device)
            if self.batch_dim:
                x = x[None]
            if len(args) > pos:
                return (*args[:pos], x, *args[pos + 1:]), kwargs
            return args, {**kwargs, "hidden_states": x}  # HF passes it by keyword in some versions
        return hook

    def remove(self) -> None:
        """Remove the pre-hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
