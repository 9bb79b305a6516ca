"""The named presets of ``tpcheck.inputs.models.checkpoints``: one HF config's keyword dict per preset, for every family
impl runs (Qwen2, Llama, Mistral, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral), the HF config a dict makes, and the one-line description
``tpcheck presets`` prints.

Qwen2 presets (no ``model_type`` key: a preset dict is a ``Qwen2Config``'s keywords; head_dim = hidden /
heads = 8 or 16 for the tiny ones):

* ``tiny``        8 heads / 2 KV heads: KV heads are replicated at tp 4.  vocab 250 is
                  not divisible by 4 (and not a multiple of 64): vocab padding.  Tied.
* ``tiny-untied`` like tiny, 3 layers, odd vocab 301 (padding at tp 2 and 4), untied
                  lm_head, rope_theta 1e6.
* ``tiny-mha``    4 heads / 4 KV heads (plain MHA, no replication), vocab 256 divides
                  evenly, untied.
* ``tiny-mqa``    4 heads / 1 KV head: KV replicated at tp 2 and 4; odd vocab 203; tied.
* ``small``       a slightly larger GQA model (4 layers, replication at tp 4), untied.
* ``small-outliers`` trained-model statistics (6 layers, 12/2 heads, hidden 192): two residual
                  channels grow to the hundreds with depth (``_add_outliers``), the rest stay O(1);
                  where a one-device noise floor fails correct TP engines in bfloat16/float16.
* ``small-hd32``  head_dim 32 (hidden 128, 4 heads / 2 KV heads, 2 layers, vocab 256, untied): the
                  smallest shape vLLM's CPU attention runs (head_dim 32..512; the tiny presets have 8 or 16),
                  for ``--engine vllm``; splits at tp 1, 2 and 4 (KV replicated at 4).
* ``qwen2.5-0.5b`` the real Qwen2.5-0.5B shape (14 heads / 2 KV heads, so tp 1 or 2;
                  tied; ~2 GB in float32) with random weights, for scale tests.

Other families (``model_type`` in the dict picks the family's config class; every one splits at tp 1, 2
and 4, with KV heads replicated at tp 4):

* ``tiny-llama``      Llama 3: ``rope_type: llama3`` (factor 8, low/high freq factor 1/4) with
                      original_max_position_embeddings 32, so the remap changes 3 of the 4 frequency pairs
                      by up to 8x and shows from the first positions; no biases; odd vocab 253; untied.
* ``small-llama``     Llama 3.2-like: 4 layers, llama3 RoPE (factor 32, original 64 positions), tied.
* ``tiny-llama-bias`` Llama 2 style (default RoPE) with ``attention_bias`` (q/k/v and o_proj biases) and
                      ``mlp_bias`` (gate/up/down biases); head_dim 16 != hidden / heads = 8; tied.
* ``tiny-mistral``    ``sliding_window`` 12: every layer attends to its 12 most recent tokens, so any prompt
                      or generation longer than 12 tokens depends on the window; odd vocab 203; untied.
* ``tiny-qwen3``      per-head q/k RMSNorm before RoPE; 4 heads / 1 KV head (replicated at tp 2 and 4),
                      head_dim 32 != hidden / heads = 16; tied.
* ``llama-hd32``      Llama 3 with head_dim 32 (hidden 128, 4 heads / 2 KV heads, 2 layers, llama3 RoPE,
                      tied, vocab 256): the Llama shape ``--engine vllm`` runs on CPU.
* ``small-qwen3``     4 layers, 8 heads / 2 KV heads, head_dim 32 != 128 / 8, q/k norms; untied.
* ``tiny-gemma3``     Gemma 3 (text): a sliding layer (window 8, RoPE base 1e4) then a global one (1e6); four
                      ``(1 + w)`` norms a layer, per-head q/k norms, GeGLU (tanh GELU), the embedding scaled by
                      sqrt(hidden), scores by ``query_pre_attn_scalar`` 24 != head_dim 32; 4 heads / 1 KV head
                      (replicated at tp 2 and 4); tied.
* ``small-gemma3``    Gemma 3 at Gemma's 5:1 pattern: 6 layers (5 sliding, window 12; 1 global), 4 heads / 1 KV
                      head, head_dim 64; tied.
* ``gemma3-trained``  the trained Gemma 3 270M's mid-depth statistics (``tpcheck.inputs.models.gemma_recipe``): 12 layers
                      (5:1, window 64), hidden 256, 4 heads / 1 KV head, head_dim 64, vocab 1024, tied; token 0's
                      channel 163 grows to ~5e4 at mid depth (max / RMS ~95; under float16's max) and draws ~45% of
                      the attention (a sink), for any prompt: ``skip_o_proj_allreduce`` at layer 6 is found at the
                      trained model's margin (bfloat16 ~29x against its ~32x).
* ``deep-sink``       trained-model magnitudes at depth: Llama with attention_bias + mlp_bias, 24 layers, hidden
                      128, 4 heads / 2 KV heads (head_dim 32), intermediate 256, vocab 384, untied, drawn with
                      the attention-sink recipe (``tpcheck.inputs.models.sink_recipe``): one residual channel at token 0
                      grows to ~2e4 by layer 6, holds to layer 20 and falls to ~2.5e3 at layer 23, a second
                      one holds ~-1.55e3, every other entry stays O(1-10) (median |x| 1.3-5.4), for any prompt.
* ``deep-sink-3``     the same recipe with 6 heads / 3 KV heads (head_dim 64, hidden 192, intermediate 384), so
                      it splits at tp 3 (and 1, 6): the tp at which a shared-memory all-reduce adds partials in a
                      rank-dependent order (a public 135M Llama-family model has 9 / 3 heads).

Mixture of experts (``impl.layers.moe``; 8 experts of width 32 per sparse layer, so every one splits at tp 1, 2
and 4 with ep 1, 2 and 4 wherever ep divides tp):

* ``tiny-qwen2-moe``  Qwen2-MoE: 3 layers, layer 1 dense (``mlp_only_layers``, width 96), top-2 of 8 experts
                      without renormalisation (``norm_topk_prob`` false), a shared expert of width 48 with its
                      sigmoid gate; 4 heads / 2 KV heads (replicated at tp 4); untied.
* ``tiny-qwen3-moe``  Qwen3-MoE: 2 sparse layers, top-2 of 8 renormalised (``norm_topk_prob``), q/k norms,
                      head_dim 32, 4 heads / 1 KV head; tied.
* ``tiny-mixtral``    Mixtral: 2 sparse layers of 8 ``block_sparse_moe`` experts (``w1``/``w3``/``w2``), top-2,
                      always renormalised, weights kept in float32; ``sliding_window`` 16; untied.
* ``tiny-moe-ties``   Qwen3-MoE with near-tie routing drawn deliberately: top-3 of 8, the router's rows come in
                      pairs (row ``2i+1`` = row ``2i`` + 0.01 x its own draw, ``ROUTER_TIES``), so the 3rd and
                      4th choice of every token are the two experts of one pair and their logits differ by
                      ~0.01 x |x| / sqrt(hidden): a choice a bfloat16 router may legitimately flip;
                      renormalised; 2 layers; tied.

What the presets' checkpoints hold (the value recipe) is in ``tpcheck.inputs.models.weight_recipe``; writing and caching
them is ``tpcheck.inputs.models.checkpoints``, whose RECIPE_VERSION covers these dicts too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# the preset names and their descriptions load without torch or transformers (``tpcheck --help`` lists the names):
# ``impl.config`` and torch are imported by the functions that build configs and dtypes
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")

_TINY = dict(max_position_embeddings=1024, rms_norm_eps=1e-6, use_sliding_window=False,
             bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=96, num_hidden_layers=2, vocab_size=250,
                 tie_word_embeddings=True, rope_theta=10000.0),
    "tiny-untied": dict(_TINY, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                        intermediate_size=96, num_hidden_layers=3, vocab_size=301,
                        tie_word_embeddings=False, rope_theta=1000000.0),
    "tiny-mha": dict(_TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=128, num_hidden_layers=2, vocab_size=256,
                     tie_word_embeddings=False, rope_theta=10000.0),
    "tiny-mqa": dict(_TINY, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=80, num_hidden_layers=2, vocab_size=203,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "small": dict(_TINY, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=352, num_hidden_layers=4, vocab_size=1000,
                  tie_word_embeddings=False, rope_theta=1000000.0,
                  max_position_embeddings=2048),
    "qwen2.5-0.5b": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, num_hidden_layers=24, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, bos_token_id=151643,
                         eos_token_id=151645, use_sliding_window=False),
    "small-outliers": dict(_TINY, hidden_size=192, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=512, num_hidden_layers=6, vocab_size=1000,
                           tie_word_embeddings=False, rope_theta=1000000.0,
                           max_position_embeddings=2048),
    "small-hd32": dict(_TINY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=256, num_hidden_layers=2, vocab_size=256,
                       tie_word_embeddings=False, rope_theta=10000.0),
}

# the other families: the same value recipe, the family's own config class (``model_type``)
_FAMILY = dict(max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
_TINY_SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=2)
_SMALL_SHAPE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=352,
                    num_hidden_layers=4, vocab_size=1000, max_position_embeddings=2048)


def _llama3(factor: float, original: int) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


PRESETS.update({
    "tiny-llama": dict(_FAMILY, **_TINY_SHAPE, model_type="llama", vocab_size=253, tie_word_embeddings=False,
                       rope_theta=500000.0, rope_scaling=_llama3(8.0, 32)),
    "small-llama": dict(_FAMILY, **_SMALL_SHAPE, model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                        rope_scaling=_llama3(32.0, 64)),
    "tiny-llama-bias": dict(_FAMILY, **_TINY_SHAPE, model_type="llama", vocab_size=250, head_dim=16,
                            attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=10000.0),
    "tiny-mistral": dict(_FAMILY, **_TINY_SHAPE, model_type="mistral", vocab_size=203, sliding_window=12,
                         tie_word_embeddings=False, rope_theta=1000000.0),
    "tiny-qwen3": dict(_FAMILY, **dict(_TINY_SHAPE, num_attention_heads=4, num_key_value_heads=1, intermediate_size=80),
                       model_type="qwen3", vocab_size=250, head_dim=32, tie_word_embeddings=True,
                       rope_theta=1000000.0),
    "llama-hd32": dict(_FAMILY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                       num_hidden_layers=2, model_type="llama", vocab_size=256, tie_word_embeddings=True,
                       rope_theta=500000.0, rope_scaling=_llama3(8.0, 64)),
    "small-qwen3": dict(_FAMILY, **dict(_SMALL_SHAPE, intermediate_size=256), model_type="qwen3", head_dim=32,
                        tie_word_embeddings=False, rope_theta=1000000.0),
    "deep-sink": dict(_FAMILY, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                      num_hidden_layers=24, model_type="llama", vocab_size=384, attention_bias=True, mlp_bias=True,
                      tie_word_embeddings=False, rope_theta=10000.0),
    "deep-sink-3": dict(_FAMILY, hidden_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                        intermediate_size=384,
                        num_hidden_layers=24, model_type="llama", vocab_size=384, attention_bias=True, mlp_bias=True,
                        tie_word_embeddings=False, rope_theta=10000.0),
    # Gemma 3 (text): sliding and global layers with their own RoPE bases, (1 + w) norms four per layer, GeGLU
    "tiny-gemma3": dict(_FAMILY, **dict(_TINY_SHAPE, num_attention_heads=4, num_key_value_heads=1, intermediate_size=80),
                        model_type="gemma3_text", vocab_size=262, head_dim=32, tie_word_embeddings=True,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=24,
                        hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
    "small-gemma3": dict(_FAMILY, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                         intermediate_size=256, num_hidden_layers=6, model_type="gemma3_text", vocab_size=1000,
                         max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1000000.0,
                         rope_local_base_freq=10000.0, query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh",
                         sliding_window=12, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "gemma3-trained": dict(_FAMILY, hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                           intermediate_size=1024, num_hidden_layers=12, model_type="gemma3_text", vocab_size=1024,
                           max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1000000.0,
                           rope_local_base_freq=10000.0, query_pre_attn_scalar=64,
                           hidden_activation="gelu_pytorch_tanh", sliding_window=64,
                           layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2),
})

_MOE_ATTN = dict(_FAMILY, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256,
                 rope_theta=1000000.0)
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
PRESETS.update({
    "tiny-qwen2-moe": dict(_MOE_ATTN, **_EXPERTS, model_type="qwen2_moe", num_key_value_heads=2, num_hidden_layers=3,
                           intermediate_size=96, mlp_only_layers=[1], shared_expert_intermediate_size=48,
                           norm_topk_prob=False, use_sliding_window=False, tie_word_embeddings=False),
    "tiny-qwen3-moe": dict(_MOE_ATTN, **_EXPERTS, model_type="qwen3_moe", num_key_value_heads=1, head_dim=32,
                           intermediate_size=96, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=True),
    "tiny-mixtral": dict(_MOE_ATTN, model_type="mixtral", num_attention_heads=8, num_key_value_heads=2,
                         num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
                         tie_word_embeddings=False),
    "tiny-moe-ties": dict(_MOE_ATTN, **dict(_EXPERTS, num_experts_per_tok=3), model_type="qwen3_moe",
                          num_key_value_heads=1, head_dim=32, intermediate_size=96, mlp_only_layers=[],
                          norm_topk_prob=True, tie_word_embeddings=True),
})

# presets drawn with the massive-activation recipe (``outliers=`` of ``make_config_checkpoint``)
OUTLIERS: dict[str, float] = {"small-outliers": 1.0}
# presets whose routers are drawn in near-tied pairs of rows, at this spread (``router_ties=``; ``_tie_router``)
ROUTER_TIES: dict[str, float] = {"tiny-moe-ties": 0.01}
# presets drawn with the attention-sink recipe (``sink=True`` of ``make_config_checkpoint``: ``_add_sink``)
SINKS: tuple[str, ...] = ("deep-sink", "deep-sink-3")
# quantized presets: the float preset's checkpoint (same seed) quantized by ``tpcheck.inputs.models.quantize`` with this
# scheme. small-hd32's shape: head_dim 32 and K, N per rank multiples of 32 at tp 1/2/4, as vLLM's CPU kernels want
QUANTIZED: dict[str, tuple[str, str]] = {"small-w8a8": ("small-hd32", "w8a8-int8"),
                                         "small-w8a8-tensor": ("small-hd32", "w8a8-int8-tensor"),
                                         "small-gptq": ("small-hd32", "gptq-w4g32"),
                                         "small-gptq-act": ("small-hd32", "gptq-w4g32-actorder"),
                                         "small-awq": ("small-hd32", "awq-w4g32"),
                                         "small-fp8": ("small-hd32", "w8a8-fp8"),
                                         "small-fp8-tensor": ("small-hd32", "w8a8-fp8-tensor"),
                                         "small-fp8-static": ("small-hd32", "w8a8-fp8-static"),
                                         "small-fp8-kv": ("small-hd32", "fp8-kv"),
                                         "small-fp8-kv-head": ("small-hd32", "fp8-kv-head")}
PRESETS.update({name: PRESETS[base] for name, (base, _) in QUANTIZED.items()})


def preset_names() -> list[str]:
    """Names of the available presets, in definition order."""
    return list(PRESETS)


def config_family(config: dict) -> str:
    """The ``model_type`` of a preset's or drawn config's keyword dict (``"qwen2"`` when it has none)."""
    return config.get("model_type", "qwen2")


def preset_family(name: str) -> str:
    """The ``model_type`` of preset ``name`` (``qwen2``, ``llama``, ``mistral``, ``qwen3``, ``qwen2_moe``,
    ``qwen3_moe``, ``mixtral``)."""
    return config_family(_check_preset(name))


def preset_available(name: str) -> bool:
    """Whether the installed transformers can read preset ``name``'s family (Qwen3 needs transformers >= 4.51) and
    tpcheck can capture it: the MoE presets need transformers 5, whose router returns (logits, top-k weights, ids)
    and whose experts are one module (``tpcheck.capture.maps.HF_MAP``; 4.x routes inside the block); the FP8 KV
    cache presets need transformers >= 4.53."""
    from impl.config import _TF_VERSION, FAMILIES, TRANSFORMERS_5  # imports transformers: see DTYPE_NAMES
    family = FAMILIES[preset_family(name)]
    # an FP8 KV cache's scales are calibrated, and its golden rounds, through transformers' pluggable attention and
    # masks (AttentionInterface >= 4.51, masking_utils >= 4.53)
    kv_cache = "kv" in QUANTIZED.get(name, ("", ""))[1]
    return family.available and (family.moe is None or TRANSFORMERS_5) and (not kv_cache or _TF_VERSION >= (4, 53))


def describe_preset(name: str) -> str:
    """One line of ``tpcheck presets``: family, sizes, and what sets the preset apart."""
    c = _check_preset(name)
    hd = c.get("head_dim")
    extra = [f"head_dim {hd}"] if hd else []
    scaling = c.get("rope_scaling")
    if scaling:
        extra.append(f"{scaling['rope_type']} rope (original {scaling['original_max_position_embeddings']} positions)")
    if c.get("sliding_window") is not None and config_family(c) in ("mistral", "mixtral"):
        extra.append(f"sliding window {c['sliding_window']}")
    biases = [b for b in ("attention_bias", "mlp_bias") if c.get(b)]
    if biases:
        extra.append("+".join(biases))
    extra += _describe_moe(name, c)
    if name in SINKS:
        extra.append("attention sink at token 0: ~2e4 mid-depth, ~2.5e3 at the last layer")
    if name in QUANTIZED:
        extra.append(f"{QUANTIZED[name][0]} quantized {QUANTIZED[name][1]}")
    if QUANTIZED.get(name, ("", ""))[1].startswith("fp8-kv"):  # tpcheck.inputs.models.kv_recipe
        extra.append("v rows scaled by 0.0002 / 0.001 per KV head before quantizing")
    return (f"{name:15s} {config_family(c):9s} hidden {c['hidden_size']:4d}  heads {c['num_attention_heads']:2d}/"
            f"{c['num_key_value_heads']} kv  layers {c['num_hidden_layers']:2d}  vocab {c['vocab_size']:6d}  "
            f"{'tied' if c.get('tie_word_embeddings') else 'untied'}" + "".join(f"; {e}" for e in extra))


def _describe_moe(name: str, c: dict) -> list[str]:
    """``tpcheck presets``' words for a mixture-of-experts preset: experts, top-k, renormalisation, shared
    expert, dense layers, near-tie routing."""
    experts = c.get("num_experts", c.get("num_local_experts"))
    if experts is None:
        return []
    renorm = config_family(c) == "mixtral" or c.get("norm_topk_prob")
    out = [f"top-{c['num_experts_per_tok']} of {experts} experts{' renormalised' if renorm else ''}"]
    if c.get("shared_expert_intermediate_size"):
        out.append("shared expert")
    if c.get("mlp_only_layers"):
        out.append(f"dense layer(s) {c['mlp_only_layers']}")
    if name in ROUTER_TIES:
        out.append(f"near-tie router rows (pairs {ROUTER_TIES[name]} apart)")
    return out


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_NAMES)}")
    import torch  # here, not at the top: see DTYPE_NAMES
    return getattr(torch, dtype)


def _check_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(name: str, dtype: str = "float32") -> PretrainedConfig:
    """The HF config of preset ``name`` (its family's config class: ``Qwen2Config``, ``LlamaConfig``, ...) with
    ``dtype`` recorded in it.

    Raises ValueError for an unknown preset (listing the valid names) or dtype.
    Note: transformers 5.x stores ``rope_theta`` (and ``rope_scaling``) inside ``config.rope_parameters``.
    """
    return config_from_kwargs(_check_preset(name), dtype)


def config_from_kwargs(kwargs: dict, dtype: str = "float32") -> PretrainedConfig:
    """An HF config from a preset's dict or one drawn by ``tpcheck.properties.strategies``: ``model_type`` (default
    ``qwen2``) picks the family's config class (``impl.config.FAMILIES``), the other keys are its keyword
    arguments; ``dtype`` and the family's architecture are recorded in it."""
    from impl.config import FAMILIES, HF_DTYPE_KEY  # imports transformers: see DTYPE_NAMES
    _check_dtype(dtype)
    kwargs = dict(kwargs)
    model_type = kwargs.pop("model_type", "qwen2")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not one of {sorted(FAMILIES)}")
    return family.hf_config_class()(**kwargs, **{HF_DTYPE_KEY: dtype}, architectures=[family.hf_model_class])

