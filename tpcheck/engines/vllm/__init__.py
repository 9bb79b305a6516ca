"""vLLM as an engine under test (installed apart: docs/vllm.md). The driver's side: ``adapter`` (``VLLMAdapter``,
``start``: ``tpcheck diff --engine vllm``) and ``pp`` (pipeline stages); what runs inside vLLM's worker processes:
``worker`` (the worker extension: capture, teacher forcing, the KV cache read back), ``stages`` (a pipeline stage's
layers and hand-offs), ``routes`` (MoE routing probes); its two ``vllm.general_plugins`` entry points, ``plugin``
(``TPCHECK_DUMP``: every worker dumps) and ``fault_plugin`` (``TPCHECK_DUMP_FAULT``); its faults (``faults``,
``quant_faults``) and ``int8`` (vLLM's int8 GEMM emulated).

Nothing is imported here: the plugins are loaded in every vLLM process."""
