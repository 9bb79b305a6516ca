"""A dump as an engine under test: a dump directory read back and replayed (``replay``: ``read_dump``, ``Dump``,
``DumpAdapter``; ``tpcheck compare``), a pipelined dump's stages replayed as one engine (``stages``), and
``tpcheck diff --dump`` for an engine whose ranks do not write their own (``dumping``: ``DumpingAdapter``). The
files themselves are written by ``tpcheck.capture.dump.DumpWriter``, in every engine's ranks."""
