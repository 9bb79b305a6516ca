"""The quantization faults seeded inside a vLLM rank (``tpcheck.engines.vllm.quant_faults``) on stand-ins of vLLM's
quantized linear layers (``weight_scale`` ``[N, 1]``, ``logical_widths``, ``tp_rank`` / ``tp_size``, ``prefix``):
which rows each changes, in place, and that the undo restores them; refusals name the layer. And the model of vLLM's
non-VNNI int8 GEMM (``tpcheck.engines.vllm.int8``) on hand-computed pairs. No vLLM needed (the runs on real vLLM
are in ``test_vllm_quant.py``)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import save_file

from tpcheck.engines.vllm import quant_faults as qf
from tpcheck.engines.vllm.int8 import exact_int8_gemm, pair_saturating_gemm, saturated_pairs


def _layer(widths, rank=1, tp=2, prefix="model.layers.0.self_attn.qkv_proj", scale=None):
    n = sum(widths)
    s = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1) if scale is None else scale
    return NS(weight_scale=torch.nn.Parameter(s, requires_grad=False), logical_widths=list(widths), tp_rank=rank,
              tp_size=tp, prefix=prefix)


def test_k_v_swap_and_gate_up_slot0_change_their_slots_in_place_and_undo():
    qkv = _layer([4, 2, 2])
    ptr, before = qkv.weight_scale.data_ptr(), qkv.weight_scale.detach().clone()
    undo = qf.qkv_scale_k_v_swapped(qkv, None)
    assert qkv.weight_scale.data_ptr() == ptr  # in place: oneDNN's handler keeps a pointer to the storage
    assert qkv.weight_scale.view(-1).tolist() == [1, 2, 3, 4, 7, 8, 5, 6]
    undo()
    assert torch.equal(qkv.weight_scale, before)
    gu = _layer([3, 3], prefix="model.layers.0.mlp.gate_up_proj")
    undo = qf.gate_up_scale_slot0(gu, None)
    assert gu.weight_scale.view(-1).tolist() == [1, 2, 3, 1, 2, 3]
    undo()
    assert gu.weight_scale.view(-1).tolist() == [1, 2, 3, 4, 5, 6]


def test_o_proj_scale_rolled_by_the_rank_block():
    o = _layer([8], prefix="model.layers.0.self_attn.o_proj")
    undo = qf.o_proj_scale_rolled(o, None)
    assert o.weight_scale.view(-1).tolist() == [5, 6, 7, 8, 1, 2, 3, 4]
    undo()
    assert o.weight_scale.view(-1).tolist() == list(range(1, 9))


def test_rank0_rows_read_from_the_checkpoint(tmp_path):
    """Rank 1's q/k/v scales become rows [0, w) of each projection's checkpoint scale (w: the rank's width)."""
    p = "model.layers.3.self_attn."
    full = {p + "q_proj.weight_scale": torch.arange(10., 18.).view(8, 1),
            p + "k_proj.weight_scale": torch.arange(20., 24.).view(4, 1),
            p + "v_proj.weight_scale": torch.arange(30., 34.).view(4, 1)}
    save_file(full, str(tmp_path / "model.safetensors"))
    worker = NS(model_runner=NS(model_config=NS(model=str(tmp_path))))
    qkv = _layer([4, 2, 2], prefix=p + "qkv_proj")
    undo = qf.qkv_scale_rank0_rows(qkv, worker)
    assert qkv.weight_scale.view(-1).tolist() == [10, 11, 12, 13, 20, 21, 30, 31]
    undo()
    assert qkv.weight_scale.view(-1).tolist() == list(range(1, 9))
    with pytest.raises(ValueError, match="on rank 0 changes nothing"):
        qf.qkv_scale_rank0_rows(_layer([4, 2, 2], rank=0, prefix=p + "qkv_proj"), worker)
    with pytest.raises(ValueError, match=r"lacks \['model.layers.0.self_attn.q_proj.weight_scale'"):
        qf.qkv_scale_rank0_rows(_layer([4, 2, 2]), worker)


def test_refusals_name_the_layer(tmp_path):
    per_tensor = _layer([8], prefix="model.layers.0.self_attn.o_proj", scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"o-proj-scale-rolled: model.layers.0.self_attn.o_proj has no per-channel "
                                         r"weight_scale \[N, 1\] float32 \(got \(\(1,\), torch.float32\)\)"):
        qf.o_proj_scale_rolled(per_tensor, None)
    p = "model.layers.0.self_attn."
    save_file({p + f"{s}_proj.weight_scale": torch.ones(1) for s in "qkv"}, str(tmp_path / "m.safetensors"))
    worker = NS(model_runner=NS(model_config=NS(model=str(tmp_path))))
    with pytest.raises(ValueError, match="q_proj.weight_scale is per tensor"):
        qf.qkv_scale_rank0_rows(_layer([4, 2, 2]), worker)


def test_pair_saturating_gemm_on_hand_computed_pairs():
    """x = (127, 127), w = (127, 127): (127 + 128) * 127 * 2 = 64770 saturates to 32767; minus the compensation
    128 * 254 = 32512 leaves 255 where the exact product is 32258. Within +-64 nothing saturates."""
    xq = torch.tensor([[127, 127, 0, 0]], dtype=torch.int8)
    w = torch.tensor([[127], [127], [0], [0]], dtype=torch.int8)
    assert pair_saturating_gemm(xq, w).item() == 255 and exact_int8_gemm(xq, w).item() == 32258
    assert saturated_pairs(xq, w) == 0.5
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=g)
    narrow = torch.randint(-64, 65, (64, 16), dtype=torch.int8, generator=g)
    assert torch.equal(pair_saturating_gemm(x, narrow), exact_int8_gemm(x, narrow)) and saturated_pairs(x, narrow) == 0
    with pytest.raises(ValueError, match="K must agree and be even"):
        pair_saturating_gemm(x[:, :63], narrow[:63])
