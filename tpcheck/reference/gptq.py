"""The golden's weights of a 4-bit checkpoint, GPTQ (``impl.quant_gptq``) or AWQ (``impl.quant_awq``): each
layer's packed tensors become the float ``weight`` ``[out, in]`` they mean,

    GPTQ: weight[n, k] = scales[g_idx[k], n] * (q[k, n] - (stored_zero[g_idx[k], n] + 1))
    AWQ:  weight[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])

by tpcheck's own reading of the format (``tpcheck.reference.formats``, written from the format's specification,
not impl's code: a bug in impl's unpacking moves the engine, not the golden), in float64 (exact) and cast to the
reference's dtype. W4A16 quantizes no activation: the golden is Hugging Face's
model on these weights, with nothing else changed."""
from __future__ import annotations

import torch

from impl.quant_awq import AwqScheme
from impl.quant_gptq import GptqScheme
from tpcheck.reference.formats import awq_weight, gptq_weight

PARTS = ("qweight", "qzeros", "scales", "g_idx")  # GPTQ's; AWQ has no g_idx
AWQ_PARTS = ("qweight", "qzeros", "scales")


def is_gptq(raw: dict[str, torch.Tensor]) -> bool:
    """A 4-bit checkpoint (GPTQ or AWQ): packed ``qweight`` tensors."""
    return any(name.endswith(".qweight") for name in raw)


def dequantized_state(raw: dict[str, torch.Tensor], dtype: torch.dtype, where: str,
                      scheme: GptqScheme | AwqScheme | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``raw`` in ``dtype``, each 4-bit layer's packed tensors replaced by its dequantized
    ``weight``: AWQ's three when ``scheme`` is an ``AwqScheme``, else GPTQ's four."""
    parts, dequantize = (AWQ_PARTS, awq_weight) if isinstance(scheme, AwqScheme) else (PARTS, gptq_weight)
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        base, _, leaf = name.rpartition(".")
        if leaf in parts:
            if leaf == "qweight":
                missing = [p for p in parts if f"{base}.{p}" not in raw]
                if missing:
                    raise ValueError(f"{where}: {'AWQ' if parts is AWQ_PARTS else 'GPTQ'} layer {base} has no "
                                     f"{', '.join(missing)}")
                w = dequantize(*(raw[f"{base}.{p}"] for p in parts))
                state[f"{base}.weight"] = w.t().contiguous().to(dtype)
            continue
        state[name] = t.to(dtype)
    return state
