"""The quantization schemes ``tpcheck make-checkpoint --quantize`` writes: each name and what it writes, for the
command line's choices and ``--help``. They live apart from the quantizers (``tpcheck.inputs.models.quantize``: INT8 / FP8
W8A8 and FP8 KV caches; ``quantize_gptq``; ``quantize_awq``), which import torch, so that building the parser
does not."""
from __future__ import annotations

#: scheme name -> what it writes (``tpcheck.inputs.models.quantize``)
SCHEMES: dict[str, str] = {
    "w8a8-int8": "int8 weights with a per-output-channel float32 scale [out, 1]; activations int8, dynamic per token",
    "w8a8-int8-tensor": "int8 weights with one float32 scale per tensor [1]; activations int8, dynamic per token",
    "w8a8-fp8": "float8_e4m3fn weights with a per-output-channel float32 scale [out, 1]; activations float8_e4m3fn, "
                "dynamic per token (compressed-tensors' FP8_DYNAMIC)",
    "w8a8-fp8-tensor": "float8_e4m3fn weights with one float32 scale per tensor [1]; activations float8_e4m3fn, "
                       "dynamic per token",
    "w8a8-fp8-static": "float8_e4m3fn weights with one float32 scale per tensor [1]; activations float8_e4m3fn "
                       "with one static input_scale [1] per linear, calibrated on the float model "
                       "(tpcheck.inputs.models.calibrate; compressed-tensors' FP8 preset)",
    "w8a8-fp8-kv": "w8a8-fp8 plus an FP8 (e4m3) KV cache: one static k_scale / v_scale [1] per layer, calibrated "
                   "on the float model's keys (after RoPE) and values (kv_cache_scheme strategy tensor)",
    "fp8-kv": "float linears (as in the source) and an FP8 (e4m3) KV cache: one static k_scale / v_scale [1] per "
              "layer, calibrated as w8a8-fp8-kv's (config_groups {}, kv_cache_scheme strategy tensor)",
    "fp8-kv-head": "float linears and an FP8 (e4m3) KV cache with one static k_scale / v_scale per KV head "
                   "[kv_heads, 1, 1] (kv_cache_scheme strategy attn_head)",
}

#: scheme name -> what it writes (``tpcheck.inputs.models.quantize_gptq``)
GPTQ_SCHEMES: dict[str, str] = {
    f"gptq-w4g{g}{'-actorder' if act else ''}":
        f"4-bit GPTQ (v1) weights, group {g}{', act-order g_idx' if act else ''}; activations float (W4A16)"
    for g in (32, 64, 128) for act in (False, True)}

#: scheme name -> what it writes (``tpcheck.inputs.models.quantize_awq``)
AWQ_SCHEMES: dict[str, str] = {f"awq-w4g{g}": f"4-bit AWQ (GEMM) weights with zero points, group {g}; "
                                              "activations float (W4A16)" for g in (32, 64, 128)}
