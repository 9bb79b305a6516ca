"""Engines under test: the adapter base class (``adapter``: ``EngineAdapter``, every capability with its default),
one package per engine, each holding its adapter, what runs in its ranks, its plugins and its faults (``impl``,
``hf_tp``, ``vllm``, ``dump``: a dump replayed; ``sglang_dump``: SGLang's dumper files), the registry that names
them (``registry``: ``tpcheck diff --engine``) and the pool that keeps them running (``pool``)."""
