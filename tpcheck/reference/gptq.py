"""The golden's weights of a 4-bit GPTQ checkpoint (``impl.quant_gptq``): each layer's ``qweight``, ``qzeros``,
``scales`` and ``g_idx`` become the float ``weight`` ``[out, in]`` they mean,

    weight[n, k] = scales[g_idx[k], n] * (q[k, n] - (stored_zero[g_idx[k], n] + 1))

dequantized in float64 (exact) and cast to the reference's dtype. W4A16 quantizes no activation: the golden is
Hugging Face's model on these weights, with nothing else changed."""
from __future__ import annotations

import torch

from impl.quant_gptq import dequantize

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def is_gptq(raw: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(".qweight") for name in raw)


def dequantized_state(raw: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``raw`` in ``dtype``, each GPTQ layer's four tensors replaced by its dequantized ``weight``."""
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        base, _, leaf = name.rpartition(".")
        if leaf in PARTS:
            if leaf == "qweight":
                missing = [p for p in PARTS if f"{base}.{p}" not in raw]
                if missing:
                    raise ValueError(f"{where}: GPTQ layer {base} has no {', '.join(missing)}")
                w = dequantize(*(raw[f"{base}.{p}"] for p in PARTS), dtype=torch.float64)
                state[f"{base}.weight"] = w.t().contiguous().to(dtype)
            continue
        state[name] = t.to(dtype)
    return state
