"""The routing-aware verdict of mixture-of-experts layers (tpcheck.judge.routing, tpcheck.pipeline.routes): expert
sets compared per token, a differing set legitimate only on a near tie of the golden's own logits, the golden and
references following the engine's route, and flipped tokens left out of the local pass's routed points."""
from __future__ import annotations

import pytest
import torch

import tpcheck
from tpcheck.engines.impl.faults import FAULTS
from tpcheck.judge.routing import check_routes
from tpcheck.reference.forced_route import forced_route
from tpcheck.measure.unshard import unshard
from tpcheck.pipeline.routes import RouteBook, sort_routes, sort_unit_routes


def test_check_routes_tells_near_ties_from_bugs():
    logits = torch.tensor([[4.0, 3.0, 2.999, 0.0], [4.0, 3.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    golden = logits.topk(2).indices
    engine = torch.tensor([[0, 2], [0, 2], [3, 2]])  # token 0: a near tie, token 1: margin 2.0, token 2: equal
    rc = check_routes(engine, golden, logits, tau=0.01)
    assert rc.flipped == [0, 1] and rc.near_ties == 1 and rc.illegitimate == [1]
    assert rc.margins[0] == pytest.approx(0.001) and rc.margins[1] == pytest.approx(2.0)
    note = rc.note()
    assert note.startswith("routing: 1 of 2") and "row 1" in note and "engine [0, 2] vs golden [0, 1]" in note
    assert check_routes(engine, golden, logits, tau=3.0).note() == ""  # every flip within the margin


def test_forced_route_changes_only_rows_that_differ_and_reweights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    probs = torch.softmax(logits, -1)
    w, ids = probs.topk(2)
    want = torch.tensor([[1, 0], [2, 1]])  # row 0: the same set in another order; row 1: another set
    new_w, new_ids = forced_route(logits, ids, want, renormalize=True, weights_dtype=torch.float32)
    assert new_ids[0].tolist() == ids[0].tolist() and sorted(new_ids[1].tolist()) == [1, 2]
    assert torch.equal(new_w[0], w[0] / w[0].sum())
    assert new_w[1].sum().item() == pytest.approx(1.0)
    assert new_w[1].tolist() == pytest.approx((probs[1, new_ids[1]] / probs[1, new_ids[1]].sum()).tolist())
    assert forced_route(logits, ids, ids.flip(-1), True, torch.float32)[0] is None  # same sets: nothing forced


def test_sort_routes_orders_ids_and_permutes_weights():
    pts = {"layers.0.moe.topk_ids": torch.tensor([[5, 1, 3]]), "layers.0.moe.topk_weights": torch.tensor([[.5, .2, .3]]),
           "layers.0.out": torch.ones(1, 2)}
    out = sort_routes(pts)
    assert out["layers.0.moe.topk_ids"].tolist() == [[1, 3, 5]]
    assert out["layers.0.moe.topk_weights"].tolist() == [pytest.approx([.2, .3, .5])] and out["layers.0.out"] is pts["layers.0.out"]


def test_each_rank_s_route_is_put_in_its_own_order():
    """Ranks whose hidden states are ulps apart (a rank-ordered all-reduce) may order a near tie otherwise: the same
    experts, no finding, each replica's weights in ascending expert order by its own ids. A rank that chose another
    expert keeps the ranks' note."""
    from impl.placements import Replicate
    ids, w = "layers.0.moe.topk_ids", "layers.0.moe.topk_weights"
    rank0 = (torch.tensor([[5, 1], [2, 3]]), torch.tensor([[.50, .49], [.6, .4]]))
    swapped = (torch.tensor([[1, 5], [2, 3]]), torch.tensor([[.4901, .4999], [.6, .4]]))  # token 0 ordered otherwise
    other = (torch.tensor([[5, 7], [2, 3]]), torch.tensor([[.50, .49], [.6, .4]]))  # token 0: expert 7 for 1

    def units(r1):
        return {n: unshard(n, Replicate(), [a, b])[0] for n, a, b in ((ids, rank0[0], r1[0]), (w, rank0[1], r1[1]))}

    out = sort_unit_routes(units(swapped))
    assert out[ids].rank_mismatch == "" and out[ids].replicas == {} and out[ids].tensor.tolist() == [[1, 5], [2, 3]]
    assert out[w].tensor.tolist() == [pytest.approx([.49, .50]), pytest.approx([.6, .4])]
    assert out[w].replicas[1].tolist() == [pytest.approx([.4901, .4999]), pytest.approx([.6, .4])]  # its own order
    bad = sort_unit_routes(units(other))
    assert bad[ids].rank_mismatch.startswith("ranks 0 vs 1 route 1 of 2 tokens to different experts")
    assert bad[ids].replicas[1].tolist() == [[5, 7], [2, 3]]


def test_route_book_floor_and_exclusions():
    book = RouteBook()
    gold = {"layers.1.moe.router": torch.tensor([[2.0, 1.999, 0.0]]), "layers.1.moe.topk_ids": torch.tensor([[0]])}
    book.observe("layers.1.moe.router", gold["layers.1.moe.router"] + torch.tensor([[0.0, 0.004, 0.0]]),
                 gold["layers.1.moe.router"])
    assert book.tau(1) == pytest.approx(0.008, rel=1e-4)
    book.begin_step()
    rc = book.check(1, torch.tensor([[1]]), gold)
    assert rc.near_ties == 1 and rc.excluded == [0]
    assert book.excluded("layers.1.mlp.out", exclude=True) == [0] and book.excluded("layers.1.mlp.out", False) == []
    assert book.excluded("layers.1.attn.out", exclude=True) == []  # before the route: compared whole


def test_near_tie_routing_is_counted_and_passes(ckpt, engines):
    """tiny-moe-ties in bfloat16: tokens flip routes against the float64 golden, each a near tie, counted in the
    table; the propagated pass follows them (no exclusion), the local pass leaves them out of the routed points."""
    r = tpcheck.diff(model=str(ckpt("tiny-moe-ties")), tp=2, dtype="bfloat16", decode_steps=2, seq_len=32, pool=engines)
    assert r.passed, r.summary()
    ids = r.table[r.table["kind"] == "moe.topk_ids"]
    assert ids["route_flips"].sum() > 0 and (ids["route_flips"] == ids["near_ties"]).all()
    prop = r.table[r.table["mode"] == "propagated"]
    assert prop["rows_excluded"].isna().all()


def test_an_illegitimate_route_fails_at_topk_ids(ckpt, engines):
    d = str(ckpt("tiny-qwen3-moe"))
    llm = engines.get(d, 2, "float32")
    llm.call("worker_fns:moe_route_second_best", 1)
    try:
        r = tpcheck.diff(model=d, tp=2, dtype="float32", seq_len=12, pool=engines)
    finally:
        llm.reload()
    fd = r.first_divergence
    assert fd["point"] == "layers.1.moe.topk_ids" and fd["note"].startswith("routing: "), r.summary()
    assert "not near ties" in fd["note"]


@pytest.mark.parametrize("preset,tp,ep", [("tiny-qwen2-moe", 2, 2), ("tiny-mixtral", 4, 2), ("tiny-qwen3-moe", 4, 4)])
def test_moe_clean_under_tp_and_ep(preset, tp, ep, ckpt, engines):
    r = tpcheck.diff(model=str(ckpt(preset)), tp=tp, ep=ep, dtype="bfloat16", decode_steps=2, pool=engines)
    assert r.passed, r.summary()
    assert r.meta["ep"] == ep and (r.table["kind"] == "moe.experts").any()


MOE_FAULTS = [n for n, f in FAULTS.items() if f.patch.__module__ == "tpcheck.engines.impl.faults.moe"]


@pytest.mark.parametrize("name", MOE_FAULTS)
def test_moe_fault_found_at_its_origin(name, ckpt, engines):
    """Each MoE fault on its smallest configuration (tpcheck faults matrix) is found at its expected origin."""
    from tpcheck.cli import fault_matrix
    row = fault_matrix.fault_row(name, engines, ckpt)
    assert row["ok"] and row["by"] == "noise floor", row
