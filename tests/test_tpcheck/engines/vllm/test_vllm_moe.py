"""vLLM's mixture-of-experts routes: the experts its router chose, captured as ``moe.topk_ids`` /
``moe.topk_weights`` (``tpcheck.engines.vllm.routes``) and followed by the golden, so a clean bfloat16 MoE run
passes with its near-tie flips counted; a rank that picks another expert fails at ``moe.topk_ids``.

The first two tests are pure (a stand-in of vLLM's sparse block, no vLLM); the others need vLLM and are skipped
without it (``.ci/vllm`` runs them in ``.venv-vllm``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpcheck.capture import install
from tpcheck.capture.maps import VLLM_MAP
from tpcheck.engines.vllm.routes import RouteProbe, attach_route_probes, raise_expert


class Router:
    """vLLM's CPU router, reduced: top-k of the logits (unsorted), softmax of the chosen ones (renormalised)."""

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        vals, ids = torch.topk(router_logits, k=2, dim=-1, sorted=False)
        return torch.softmax(vals.float(), dim=-1), ids.to(torch.int32)


class Runner(nn.Module):
    """vLLM's ``MoERunner``: the gate, then the router called by keyword (as ``moe_runner.py`` does), then the
    experts' weighted sum (here: each expert ``e`` scales the token by ``e + 1``)."""

    def __init__(self, gate):
        super().__init__()
        self.router, self._gate = Router(), [gate]

    def forward(self, hidden_states, router_logits):
        logits = self._gate[0](router_logits)
        w, ids = self.router.select_experts(hidden_states=hidden_states, router_logits=logits,
                                           topk_indices_dtype=None, input_ids=None)
        return hidden_states * (w * (ids + 1)).sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 8, bias=False)
        self.experts = Runner(self.gate)

    def forward(self, x):
        return self.experts(hidden_states=x, router_logits=x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    m.model.layers[0].mlp = nn.Sequential(nn.Linear(4, 4))  # a dense layer: no router, no probe
    m.model.layers[1].mlp = Block()
    return m


def test_the_probe_reports_the_router_own_choice_and_a_fault_changes_only_the_selection():
    m = _model()
    x = torch.randn(5, 4)
    want = m.model.layers[1].mlp(x)
    assert attach_route_probes(m) == [1] and attach_route_probes(m) == [1]  # idempotent: one probe, one wrapper
    mlp = m.model.layers[1].mlp
    assert isinstance(mlp.route_probe, RouteProbe) and mlp.experts.router.select_experts is mlp.route_probe
    cap = install(m, VLLM_MAP)
    assert torch.equal(mlp(x), want)  # the probe changes nothing
    pts = cap.step_done()
    logits = nn.functional.linear(x, mlp.gate.weight)  # not the module: its call would be captured too
    w, ids = Router().select_experts(x, logits)
    assert torch.equal(pts["layers.1.moe.topk_ids"][1], ids) and torch.equal(pts["layers.1.moe.topk_weights"][1], w)
    assert torch.equal(pts["layers.1.mlp.out"][1], want) and torch.equal(pts["layers.1.moe.router"][1], logits)
    # the seeded fault: every token picks expert 0; the router's logits (moe.router) are not touched
    h = mlp.route_probe.register_forward_pre_hook(raise_expert, prepend=True, with_kwargs=True)
    mlp(x)
    pts = cap.step_done()
    assert (pts["layers.1.moe.topk_ids"][1] == 0).any(dim=-1).all()
    assert not torch.equal(pts["layers.1.moe.topk_ids"][1], ids)
    assert torch.equal(pts["layers.1.moe.router"][1], logits)
    h.remove()


def test_a_taken_probe_name_is_refused_naming_the_layer():
    m = _model()
    m.model.layers[1].mlp.route_probe = nn.Identity()
    with pytest.raises(RuntimeError, match="layer 1's mlp already has an attribute route_probe"):
        attach_route_probes(m)


# ------------------------------------------------------------------ real vLLM

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 61, 13, 140, 77], [9, 250, 31, 64, 12, 180, 33]]


@pytest.fixture(scope="module")
def pool():
    """The engines of this module: vLLM sets what its CPU build needs where unset (``tpcheck.engines.vllm.adapter.vllm_env``)."""
    pytest.importorskip("vllm")
    from tpcheck.engines.pool import EnginePool
    p = EnginePool()
    yield p
    p.close()  # stops vLLM's workers


@pytest.fixture(scope="module")
def ties(tmp_path_factory):
    """tiny-moe-ties (Qwen3-MoE, head_dim 32, top-3 of 8, router rows in pairs 1% apart: many near ties)."""
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    return cached_checkpoint("tiny-moe-ties", root=tmp_path_factory.mktemp("vllm-moe"))


def _routes(result) -> tuple[int, int, set[str]]:
    t = result.table
    ids = t[t["point"].str.endswith("moe.topk_ids")]
    return int(ids["route_flips"].sum()), int(ids["near_ties"].sum()), set(ids["point"])


def test_vllm_moe_bfloat16_clean_follows_its_routes_and_a_wrong_route_fails_at_topk_ids(pool, ties):
    """One vLLM (tp 2, bfloat16): the clean run passes with every point of both sparse layers reported (the routes
    vLLM took, its block's output); every flip against the float64 golden is a near tie. Then the same engine with
    rank 1's selection seeing expert 0 raised: the run fails, its origin layers.1.moe.topk_ids."""
    import tpcheck
    from tpcheck.engines.vllm.adapter import start
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.pipeline.plan import RunPlan
    from tpcheck.result.meta import RunOrigin
    clean = tpcheck.diff(str(ties), tp=2, dtype="bfloat16", prompts=PROMPTS, decode_steps=2, engine="vllm", pool=pool)
    assert clean.passed, clean.summary()
    flips, near, points = _routes(clean)
    assert points == {"layers.0.moe.topk_ids", "layers.1.moe.topk_ids"}
    assert flips == near, (flips, near)  # a flip that is no near tie is a failed row; the run passed
    assert {"layers.1.moe.topk_weights", "layers.1.mlp.out"} <= set(clean.table["point"])
    opts = DiffOptions.of(model=str(ties), tp=2, dtype="bfloat16", prompts=PROMPTS, decode_steps=2)
    eng = start(pool, RunPlan.of(opts))  # the engine of the clean run, still loaded
    eng.faults = [("route-expert-raised", 1, 1)]
    try:
        bad = compare(eng, DiffOptions(model=str(ties), dtype="bfloat16", prompts=PROMPTS, decode_steps=2),
                      origin=RunOrigin(tp=2, engine="vllm", command="test_vllm_moe"))
    finally:
        eng.faults = []
    assert not bad.passed
    assert "origin: layers.1.moe.topk_ids (step 0" in bad.summary(), bad.summary()
    t = bad.table
    assert t[t["point"].str.startswith("layers.0.")]["passed"].all()  # layer 0 untouched
    print(clean.summary()[-600:], f"\nroute flips {flips} (near ties {near})\n", bad.summary()[-800:])
