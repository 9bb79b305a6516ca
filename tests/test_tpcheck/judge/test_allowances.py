"""The per-point account of a pass (``meta["allowances"]``, the summary's ``allowances:`` line): which rows an
allowance beyond the references' noise floor alone carried, so a user can judge a pass as well as a fail."""
from __future__ import annotations

import math

from tpcheck.judge import judge
from tpcheck.result.table import DiffResult, Row


def _row(point, rel, ref=1e-6, **kw):
    layer = int(point.split(".")[1])
    return Row(point=point, layer=layer, step=0, mode="isolated", kind=point.split(".", 2)[-1], rel_err=rel,
               ref_rel_err=ref, **kw)


def test_each_allowance_counts_the_rows_it_alone_carried():
    rows = [
        _row("layers.0.input_norm", 1e-6),                                       # within the references' floor
        _row("layers.0.attn.q", 3e-6, rel_floor=2e-6),                           # over c * ref, under it + rel_floor
        _row("layers.0.attn.k", 1e-6, gain=1e-3, gain_se=1e-5, gain_n=100.0, gain_floor=2e-3),  # by the gain floor
        _row("layers.0.mlp.act", 1e-6),
        _row("layers.0.mlp.out", 1e-3, own_err=1e-7),                            # inherited
    ]
    r = judge(DiffResult.from_rows(rows, {"dtype": "float32", "tp": 1, "num_layers": 1}))
    assert r.passed, r.table[["point", "passed", "excess"]]
    assert r.meta["allowances"] == {"inherited": 1, "rel_floor": 1, "gain_floor": 1, "by_rounding": 0}
    line = r.summary().split("allowances: ")[1].split("\n")[0]
    assert line.startswith("passed only by an allowance: 1 as inherited") and "1 by the ulp floor" in line \
        and "1 by the gain floor" in line, line
    bare = judge(DiffResult.from_rows(rows[:1] + rows[3:4], {"dtype": "float32", "tp": 1, "num_layers": 1}))
    assert bare.meta["allowances"] == dict.fromkeys(("inherited", "rel_floor", "gain_floor", "by_rounding"), 0)
    assert "allowances:" not in bare.summary()
    assert not math.isnan(r.table["excess"].max())


def test_a_gain_the_op_did_not_add_is_its_inputs():
    """A norm after an MLP whose output carries a scale within its own (wider) bound: the norm's gain is over its
    bound, but against the norm recomputed on the engine's own input it is ~0 (``own_gain``): inherited. The same
    gain added by the op itself (``own_gain`` the gain) still fails there."""
    def rows(own_gain):
        return [_row("layers.0.attn.post_norm", 1e-6),  # a Gemma 3 layer: its MLP output is normalised
                _row("layers.0.mlp.out", 1e-6, gain=-5e-3, gain_se=1e-4, gain_n=300.0, gain_floor=2e-2),
                _row("layers.0.mlp.post_norm", 1e-6, gain=-5e-3, gain_se=1e-4, gain_n=300.0, gain_floor=2e-3,
                     own_err=0.0, own_gain=own_gain)]
    meta = {"dtype": "bfloat16", "tp": 2, "num_layers": 1}
    t = judge(DiffResult.from_rows(rows(1e-5), meta)).table.set_index("point")
    assert t.loc["layers.0.mlp.post_norm", "inherited"] and t.loc["layers.0.mlp.post_norm", "passed"]
    assert t.loc["layers.0.mlp.post_norm", "excess"] < 0.1  # its own gain's figure
    t = judge(DiffResult.from_rows(rows(-5e-3), meta)).table.set_index("point")
    assert not t.loc["layers.0.mlp.post_norm", "passed"] and t.loc["layers.0.mlp.post_norm", "excess"] > 2


def test_the_ulp_floor_adds_to_the_references_term():
    """``rel_floor`` (one ulp of the element that holds the norm) is added to ``k * ref_rel_err + floor``, not joined
    in quadrature: where a trained model's massive activation holds the norm, the references' own error sits at that
    same element (in the propagated pass, what it inherited), so the two bounds are of one number and add. Measured:
    Gemma 3 270M, impl tp 4 bfloat16, ``<bos>`` alone, ``layers.7.mlp.act`` (99.7% of the norm in one element):
    rel_err 0.00966, ``3 * 0.00149 + 0.001`` and ``rel_floor`` 0.00779 give 0.73x by the sum, 1.015x in quadrature."""
    row = _row("layers.7.mlp.act", 0.00966, ref=0.00149, rel_floor=0.00779)
    t = judge(DiffResult.from_rows([row], {"dtype": "bfloat16", "tp": 4, "num_layers": 8})).table
    assert t["passed"].iat[0] and math.isclose(t["threshold"].iat[0], 3 * 0.00149 + 0.001 + 0.00779)
