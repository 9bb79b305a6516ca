"""impl, this project's TP engine, as an engine under test: the adapter the driver holds (``adapter``:
``ImplAdapter``, ``start``, ``generate_dumped``), the capture run inside each of its ranks (``ranks``: hooks from
``tpcheck.capture.maps.IMPL_MAP``, teacher forcing, the KV cache read back, ``--dump`` written by the ranks) and its
fault catalog (``faults``: ``tpcheck diff --inject``)."""
