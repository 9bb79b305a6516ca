"""``tpcheck.engines.vllm.worker.NormTeacher`` on a stand-in of vLLM's decoder (no vLLM needed): each layer's fused
add + RMSNorm is called on ``(0, teacher)``, the layer runs on the teacher's input exactly, and a capture hook
registered before it still sees the engine's own output of the layer before."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcheck.engines.vllm.worker import NormTeacher


class FusedNorm(nn.Module):
    """vLLM's ``RMSNorm(x, residual)``: ``(norm(x + residual), x + residual)``, updating its arguments in place
    (the CPU kernel's way); a plain ``norm(x)`` without a residual. The "norm" is a doubling: exact, easy to follow."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * 2
        residual.add_(x)
        x.copy_(residual * 2)
        return x, residual


class Layer(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.input_layernorm, self.k = FusedNorm(), k

    def forward(self, positions, h, residual):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        return h * self.k, residual  # what the layer adds to the residual stream at the next norm


class Decoder(nn.Module):
    def __init__(self, ks=(3.0, 5.0, 7.0)):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Layer(k) for k in ks)
        self.model.norm = FusedNorm()

    def forward(self, x):
        h, res = x.clone(), None
        for layer in self.model.layers:
            h, res = layer(None, h, res)
        return self.model.norm(h, res)[0]


def _own_outputs(model) -> list[list[torch.Tensor]]:
    """What a capture registered first records: each norm's residual output (layer i-1's ``out``)."""
    seen = [[] for _ in range(len(model.model.layers) + 1)]
    norms = [layer.input_layernorm for layer in model.model.layers[1:]] + [model.model.norm]
    for i, norm in enumerate(norms, start=1):
        norm.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].clone()))
    return seen


def test_each_layer_runs_on_the_teacher_input_and_the_capture_sees_its_own_output():
    model = Decoder()
    seen = _own_outputs(model)
    teacher = NormTeacher.of(model)
    x = torch.tensor([[1.0], [2.0], [4.0]])  # three rows
    t = {1: torch.tensor([[10.0], [20.0]]), 2: torch.tensor([[100.0], [200.0]]), 3: torch.tensor([[0.5], [0.25]])}
    teacher.inputs = t  # two rows: the third (padding) keeps its own input
    y = model(x)
    # layer 0 on the embedding: out = 2x*3 + x = 7x; layer i on t[i]: out = 2 t k + t
    assert seen[1][0].flatten().tolist() == [7.0, 14.0, 28.0]
    assert seen[2][0].flatten()[:2].tolist() == [110.0, 220.0]          # 2*10*5 + 10, from t[1], not 7x
    assert seen[3][0].flatten()[:2].tolist() == [1500.0, 3000.0]        # 2*100*7 + 100, from t[2]
    assert y.flatten()[:2].tolist() == [1.0, 0.5]                       # the final norm of t[3]
    own = model.__class__()(x)  # the unforced model: the padding row is its own run's
    assert y[2] == own[2]
    teacher.inputs = None
    assert torch.equal(model(x), own)  # nothing forced: the model's own forward, hooks and all
    teacher.remove()


def test_layer_0_runs_on_the_teacher_embedding_and_the_capture_sees_the_engines_own():
    """A scaled embedding (Gemma 3's, its scale rounded to the dtype) differs from the golden's: layer 0 is forced too,
    or the embedding's rounding would reach layer 0's residual points as that layer's own error."""
    model = Decoder()
    embed = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: embed.append(a[1].clone()))  # capture: first
    seen = _own_outputs(model)
    teacher = NormTeacher.of(model)
    x = torch.tensor([[1.0], [2.0], [4.0]])
    teacher.inputs = {0: torch.tensor([[3.0], [5.0]])}  # two rows: the third (padding) keeps its own input
    model(x)
    assert embed[0].flatten().tolist() == [1.0, 2.0, 4.0]  # the engine's own embedding, captured as ``embed``
    assert seen[1][0].flatten().tolist() == [21.0, 35.0, 28.0]  # layer 0 on the teacher's: 7t; the padding's 7x
    teacher.inputs = {0: torch.zeros(4, 1)}
    with pytest.raises(RuntimeError, match=r"the input of layer 0 is \(4, 1\), the step's embedding \(3, 1\)"):
        model(x)
    teacher.remove()


def test_refusals_name_what_is_at_fault():
    model = Decoder()
    teacher = NormTeacher.of(model)
    teacher.inputs = {1: torch.zeros(5, 1)}
    with pytest.raises(RuntimeError, match=r"the input of layer 1 is \(5, 1\), the step's residual \(3, 1\)"):
        model(torch.ones(3, 1))
    plain = nn.Module()
    plain.model = nn.Module()
    plain.model.layers = nn.ModuleList([nn.Linear(1, 1)])
    plain.model.norm = nn.Identity()
    assert NormTeacher.of(plain) is None  # no fused input_layernorm: the local pass refused at its first step
