"""4-bit AWQ linears (``impl.quant_awq``) at simulated tp 1, 2, 4: AWQ's interleaved nibble order against literal
words, the parallel layers' loaders shard ``qweight`` / ``qzeros`` / ``scales`` (packed output columns on
column-parallel and fused layers, input rows and whole groups on row-parallel ones), ``apply`` against ``x @ W``
with ``W`` dequantized here from the words' definition in float64; the parser's and the layers' refusals."""
from __future__ import annotations

import pytest
import torch

from fake_tp import build_ranks, combine, fake_rank
from impl.errors import ShapeMismatch
from impl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from impl.placements import Partial
from impl.quant import QuantConfigError
from impl.quant_awq import AwqScheme, pack_awq, parse_quantization_config, unpack_awq
from impl.quant_gptq import layer_name
from test_quant_gptq import DT, TPS, assert_refused, rand_w, run, x_input  # the GPTQ tests' inputs and helpers
from tpcheck.inputs.models.quantize_awq import awq_quantization_config, quantize_awq_weight

REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # vLLM's _REVERSE_AWQ_PACK_ORDER: output column j of 8 is nibble REVERSE[j]


def test_awq_nibble_order_against_literal_words():
    # columns 0..7 hold 0..7: AutoAWQ writes nibble i from column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert pack_awq(torch.arange(8).reshape(1, 8)).tolist() == [[0x75316420]]
    assert pack_awq(torch.tensor([[15, 0, 0, 0, 0, 0, 0, 9]])).tolist() == [[0x9000000F - 2 ** 32]]  # int32 bits
    q = torch.randint(0, 16, (6, 40), generator=torch.Generator().manual_seed(0))
    packed = pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, 5)
    assert torch.equal(unpack_awq(packed), q)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    by_rule = torch.stack([(words[:, n // 8] >> (4 * REVERSE[n % 8])) & 0xF for n in range(40)], 1)
    assert torch.equal(by_rule, q)


def ref_weight(hf_w: torch.Tensor, gs: int) -> tuple[dict, torch.Tensor]:
    """AWQ tensors of an HF weight ``[out, in]`` and ``W [in, out]`` recomputed from the words by vLLM's rule,
    ``(q - zero) * scale``, in float64."""
    t = quantize_awq_weight(hf_w, gs)
    k, n = hf_w.shape[1], hf_w.shape[0]

    def unpack(words):
        words = words.to(torch.int64) & 0xFFFFFFFF
        return torch.stack([(words[:, c // 8] >> (4 * REVERSE[c % 8])) & 0xF for c in range(n)], 1)
    g = torch.arange(k) // gs
    w = t["scales"].double()[g] * (unpack(t["qweight"]) - unpack(t["qzeros"])[g]).double()
    return t, w


def test_quantizer_rounds_to_nearest_with_zero_points():
    hf_w = rand_w(48, 128, 5) + 0.3  # off-centre groups: the zero points are not all 8
    t, w = ref_weight(hf_w, 32)
    step = t["scales"].double()[torch.arange(128) // 32]
    assert ((w - hf_w.t()).abs() <= step * 0.51).all()  # half a step (the float16 scale's rounding aside)
    assert unpack_awq(t["qzeros"]).unique().numel() > 1


def load(m, tensors: dict, sid=None):
    for name in ("qweight", "qzeros", "scales"):
        p = getattr(m, name)
        p.weight_loader(p, tensors[name], sid)


@pytest.mark.parametrize("tp", TPS)
def test_merged_and_qkv_columns(tp):
    scheme, hidden = AwqScheme(32), 64
    gate, up = (ref_weight(rand_w(64, hidden, s), 32) for s in (1, 2))
    mods = build_ranks(tp, lambda: MergedColumnParallelLinear(hidden, [64, 64], dtype=DT, quant=scheme))
    for m in mods:
        assert m.qweight.shape == (hidden, 128 // tp // 8) and m.scales.shape == (2, 128 // tp)
        for sid, (t, _) in enumerate((gate, up)):
            load(m, t, sid)
    x = x_input(hidden)
    full = combine(run(mods, x, tp), mods[0].output_placement)
    torch.testing.assert_close(full.double(), x.double() @ torch.cat([gate[1], up[1]], 1), rtol=1e-5, atol=1e-5)
    d, heads, kv = 8, 8, 2  # tp 4: the KV heads replicated, each replica's packed columns with it
    parts = {s: ref_weight(rand_w(n * d, hidden, 10 + i), 32) for i, (s, n) in enumerate((("q", heads), ("k", kv),
                                                                                          ("v", kv)))}
    qkv = build_ranks(tp, lambda: QKVParallelLinear(hidden, d, heads, kv, bias=False, dtype=DT, quant=scheme))
    for m in qkv:
        for sid, (t, _) in parts.items():
            load(m, t, sid)
    full = combine(run(qkv, x, tp), qkv[0].output_placement)  # asserts KV replicas identical
    torch.testing.assert_close(full.double(), x.double() @ torch.cat([parts[s][1] for s in "qkv"], 1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_whole_groups(tp):
    k, gs = 256, 32
    t, w = ref_weight(rand_w(48, k, 3), gs)
    mods = build_ranks(tp, lambda: RowParallelLinear(k, 48, dtype=DT, quant=AwqScheme(gs)))
    groups = k // gs // tp
    for r, m in enumerate(mods):
        load(m, t)
        assert m.qweight.shape == (k // tp, 6) and m.scales.shape == (groups, 48)
        torch.testing.assert_close(m.qzeros, t["qzeros"][r * groups:(r + 1) * groups])
    full = combine(run(mods, x_input(k), tp, shard_input=True), Partial())
    torch.testing.assert_close(full.double(), x_input(k).double() @ w, rtol=1e-5, atol=1e-5)


def test_row_shard_straddling_a_group_refused():
    """o_proj of input 128 at tp 4: 32 rows a rank, not a whole number of 64-row groups (vLLM's rule)."""
    def build():
        with layer_name("model.layers.0.self_attn.o_proj"):
            return RowParallelLinear(128, 64, dtype=DT, quant=AwqScheme(64))
    with pytest.raises(QuantConfigError, match=r"model\.layers\.0\.self_attn\.o_proj: row-parallel shard of 32 "
                                               r"input rows .* group_size 64"):
        build_ranks(4, build)


def test_wrong_qweight_shape_refused():
    t, _ = ref_weight(rand_w(32, 64, 4), 32)
    m = build_ranks(1, lambda: RowParallelLinear(64, 32, dtype=DT, quant=AwqScheme(32)))[0]
    with fake_rank(0, 1), pytest.raises(ShapeMismatch, match=r"\[32, 4\] != expected \[64, 4\]"):
        m.qweight.weight_loader(m.qweight, t["qweight"][:32])  # GPTQ's [K/8, ...] rows count, say


def test_parse_and_refusals():
    cfg = awq_quantization_config("awq-w4g64")
    assert parse_quantization_config(cfg) == AwqScheme(64)
    assert parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
                                      "version": "GEMM"}) == AwqScheme(128)  # AutoAWQ's own key names
    for key, value, match in (("bits", 8, "bits = 8"), ("group_size", 48, "group_size = 48"),
                              ("zero_point", False, "zero_point = False: impl runs AWQ with zero points only"),
                              ("zero_point", None, "no 'zero_point'"), ("version", "gemv", "version = 'gemv'"),
                              ("modules_to_not_convert", ["mlp"], "modules_to_not_convert")):
        assert_refused(parse_quantization_config, cfg, key, value, match)
