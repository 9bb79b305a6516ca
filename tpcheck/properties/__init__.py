"""Property-based testing, a front end: Hypothesis strategies that draw models, TP layouts and prompts
(``strategies``, ``moe_strategies``), the drawn example and how it runs itself through ``tpcheck.diff`` (``case``:
``Case``), and the Hypothesis profiles with their pytest plugin (``profiles``). It sits with the other front ends
(above the pipeline) because a drawn case runs the whole diff."""
