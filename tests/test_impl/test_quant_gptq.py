"""4-bit GPTQ linears (``impl.quant_gptq``) at simulated tp 1, 2, 4: packing round trips, the parallel layers'
loaders shard ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` (by output columns on column-parallel layers, by
input rows and groups on row-parallel ones, scales whole with act-order), ``apply`` against ``x @ W`` with ``W``
dequantized independently in float64; the parser's and the layers' refusals."""
from __future__ import annotations

import pytest
import torch

from fake_tp import build_ranks, combine, fake_rank
from impl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from impl.placements import Partial
from impl.quant import QuantConfigError
from impl.quant_gptq import (GptqScheme, layer_name, pack_cols, pack_rows, parse_quantization_config, unpack_cols,
                             unpack_rows)
from tpcheck.inputs.models.quantize_gptq import gptq_quantization_config, group_index, quantize_gptq_weight

TPS = (1, 2, 4)
DT = torch.float32


def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (64, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_rows(pack_rows(q)), q)
    assert torch.equal(unpack_cols(pack_cols(q)), q)
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 40)
    # nibble k % 8 of word k // 8: the value at row 9 is bits 4..7 of packed row 1
    assert int(packed[1, 3].item()) >> 4 & 0xF == int(q[9, 3])
    assert pack_cols(torch.full((2, 8), 7)).eq(0x77777777).all()  # v1 zeros of a symmetric checkpoint


