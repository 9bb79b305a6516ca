"""HF's causal LM built without ``from_pretrained``, as ``from_pretrained`` builds it: on the meta device under the
dtype (parameters created in it, no weight memory), the rotary buffers recomputed on the CPU (they are computed,
not loaded). The streamed golden (``tpcheck.reference.streamed``) then streams its weights; a quantized checkpoint's
references (``tpcheck.reference.quantized``) load dequantized ones."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from impl.config import HF_DTYPE_KEY


@contextmanager
def default_dtype(dtype: torch.dtype):
    """What ``from_pretrained`` does around the model's ``__init__``: parameters are created in ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def meta_model(model_dir: str | Path, dtype: torch.dtype, config, model_cls: type) -> nn.Module:
    """``model_cls(config)`` on the meta device in ``dtype``, its rotary embedding rebuilt on the CPU (transformers
    5's ``_init_weights`` calls the same rope function as ``__init__``, after the load)."""
    setattr(config, HF_DTYPE_KEY, dtype)  # as from_pretrained records it
    config._name_or_path = str(model_dir)
    with default_dtype(dtype), torch.device("meta"):
        model = model_cls(config)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config)
    return model
