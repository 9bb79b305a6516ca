"""Inputs: the checkpoints tpcheck writes (``models``: synthetic presets, quantized and converted checkpoints),
what it keeps on disk and reads back untrusted (``files``: the step store, fingerprints, field checks), and the small
inputs every stage shares: valid TP layouts (``tp_layout``), prompts (``prompts``), devices (``devices``) and the
command line's argument types (``arg_types``). The Hypothesis strategies that draw inputs, the drawn ``Case`` and its
profiles are a front end (``tpcheck.properties``): a drawn case runs the whole diff."""
