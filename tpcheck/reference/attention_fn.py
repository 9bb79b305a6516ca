"""tpcheck's attention function for Hugging Face models, registered with transformers' attention interface under
``ATTN_NAME``: sdpa, plus what tpcheck needs inside attention without forking HF code: the post-RoPE query and key
of the new tokens handed to a sink (``_STATE["sink"]``) and to the module's ``rope_probe`` (``tpcheck.reference.hf``),
and an FP8 KV cache's rounding of the new keys and values (a module's ``kv_cache_scales``, set by
``tpcheck.reference.quantized``)."""
from __future__ import annotations

from tpcheck.reference.formats import fake_quant_kv  # the format read by tpcheck, not by impl

ATTN_NAME = "tpcheck_sdpa"
_STATE: dict = {}


def _attention(module, query, key, value, attention_mask, **kwargs):
    sink, probe = _STATE.get("sink"), getattr(module, "rope_probe", None)
    kv_scales = getattr(module, "kv_cache_scales", None)  # an FP8 KV cache (tpcheck.reference.quantized)
    if sink is not None or probe is not None:
        i, n = module.layer_idx, query.shape[2]
        q = query[0].transpose(0, 1).reshape(n, -1)
        k = key[0, :, -n:].transpose(0, 1).reshape(n, -1)  # a view of the cache when one token is new
        if kv_scales is not None:
            k = k.clone()  # the rounding below writes into the cache: the point keeps the key before it
        if sink is not None:
            sink(f"layers.{i}.attn.q_rope", q.detach())
            sink(f"layers.{i}.attn.k_rope", k.detach())
        if probe is not None:
            probe(q[None], k[None])
    if kv_scales is not None:  # after the capture: k_rope is the key before the cache rounds it, as in the engine
        n = query.shape[2]
        for t, s in zip((key, value), kv_scales):
            # the scales are plain attributes (read from the checkpoint on the host): moved to the cache's device
            t[:, :, -n:] = fake_quant_kv(t[:, :, -n:], s.to(t.device))  # in place: the cache keeps the rounded values
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # submodule: loaded on first call
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    """Register tpcheck's attention function (sdpa, plus the post-RoPE q/k) with transformers under
    ``ATTN_NAME``; a model uses it once ``model.config._attn_implementation = ATTN_NAME``."""
    try:
        from transformers import AttentionInterface  # transformers >= 4.51
        AttentionInterface.register(ATTN_NAME, _attention)
    except ImportError:  # transformers < 4.51: the registry is a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # transformers < 4.51
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = _attention
    try:  # transformers >= 4.53 builds masks per attention implementation
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # transformers >= 4.53
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:
        pass
