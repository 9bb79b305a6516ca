"""Inputs: synthetic checkpoints and presets (``checkpoints``, ``config_checkpoints``), valid TP layouts
(``tp_layout``), prompts and the fault catalog (``faults``). The Hypothesis strategies that draw them, the drawn
``Case`` and its profiles are a front end (``tpcheck.properties``): a drawn case runs the whole diff."""
