"""Static activation scales for a quantized checkpoint (``w8a8-fp8-static``): the float model run on calibration
prompts, each quantized linear's input observed.

``input_scale = float32(max |x| / 448)`` over every token of every calibration prompt (compressed-tensors'
``static_minmax`` observer: the running min / max of the whole calibration set, symmetric), one number per linear
(``...q_proj.input_scale`` ``[1]``). q/k/v share one input and so one scale, as gate/up do. The prompts are fixed:
4 of 32 token ids drawn from ``random.Random(0)`` over the vocabulary, so the same source gives the same scales.
The float model is Hugging Face's (``AutoModelForCausalLM``, no remote code), in float32, built in memory (a calibration needs the whole model; this is for
checkpoints that fit)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from impl.quant_fp8 import FP8_MAX

PROMPTS, TOKENS = 4, 32


def input_scales(src: str | os.PathLike, weights: list[str]) -> dict[str, torch.Tensor]:
    """``{"<linear>.input_scale": float32 [1]}`` for each quantized linear weight name in ``weights``
    (``model.layers.{i}.self_attn.q_proj.weight`` ...), from the float checkpoint ``src``."""
    # lazy: transformers (seconds to import) is needed by a static scheme's calibration only
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(Path(src))).float().eval()
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for w in weights:
        mod = model.get_submodule(w.removesuffix(".weight"))

        def observe(_m, args, name=w.removesuffix("weight") + "input_scale"):
            a = args[0].detach().abs().amax().to(torch.float64)
            absmax[name] = torch.maximum(absmax.get(name, a), a)
        hooks.append(mod.register_forward_pre_hook(observe))
    rng = random.Random(0)
    vocab = model.config.vocab_size
    try:
        with torch.no_grad():
            for _ in range(PROMPTS):
                model(torch.tensor([[rng.randrange(vocab) for _ in range(TOKENS)]]))
    finally:
        for h in hooks:
            h.remove()
    missing = [w for w in weights if w.removesuffix("weight") + "input_scale" not in absmax]
    if missing:
        raise ValueError(f"{src}: calibration never reached {missing[:4]}")
    out = {}
    for name, a in absmax.items():
        if not a > 0:
            raise ValueError(f"{src}: calibration input of {name.removesuffix('.input_scale')} is all zero")
        out[name] = (a / FP8_MAX).to(torch.float32).reshape(1)
    return out
