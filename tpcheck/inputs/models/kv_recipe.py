"""The KV-cache presets' recipe (``small-fp8-kv``, ``small-fp8-kv-head``): the float checkpoint's keys and values
scaled per KV head before it is quantized, so that the checkpoint's k / v scales differ as a trained model's do.

Why: e4m3 is a float format, so inside its normal range (``2^-6 s`` to ``448 s`` for a scale ``s``) the relative
rounding does not depend on the scale; a wrong scale only shows where values clamp above ``448 s`` or lose bits
below ``2^-6 s``. ``small-hd32`` as drawn has k and v of one range (its calibrated k and v scales within 2%, its two
heads' within 30%): a swapped or defaulted scale would change almost nothing there. With this recipe, KV head ``h``'s
rows of ``k_proj`` (weight and bias) are multiplied by ``K_GAINS[h]`` and of ``v_proj`` by ``V_GAINS[h]`` (exact in
float32 up to one rounding), which gives keys up to ~20 and values of ~0.003-0.05: a trained model's spread
(keys with large channels, small values), in a model that stays finite in every dtype."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

K_GAINS = (1.0, 1.0)
V_GAINS = (0.0002, 0.001)
PRESETS = ("small-fp8-kv", "small-fp8-kv-head")


def spread_kv(model_dir: Path) -> None:
    """Scale each KV head's k_proj / v_proj rows of the float checkpoint in ``model_dir`` (one
    ``model.safetensors``) by ``K_GAINS`` / ``V_GAINS``, in place."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_key_value_heads"]
    if heads != len(K_GAINS):
        raise ValueError(f"{model_dir}: the KV recipe has gains for {len(K_GAINS)} KV heads, the config has {heads}")
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in tensors.items():
        proj = next((p for p in ("k_proj", "v_proj") if f".self_attn.{p}." in name), None)
        if proj is None:
            continue
        gains = torch.tensor(K_GAINS if proj == "k_proj" else V_GAINS, dtype=torch.float32)
        rows = gains.repeat_interleave(t.shape[0] // heads)
        tensors[name] = (t.float() * (rows[:, None] if t.dim() == 2 else rows)).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
