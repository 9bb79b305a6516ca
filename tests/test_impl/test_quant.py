"""INT8 W8A8 linears (``impl.quant``) at simulated tp 1, 2, 4: int8 weights and their scales sharded at load by
the layers' own loaders (per-channel scales follow the output rows on column-parallel layers and stay whole on
row-parallel ones; per-tensor scales fill their fused partition's slot), and ``apply`` against the formula
``y = s_x s_w (q_x W_q^T)`` computed independently in float64; the ``quantization_config`` parser's refusals."""
from __future__ import annotations

import copy

import pytest
import torch

from fake_tp import build_ranks, combine, fake_rank
from impl.config import ConfigError
from impl.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from impl.placements import Partial
from impl.quant import Int8Scheme, QuantConfigError, exact_int_matmul, parse_quant_config

TPS = (1, 2, 4)
STRATEGIES = ("channel", "tensor")
DT = torch.float32  # the activation dtype


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a float64 weight: ``(q int8, scale float32 [out, 1] or [1])``."""
    absmax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    s = (absmax / 127).float()
    q = torch.round(w / s.double().reshape(-1, 1) if strategy == "channel" else w / s.double()).clamp(-128, 127)
    return q.to(torch.int8), s


def expected(x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``s_x s_w (q_x q_w^T)`` in float64, per-token dynamic ``s_x`` from ``x`` (float32 as the kernel computes it)."""
    s_x = (x.float().abs().amax(-1, keepdim=True) / 127)
    q_x = torch.round(x.float() / s_x).clamp(-128, 127).double()
    outs = [(q_x @ q.double().t()) * s_x.double() * s.double().reshape(1, -1) for q, s in parts]
    return torch.cat(outs, -1)


