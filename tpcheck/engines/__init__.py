"""Engines under test: the adapter protocol (``adapter``), one module per built-in engine (``impl``, ``hf_tp``),
the registry that names them (``registry``: ``tpcheck diff --engine``) and the pool that keeps them running
(``pool``)."""
