"""The checkpoints tpcheck writes: synthetic ones of every family (``checkpoints``, its named ``presets``, the
recipes of their tensors: ``weight_recipe``, ``sink_recipe``, ``gemma_recipe``, ``kv_recipe``), quantized ones
(``quantize``, ``quantize_awq``, ``quantize_gptq``, ``calibrate``, ``quant_schemes``) and converted ones (a GGUF:
``gguf_checkpoint``; the public trained checkpoint: ``public_checkpoint``)."""
