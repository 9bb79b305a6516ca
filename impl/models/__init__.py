"""One model file per family over the shared decoder (``decoder.py``); ``model_class`` picks the class of a
config from the registry ``impl.config.FAMILIES``."""
from __future__ import annotations

from torch import nn

from impl.config import ModelConfig


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """impl's causal LM class for ``cfg.model_type`` (``FAMILIES[cfg.model_type].impl_model``)."""
    return cfg.family.model_class()
