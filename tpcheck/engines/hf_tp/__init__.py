"""Hugging Face transformers' own tensor parallelism (``tp_plan``) as an engine under test: the adapter the driver
holds (``adapter``: ``HFTPAdapter``, ``start``, ``check_layout``), the rank that runs in each process (``ranks``:
``HFTPRank``) and the torchrun entry point that dumps (``python -m tpcheck.engines.hf_tp``, ``__main__``)."""