def x_input(k: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(5, k, generator=torch.Generator().manual_seed(seed), dtype=DT)


def rand_w(out: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run(mods, x, tp, shard_input=False):
    outs = []
    for r, m in enumerate(mods):
        xr = x[:, r * x.shape[1] // tp:(r + 1) * x.shape[1] // tp] if shard_input else x
        with fake_rank(r, tp), torch.no_grad():
            outs.append(m(xr))
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tp", TPS)
def test_column_and_merged(tp, strategy):
    scheme = Int8Scheme(strategy, True)
    gate, up = (quantize(rand_w(32, 16, s), strategy) for s in (1, 2))
    mods = build_ranks(tp, lambda: MergedColumnParallelLinear(16, [32, 32], dtype=DT, quant=scheme))
    for m in mods:
        assert m.weight.dtype == torch.int8 and m.weight.shape == (64 // tp, 16)
        assert m.weight_scale.shape == ((64 // tp, 1) if strategy == "channel" else (2,))
        for sid, (q, s) in enumerate((gate, up)):
            m.weight.weight_loader(m.weight, q, sid)
            m.weight_scale.weight_loader(m.weight_scale, s, sid)
    x = x_input(16)
    full = combine(run(mods, x, tp), mods[0].output_placement)
    torch.testing.assert_close(full.double(), expected(x, [gate, up]), rtol=2e-6, atol=1e-6)
    col = build_ranks(tp, lambda: ColumnParallelLinear(16, 32, dtype=DT, quant=scheme))
    for m in col:
        m.weight.weight_loader(m.weight, gate[0])
        m.weight_scale.weight_loader(m.weight_scale, gate[1])
    full = combine(run(col, x, tp), col[0].output_placement)
    torch.testing.assert_close(full.double(), expected(x, [gate]), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 1)])
def test_qkv_scales_follow_heads(heads, kv, tp, strategy):
    """Per-channel: each KV head's scale rows go with it (replicated heads included); per-tensor: q, k, v slots."""
    d, hidden = 4, 16
    scheme = Int8Scheme(strategy, True)
    parts = {s: quantize(rand_w(n * d, hidden, 10 + i), strategy) for i, (s, n) in enumerate((("q", heads),
                                                                                               ("k", kv), ("v", kv)))}
    mods = build_ranks(tp, lambda: QKVParallelLinear(hidden, d, heads, kv, bias=False, dtype=DT, quant=scheme))
    for m in mods:
        for sid, (q, s) in parts.items():
            m.weight.weight_loader(m.weight, q, sid)
            m.weight_scale.weight_loader(m.weight_scale, s, sid)
        if strategy == "tensor":
            assert torch.equal(m.weight_scale, torch.cat([parts[s][1] for s in "qkv"]))
    x = x_input(hidden)
    full = combine(run(mods, x, tp), mods[0].output_placement)  # asserts KV replicas identical
    torch.testing.assert_close(full.double(), expected(x, [parts[s] for s in "qkv"]), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_scale_whole_on_every_rank(tp, strategy):
    """The output is not split: every rank holds the whole channel scale; each rank quantizes its own slice of the
    input (its own per-token scale, as vLLM's kernels do), so the sum is over the shards' formulas."""
    q, s = quantize(rand_w(16, 32, 3), strategy)
    scheme = Int8Scheme(strategy, True)
    mods = build_ranks(tp, lambda: RowParallelLinear(32, 16, dtype=DT, quant=scheme))
    for m in mods:
        m.weight.weight_loader(m.weight, q)
        m.weight_scale.weight_loader(m.weight_scale, s)
        assert torch.equal(m.weight_scale.reshape(-1), s.reshape(-1))
    x = x_input(32)
    full = combine(run(mods, x, tp, shard_input=True), Partial())
    k = 32 // tp
    want = sum(expected(x[:, r * k:(r + 1) * k], [(q[:, r * k:(r + 1) * k], s)]) for r in range(tp))
    torch.testing.assert_close(full.double(), want, rtol=2e-6, atol=1e-5)


CT = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                                "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                          "strategy": "token", "dynamic": True}}}}


def _with(path: str, value):
    raw = copy.deepcopy(CT)
    *keys, last = path.split(".")
    d = raw
    for k in keys:
        d = d[k]
    if value is None:
        del d[last]
    else:
        d[last] = value
    return raw


def test_parse_supported():
    assert parse_quant_config(None) is None
    s = parse_quant_config(CT)
    assert (s.weight_strategy, s.dynamic_input) == ("channel", True)
    static = _with("config_groups.group_0.input_activations.dynamic", False)
    static["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    assert parse_quant_config(static).dynamic_input is False


@pytest.mark.parametrize("path,value,match", [
    ("quant_method", "bitsandbytes", "quant_method = 'bitsandbytes'"),
    ("format", "nvfp4-pack-quantized", "format = 'nvfp4-pack-quantized'"),
    ("config_groups.group_0.weights.num_bits", 4, "num_bits = 4"),
    ("config_groups.group_0.weights.symmetric", False, "symmetric = False"),
    ("config_groups.group_0.weights.strategy", "group", "strategy = 'group'"),
    ("config_groups.group_0.input_activations", None, "no input_activations"),
    ("config_groups.group_0.input_activations.strategy", "tensor", "strategy = 'tensor'"),
    ("ignore", [], "lm_head"),
    ("kv_cache_scheme", {"num_bits": 8}, "kv_cache_scheme"),
    ("config_groups.group_0.weights.type", None, "no 'type'"),
])
def test_parse_refuses_with_the_field(path, value, match):
    with pytest.raises(QuantConfigError, match=match) as e:
        parse_quant_config(_with(path, value))
    assert isinstance(e.value, ConfigError)  # exit 2 in the CLI, like every config impl refuses


@pytest.mark.parametrize("k", [7, 1024, 2500])
def test_exact_int_matmul_is_the_integer_product(k):
    """The int8 GEMM's float32 chunks and float64 sum give the int64 product bit for bit, at the extremes too
    (-128 * -128 over a whole 1024-chunk sums to 2^24, float32's last exact integer step)."""
    g = torch.Generator().manual_seed(k)
    qx = torch.randint(-128, 128, (5, k), generator=g)
    w = torch.randint(-128, 128, (6, k), generator=g, dtype=torch.int64)
    qx[0], w[0] = -128, -128
    got = exact_int_matmul(qx.float(), w.to(torch.int8).float())
    assert got.dtype == torch.float64 and torch.equal(got, (qx @ w.t()).double())
