"""Inputs: synthetic checkpoints and presets (``checkpoints``, ``config_checkpoints``), hypothesis strategies
and profiles (``strategies``, ``property_runner``, ``hypothesis_profiles``), valid TP layouts (``tp_layout``) and
the fault catalog (``faults``)."""
