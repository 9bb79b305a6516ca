"""Hypothesis draws of pipeline parallelism (``impl.pipeline``) for ``tpcheck.properties.strategies.cases``: a stage
count the model's layers allow, drawn with the tp (and, for mixture-of-experts models, the ep) of the same case."""
from __future__ import annotations

from hypothesis import strategies as st

PP_SIZES = (1, 2, 4)


def pp_choices(config: dict, pps=PP_SIZES) -> list[int]:
    """The pipeline sizes of ``pps`` that split ``config``'s layers (every stage a layer: ``pp <= layers``)."""
    return [p for p in pps if p <= config["num_hidden_layers"]]


def draw_pp(draw, config: dict, pps=(1,)) -> int:
    """A pipeline size of ``pps`` for ``config`` (nothing drawn where only one fits, as ``draw_ep``); a ``pps``
    none of whose sizes fits is a ValueError naming the numbers."""
    choices = pp_choices(config, pps)
    if not choices:
        raise ValueError(f"pps {tuple(pps)}: none fits a model of num_hidden_layers={config['num_hidden_layers']}")
    return choices[0] if len(choices) == 1 else draw(st.sampled_from(choices))