def ref_weight(hf_w: torch.Tensor, gs: int, g: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """GPTQ tensors of an HF weight ``[out, in]`` and ``W [in, out]`` recomputed here from the packed tensors'
    definition (q - 8) * scale, in float64."""
    t = quantize_gptq_weight(hf_w, gs, g)
    q = torch.stack([(t["qweight"][k // 8].long() >> (4 * (k % 8))) & 0xF for k in range(hf_w.shape[1])])
    w = t["scales"].double()[g.long()] * (q - 8).double()
    return t, w


def rand_w(out: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def x_input(k: int) -> torch.Tensor:
    return torch.randn(5, k, generator=torch.Generator().manual_seed(7), dtype=DT)


def run(mods, x, tp, shard_input=False):
    outs = []
    for r, m in enumerate(mods):
        xr = x[:, r * x.shape[1] // tp:(r + 1) * x.shape[1] // tp] if shard_input else x
        with fake_rank(r, tp), torch.no_grad():
            outs.append(m(xr))
    return outs


def load(m, tensors: dict, sid=None):
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        p = getattr(m, name)
        p.weight_loader(p, tensors[name], sid)


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("tp", TPS)
def test_merged_and_qkv_columns(tp, act):
    scheme, hidden = GptqScheme(32, act), 64
    gate, up = (ref_weight(rand_w(64, hidden, s), 32, group_index(hidden, 32, act, "gate_up")) for s in (1, 2))
    mods = build_ranks(tp, lambda: MergedColumnParallelLinear(hidden, [64, 64], dtype=DT, quant=scheme))
    for m in mods:
        assert m.qweight.shape == (hidden // 8, 128 // tp) and m.qzeros.shape == (2, 128 // tp // 8)
        for sid, (t, _) in enumerate((gate, up)):
            load(m, t, sid)
    x = x_input(hidden)
    full = combine(run(mods, x, tp), mods[0].output_placement)
    torch.testing.assert_close(full.double(), x.double() @ torch.cat([gate[1], up[1]], 1), rtol=1e-5, atol=1e-5)
    d, heads, kv = 8, 8, 2
    parts = {s: ref_weight(rand_w(n * d, hidden, 10 + i), 32, group_index(hidden, 32, act, "qkv"))
             for i, (s, n) in enumerate((("q", heads), ("k", kv), ("v", kv)))}
    qkv = build_ranks(tp, lambda: QKVParallelLinear(hidden, d, heads, kv, bias=False, dtype=DT, quant=scheme))
    for m in qkv:
        for sid, (t, _) in parts.items():
            load(m, t, sid)
    full = combine(run(qkv, x, tp), qkv[0].output_placement)  # asserts KV replicas identical
    want = x.double() @ torch.cat([parts[s][1] for s in "qkv"], 1)
    torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_groups(tp, act):
    """Rows and g_idx by rank; scales / zeros by group (a rank's own tile), whole with act-order."""
    k, gs = 256, 32
    t, w = ref_weight(rand_w(48, k, 3), gs, group_index(k, gs, act, "down"))
    mods = build_ranks(tp, lambda: RowParallelLinear(k, 48, dtype=DT, quant=GptqScheme(gs, act)))
    for r, m in enumerate(mods):
        load(m, t)
        groups = k // gs if (act or tp == 1) else k // gs // tp
        assert m.scales.shape == (groups, 48)
        if not act:
            torch.testing.assert_close(m.scales, t["scales"][r * groups:(r + 1) * groups])
    x = x_input(k)
    full = combine(run(mods, x, tp, shard_input=True), Partial())
    torch.testing.assert_close(full.double(), x.double() @ w, rtol=1e-5, atol=1e-5)


def test_row_parallel_shard_not_whole_groups_refused():
    """o_proj of input 128 at tp 4: 32 rows a rank, not a whole number of 64-row groups (vLLM's rule)."""
    def build():
        with layer_name("model.layers.0.self_attn.o_proj"):
            return RowParallelLinear(128, 64, dtype=DT, quant=GptqScheme(64, False))
    with pytest.raises(QuantConfigError, match=r"model\.layers\.0\.self_attn\.o_proj: row-parallel shard of 32 "
                                               r"input rows .* group_size 64"):
        build_ranks(4, build)
    build_ranks(4, lambda: RowParallelLinear(128, 64, dtype=DT, quant=GptqScheme(64, True)))  # act-order: whole


def test_g_idx_must_be_trivial_without_act_order():
    t, _ = ref_weight(rand_w(32, 64, 4), 32, group_index(64, 32, True, "x"))
    m = build_ranks(1, lambda: RowParallelLinear(64, 32, dtype=DT, quant=GptqScheme(32, False)))[0]
    with fake_rank(0, 1), pytest.raises(Exception, match="g_idx is not k // group_size"):
        m.g_idx.weight_loader(m.g_idx, t["g_idx"])


def test_fused_partitions_must_share_g_idx():
    """q, k, v read one input: act-order permutations that disagree are refused, not the last one kept."""
    parts = [ref_weight(rand_w(16, 64, i), 32, group_index(64, 32, True, f"other{i}"))[0] for i in range(3)]
    m = build_ranks(1, lambda: QKVParallelLinear(64, 8, 2, 1, bias=False, dtype=DT, quant=GptqScheme(32, True)))[0]
    with fake_rank(0, 1):
        m.g_idx.weight_loader(m.g_idx, parts[0]["g_idx"], "q")
        with pytest.raises(Exception, match="g_idx of partition 'k' differs"):
            m.g_idx.weight_loader(m.g_idx, parts[1]["g_idx"], "k")


def test_parse_and_refusals():
    cfg = gptq_quantization_config("gptq-w4g64-actorder")
    assert parse_quantization_config(cfg) == GptqScheme(64, True)
    for key, value, match in (("bits", 8, "bits = 8"), ("sym", False, "sym = False"),
                              ("group_size", 48, "group_size = 48"), ("desc_act", None, "no 'desc_act'"),
                              ("checkpoint_format", "gptq_v2", "checkpoint_format = 'gptq_v2'"),
                              ("lm_head", True, "lm_head = True")):
        assert_refused(parse_quantization_config, cfg, key, value, match)


def assert_refused(parse, cfg: dict, key: str, value, match: str) -> None:
    """``parse`` of ``cfg`` with ``key`` set to ``value`` (None: removed) is a QuantConfigError matching ``match``."""
    bad = dict(cfg)
    if value is None:
        del bad[key]
    else:
        bad[key] = value
    with pytest.raises(QuantConfigError, match=match):
        parse(bad)
