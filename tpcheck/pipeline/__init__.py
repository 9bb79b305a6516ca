"""The pipeline that runs the stages: ``diff`` (``tpcheck.diff``: an engine against the golden, point by point,
step by step) and ``check`` (logits only, over several tp sizes)."""
