"""Measure: unshard per-rank tensors by placement (``unshard``), statistics in float64 (``metrics``) and
bit-exact elementwise ops (``exact_ops``)."""
