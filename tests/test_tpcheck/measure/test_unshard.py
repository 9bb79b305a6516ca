"""Replicas judged against the noise floor, not bit identity: ``unshard`` measures how far the ranks that should
hold the same values differ (``rank_spread``, and which ranks), the judge holds that to the point's threshold,
and a failure says so first. Ranks holding other shapes (or other integer values) stay a structural finding."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.cli import gate
from tpcheck.cli.fault_matrix import flagged_by
from tpcheck.judge.verdict import judge
from tpcheck.measure.unshard import rank_spread, unshard
from tpcheck.result import documents
from tpcheck.result.report.sample import sample_result
from tpcheck.result.table import load_result

INF = math.inf


def _t(seed: int = 0, shape=(4, 64)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ulp(t: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, INF))


# ---------------------------------------------------------------------------------------------- unshard

def test_replicas_a_few_ulps_apart_are_measured_not_a_finding():
    t = _t()
    (u,) = unshard("layers.0.out", Replicate(), [t, t.clone(), _ulp(t)])
    assert u.rank_mismatch == "" and u.tensor is t
    assert 0 < u.rank_spread < 2 ** -23 and u.rank_spread_by == "0 vs 2"
    (same,) = unshard("layers.0.out", Replicate(), [t, t.clone()])
    assert (same.rank_spread, same.rank_spread_by, same.rank_mismatch) == (0.0, "", "")


def test_a_rank_holding_other_data_is_far_apart_and_named():
    t = _t()
    (u,) = unshard("layers.0.attn.out", Replicate(), [t, _ulp(t), t / 2])  # rank 2 kept half: a missed all-reduce
    assert u.rank_spread == pytest.approx(0.5) and u.rank_spread_by == "0 vs 2" and u.rank_mismatch == ""


def test_no_replicas_no_spread():
    t = _t()
    for placement, ranks in ((Replicate(), [t]), (Replicate(), [t, None]), (Partial(), [t, t]),
                             (Shard(-1), [t, _t(1)])):
        (u,) = unshard("embed", placement, ranks)
        assert math.isnan(u.rank_spread) and u.rank_spread_by == "" and u.rank_mismatch == "", placement


def test_kv_head_replicas_the_worst_group_and_its_ranks():
    a, b = _t(0, (4, 16)), _t(1, (4, 16))
    (u,) = unshard("layers.0.attn.k", Shard(-1, 2), [a, _ulp(a), b, b * 1.01])  # tp 4, each KV head on 2 ranks
    assert torch.equal(u.tensor, torch.cat([a, b], dim=-1))
    assert u.rank_spread == pytest.approx(0.01) and u.rank_spread_by == "2 vs 3" and u.rank_mismatch == ""
    assert u.columns == (((0, 1), 0, 16), ((2, 3), 16, 32))  # whose inputs computed which columns
    fused = Fused((("q", 16, Shard(-1)), ("k", 16, Shard(-1, 2))))
    parts = unshard("layers.0.attn.", fused, [torch.cat([x, a], -1) for x in (a, b)])
    assert [p.name for p in parts] == ["layers.0.attn.q", "layers.0.attn.k"]
    assert math.isnan(parts[0].rank_spread) and parts[1].rank_spread == 0.0
    assert parts[0].columns == (((0,), 0, 16), ((1,), 16, 32)) and parts[1].columns == ()  # one group: one rank's


def test_shapes_or_integer_values_that_differ_stay_structural():
    t = _t()
    (u,) = unshard("layers.0.out", Replicate(), [t, t[:, :32]])
    assert u.rank_mismatch == "ranks 0 vs 1 hold shapes 4 x 64 vs 4 x 32" and math.isnan(u.rank_spread)
    (u,) = unshard("layers.0.attn.k", Shard(-1, 2), [t, t, t, t[:2]])
    assert u.rank_mismatch == "ranks 2 vs 3 hold shapes 4 x 64 vs 2 x 64"
    ids = torch.tensor([[0, 3], [1, 2], [4, 5], [6, 7]])
    other = ids.clone()
    other[2, 1] = 6
    (u,) = unshard("layers.0.moe.topk_ids", Replicate(), [ids, other])  # no rounding changes an expert id
    assert u.rank_mismatch == "ranks 0 vs 1 hold different values (1 of 8 elements)"
    (u,) = unshard("layers.0.moe.topk_ids", Replicate(), [ids, ids.clone()])
    assert u.rank_mismatch == "" and u.rank_spread == 0.0


def test_non_finite_values_agree_only_where_both_ranks_hold_them():
    t = _t()
    n = t.clone()
    n[1, 3] = math.nan
    assert rank_spread(t, n) == INF and rank_spread(n, t) == INF  # a NaN on one rank only
    n2 = _ulp(n)
    assert 0 < rank_spread(n, n2) < 2 ** -23  # the same NaN on both: the finite rest is compared
    i = t.clone()
    i[0, 0] = INF
    j = i.clone()
    j[0, 0] = -INF
    assert rank_spread(i, j) == INF and rank_spread(i, i.clone()) == 0.0
    z = torch.zeros(3)
    assert rank_spread(z, z.clone()) == 0.0 and rank_spread(z, z + 1e-30) == INF


# ---------------------------------------------------------------------------------------------- the verdict

POINT = "layers.1.attn.out"


def _spread(times: float, by: str = "0 vs 2"):
    """A clean sample result whose ``POINT`` at step 0 has replicas ``times`` its threshold apart, judged."""
    r = judge(sample_result(2, 0, isolate=False))
    i = r.table.index[r.table["point"] == POINT][0]
    thr = float(r.table.loc[i, "threshold"])
    r.table.loc[i, ["rank_spread", "rank_spread_by"]] = [times * thr, by]
    return judge(r), i


def test_replicas_within_the_threshold_pass_and_are_reported():
    r, i = _spread(0.5)
    assert r.passed and r.table.loc[i, "excess"] >= 0.5 and r.table.loc[i, "rank_spread_by"] == "0 vs 2"
    assert r.first_divergence is None


@pytest.mark.parametrize("times", [130.0, INF])
def test_replicas_beyond_the_threshold_fail_with_the_ranks_named_first(times):
    r, i = _spread(times)
    assert not r.passed and r.table.loc[i, "excess"] == pytest.approx(times)
    fd = r.first_divergence
    assert (fd["point"], fd["step"], fd["rank_spread_by"]) == (POINT, 0, "0 vs 2")
    where, why, nxt = _origin(r)
    far = "infinitely over its threshold" if times == INF else f"{times:.3g}x its threshold"
    assert where.startswith(f"origin: {POINT} (step 0): {far}") and where.count("x its") <= 1
    assert why.startswith("  why: ranks disagree: ranks 0 vs 2 differ by ") and "; rel_err " in why
    assert nxt.startswith("  next: check the o_proj all-reduce (each rank's partial added once: not skipped, ")
    assert flagged_by(fd) == "ranks disagree"
    code, msg, _ = gate.gate_result(r)
    assert code == 1 and f"{POINT} (layer 1, step 0, propagated)" in msg
    assert msg.split(": ", 2)[2].startswith("ranks 0 vs 2 disagree by "), msg


def _origin(r) -> list[str]:
    """The origin's three lines of ``r``'s summary: where and how far, why, what to check next (each of at most
    120 characters, a longer one wrapped: joined again here)."""
    lines = r.summary(brief=True).splitlines()[1:]
    assert all(len(line) <= 120 for line in lines), lines
    return "\n".join(lines).replace("\n    ", " ").splitlines()


def test_a_structural_note_leads_the_origin_line():
    r = judge(sample_result(2, 0, isolate=False))
    i = r.table.index[r.table["point"] == POINT][0]
    r.table.loc[i, "note"] = "ranks 0 vs 1 hold shapes 2 x 8 vs 2 x 4"
    where, why, nxt = _origin(judge(r))
    assert where == f"origin: {POINT} (step 0): shapes differ"  # a note fails the row whatever its error: no ratio
    assert why == "  why: ranks 0 vs 1 hold shapes 2 x 8 vs 2 x 4"
    assert nxt.startswith("  next: check the shard shapes: the dim split, heads per rank")


def test_an_ordinary_failure_keeps_its_wording():
    r = sample_result(2, 0, isolate=False, fail_at=POINT)
    where, why, nxt = _origin(r)
    assert where.startswith(f"origin: {POINT} (step 0): {r.first_divergence['excess']:.3g}x its threshold, largest ")
    assert why.startswith("  why: above the noise floor: rel_err ") and "disagree" not in why
    assert nxt.startswith("  next: check o_proj's weight shards (split along in_features)")


# ---------------------------------------------------------------------------------------------- saved results

def test_a_saved_result_round_trips_rank_spread_and_gates_the_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: default tolerances
    r, i = _spread(130.0)
    j = r.table.index[(r.table["point"] == "layers.0.out")][0]
    r.table.loc[j, ["rank_spread", "rank_spread_by"]] = [1e-8, "0 vs 1"]  # within: passes
    path = tmp_path / "r.json"
    r.to_json(path)
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == documents.SCHEMA_VERSION == 3
    assert doc["first_divergence"]["rank_spread_by"] == "0 vs 2"
    assert sum(row["rank_spread"] is not None for row in doc["rows"]) == 2
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(documents.load_schema()).validate(doc)
    back = load_result(path)
    assert back.table["rank_spread_by"].tolist() == r.table["rank_spread_by"].tolist()
    assert back.table["passed"].tolist() == r.table["passed"].tolist()
    assert np.array_equal(back.table["rank_spread"].to_numpy(float), r.table["rank_spread"].to_numpy(float),
                          equal_nan=True)  # full precision
    (code, msg, _), (code2, msg2) = gate.gate_result(r, name=str(path)), gate.regate(path)
    assert code == code2 == 1 and msg == msg2


def test_a_version_1_result_still_reads_and_fails_for_its_rank_note(tmp_path, monkeypatch):
    """Before rank_spread, replicas that were not bit-identical were a note; such a file still fails by it."""
    monkeypatch.chdir(tmp_path)
    doc = judge(sample_result(2, 0, isolate=False)).to_document()
    doc["schema_version"] = 1
    for row in doc["rows"]:
        del row["rank_spread"], row["rank_spread_by"]
        if row["point"] == POINT:
            row.update(passed=False, note="ranks 0 vs 1 differ by up to 2.38e-07")
    path = tmp_path / "v1.json"
    path.write_text(documents.dumps(doc))
    back = load_result(path)
    assert back.table["rank_spread"].isna().all() and (back.table["rank_spread_by"] == "").all()
    code, msg = gate.regate(path)
    assert code == 1 and "ranks 0 vs 1 differ by up to 2.38e-07" in msg


# ---------------------------------------------------------------------------------------------- each replica judged

def test_replicas_that_differ_are_kept_to_be_judged():
    t = _t()
    (u,) = unshard("layers.0.out", Replicate(), [t, t.clone(), _ulp(t)])
    assert list(u.replicas) == [2] and torch.equal(u.replicas[2], _ulp(t))
    (same,) = unshard("layers.0.out", Replicate(), [t, t.clone()])
    assert same.replicas == {}
    a, b = _t(0, (4, 16)), _t(1, (4, 16))
    (k,) = unshard("layers.0.attn.k", Shard(-1, 2), [a, a.clone(), b, b * 1.01])  # group 1's second rank differs
    assert list(k.replicas) == [3] and torch.equal(k.replicas[3], torch.cat([a, b * 1.01], dim=-1))
    (s,) = unshard("layers.0.out", Replicate(), [t, t[:, :32]])  # structural: nothing to judge numerically
    assert s.replicas == {}


def _replica(spread_times: float, rep_times: float, own_times: float = math.nan, rel_times: float | None = None):
    """A clean judged sample result whose ``POINT`` at step 0 has replicas ``spread_times`` its threshold apart, the
    other replica erring ``rep_times`` it (its own_err ``own_times``; the first one ``rel_times``)."""
    r = judge(sample_result(2, 0, isolate=False))
    i = r.table.index[r.table["point"] == POINT][0]
    thr = float(r.table.loc[i, "threshold"])
    r.table.loc[i, ["rank_spread", "rank_spread_by", "replica_rel_err", "replica_own_err"]] = \
        [spread_times * thr, "0 vs 2", rep_times * thr, own_times * thr]
    if rel_times is not None:
        r.table.loc[i, ["rel_err", "own_err"]] = [rel_times * thr, own_times * thr]
    return judge(r), i


def test_replicas_apart_beyond_the_threshold_pass_when_each_is_within_it():
    r, i = _replica(1.02, 0.9)  # vLLM tp 3: each rank adds the partials in its own order
    assert r.passed and r.table.loc[i, "excess"] == pytest.approx(0.9)
    assert r.table.loc[i, "rank_spread"] > r.table.loc[i, "threshold"]  # reported, a figure


def test_a_replica_beyond_the_threshold_fails_with_the_ranks_named_first():
    r, i = _replica(0.5, 3.0)  # the first replica passes, another rank's errs 3x
    assert not r.passed and r.table.loc[i, "excess"] == pytest.approx(3.0)
    fd = r.first_divergence
    assert fd["replica_rel_err"] == pytest.approx(3.0 * fd["threshold"])
    where, why, _ = _origin(r)
    assert where.startswith(f"origin: {POINT} (step 0): 3x its threshold"), where
    assert why.startswith("  why: ranks disagree: ranks 0 vs 2 differ by ") and "(another replica's " in why, why
    assert flagged_by(fd) == "ranks disagree"
    code, msg, _ = gate.gate_result(r)
    assert code == 1 and msg.split(": ", 2)[2].startswith("ranks 0 vs 2 disagree by "), msg


def test_a_replica_is_inherited_as_the_first_one_is():
    # both replicas beyond the threshold through their inputs, each one's own op within it: inherited
    r, i = _replica(1.02, 28.0, own_times=0.01, rel_times=27.0)
    assert r.passed and bool(r.table.loc[i, "inherited"])
    # the other replica's own op beyond it: not inherited, and the spread within it: the error is the cause
    r, i = _replica(0.5, 28.0, own_times=2.0, rel_times=27.0)
    assert not r.passed and not bool(r.table.loc[i, "inherited"])
    origin = "\n".join(_origin(r))
    assert "disagree" not in origin and flagged_by(r.first_divergence) == "noise floor"


def test_an_other_replica_with_a_nan_never_passes():
    r, i = _replica(INF, INF)
    assert not r.passed and flagged_by(r.first_divergence) == "ranks disagree"


def test_a_version_2_result_still_judges_its_spread(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r, i = _spread(3.0)
    path = tmp_path / "r.json"
    r.to_json(path)
    doc = json.loads(path.read_text())
    doc["schema_version"] = 2
    for row in doc["rows"]:
        row.pop("replica_rel_err"), row.pop("replica_own_err")
    doc["first_divergence"].pop("replica_rel_err")
    path.write_text(json.dumps(doc))
    back = load_result(path)
    assert not back.passed and back.first_divergence["point"] == POINT
    assert flagged_by(back.first_divergence) == "ranks disagree"


def test_the_summary_says_where_replicas_differ():
    r, i = _replica(1.02, 0.9)
    line = r.summary().splitlines()[-1]
    assert line.startswith("replicas: the ranks' replicas differ at 1 of ") and f"{POINT} (step 0), ranks 0 vs 2" in line
    assert "1.02x its threshold" in line
    assert "replicas:" not in judge(sample_result(2, 0, isolate=False)).summary()  # none differ: no line


def test_a_worse_other_replica_is_told_beside_the_first_ones_error():
    r, i = _replica(0.5, 3.0, rel_times=2.0)  # both fail, the spread within: the error is the cause
    where, why, _ = _origin(r)
    assert ": 3x its threshold" in where and why.startswith("  why: above the noise floor: rel_err ")
    assert "disagree" not in why and "(another replica's " in why, why
