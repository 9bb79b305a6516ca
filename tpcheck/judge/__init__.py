"""Judge: the noise floor's bookkeeping (``noise_floor``), tolerances (``tolerances``), the verdict
(``verdict``: ``judge``), coverage (``coverage``)."""
from tpcheck.judge.verdict import judge

__all__ = ["judge"]
