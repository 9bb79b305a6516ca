"""What to check next where a run first diverged: one short hint per point kind and cause, as data.

The cause is the kind of evidence that failed the origin row (``tpcheck.result.origin.cause_of``): ``ranks``
(ranks hold different values of a tensor each must hold whole), ``floor`` (the error against the float64 golden
above the noise floor), ``gain`` (a systematic relative error: every element scaled alike), ``bound`` (the largest
difference over an absolute bound), ``nan`` (not finite), ``shape`` (a shape other than the golden's, or ranks
holding other shapes), ``exact-ops`` (an op's bits differ from HF's, ``--exact-ops``) and ``note`` (another finding
written in the row's note). ``hint(kind, cause)`` looks up ``HINTS[kind][cause]``, then ``HINTS[kind]["*"]``
(what makes that point: the place to look whatever the evidence), then ``BY_CAUSE[cause]``; ranks that disagree
skip the point's general hint (``COLLECTIVE``: a replica that differs points at what makes the tensor whole on
every rank, not at the op). Each hint names the code to read, in the words of a TP engine
(vLLM's layer classes: row- and column-parallel linears, the vocab-parallel embedding), short enough for one line
of the summary after ``next: check ``."""
from __future__ import annotations

#: the evidence of each cause, in words: the summary's ``why:`` line starts with it
WHY = {
    "ranks": "ranks disagree",
    "floor": "above the noise floor",
    "gain": "a systematic gain",
    "bound": "over its absolute bound",
    "nan": "not finite",
    "shape": "shapes differ",
    "exact-ops": "bits differ from HF's op",
    "note": "a structural finding",
}
#: causes that fail a row whatever its error: the summary tells them without a ratio
STRUCTURAL = ("nan", "shape", "exact-ops", "note")
#: causes whose own hint comes before a point kind's general one
COLLECTIVE = ("ranks",)

_NORM = "the norm: its weight convention (Gemma's 1 + w), eps, the dtype it multiplies its weight in"
_KV_REPLICAS = "the KV-head replicas (tp > KV heads): rank r holds KV head r // replicas, its cache and scales"
_Q = {
    "floor": "the QKV weight shards: the dim split (out_features), the q/k/v order, which rank's slice; biases",
    "gain": "the QKV GEMM's scales / quantization: one scale per fused partition, which rank's scale rows",
}
_KV_PROJ = {**_Q, "ranks": _KV_REPLICAS}
_GATE_UP = {
    "floor": "the gate/up weight shards: the fused halves' order, the dim split (out_features), which rank's",
    "gain": "that GEMM's scales / quantization: one scale per fused partition, which rank's scale rows",
}
_ROPE = {"*": "RoPE: the positions (decode offsets), the base (rope_theta, scaling), the layout (halves or pairs)",
         "ranks": _KV_REPLICAS}
_KV = {"*": "what the cache stores: KV heads repeated or not, the slot mapping (block boundaries), its dtype / scales",
       "ranks": _KV_REPLICAS}
_QK_NORM = {"*": "the per-head q/k norm: applied before RoPE, its weight, eps"}
_SHARED = {"*": "the shared expert and its sigmoid gate (a replicated linear: never all-reduced)"}



def _row_parallel(proj: str, also: str) -> dict[str, str]:
    """The hints of a row-parallel linear's output (``o_proj``, ``down_proj``): its all-reduce, shards, scales."""
    return {"ranks": f"the {proj} all-reduce (each rank's partial added once: not skipped, not twice, not in low "
                     "precision)",
            "floor": f"{proj}'s weight shards (split along in_features), its bias (added once), {also}",
            "gain": f"{proj}'s scales / quantization: the row-parallel scale's shard axis, its group tiles"}


#: point kind -> cause (or "*": any) -> what to check next
HINTS: dict[str, dict[str, str]] = {
    "embed": {"*": "the vocab-parallel embedding: each rank's id range, ids outside it masked to 0, the all-reduce"},
    "input_norm": {"*": _NORM},
    "attn.q": _Q, "attn.k": _KV_PROJ, "attn.v": _KV_PROJ,
    "attn.q_norm": _QK_NORM, "attn.k_norm": _QK_NORM,
    "attn.q_rope": _ROPE, "attn.k_rope": _ROPE,
    "kv.k": _KV, "kv.v": _KV,
    "attn.context": {
        "*": "the attention: the mask (causal, sliding window), the GQA head mapping, the KV cache read, the scale",
        "nan": "the mask: a -inf times 0 is NaN (mask with masked_fill, or a large negative)",
        "ranks": _KV_REPLICAS,
    },
    "attn.out": _row_parallel("o_proj", "the all-reduce's dtype"),
    "attn.post_norm": {"*": _NORM},
    "attn.residual": {"*": "the residual add after attention: what is added, and any multiplier on it"},
    "post_attn_norm": {"*": _NORM},
    "moe.router": {"*": "the router GEMM: replicated weights, its logits' precision (float32)"},
    "moe.topk_ids": {"*": "the routing: the router's logits, the top-k, the order of ties"},
    "moe.topk_weights": {"*": "the top-k weights: softmax before or after top-k, renormalised to 1 (norm_topk_prob)"},
    "moe.experts": {"*": "the experts: each rank's global -> local expert ids, the combine weights' order, "
                         "one all-reduce"},
    "moe.shared": _SHARED, "moe.shared_gate": _SHARED,
    "mlp.gate": _GATE_UP, "mlp.up": _GATE_UP,
    "mlp.act": {"*": "the activation (SiLU or GELU-tanh) and which gate/up half it multiplies"},
    "mlp.out": _row_parallel("down_proj", "a shared expert"),
    "mlp.post_norm": {"*": _NORM},
    "handoff": {"*": "what a pipeline stage sends: hidden_states and residual, and no final norm before the last"},
    "out": {"*": "the layer's last residual add: the MLP's output plus the residual"},
    "final_norm": {"*": _NORM},
    "logits": {"*": "lm_head: tied to the embedding or not, its vocab shards (padding stripped, gathered in order)"},
}

#: cause -> what to check next where the point's kind has no hint of its own
BY_CAUSE: dict[str, str] = {
    "ranks": "the collective that makes this tensor whole on every rank (all-reduce / all-gather), each rank's shard",
    "floor": "the op that makes this point: its weight shards (dim, order, which rank's) and its inputs",
    "gain": "the scales of the op that makes this point (quantization scales, a multiplier, a norm's weight)",
    "bound": "the op that makes this point: its largest elements",
    "nan": "an overflow in the dtype, a mask or softmax that makes NaN, memory never written",
    "shape": "the shard shapes: the dim split, heads per rank, what each rank reports for this point",
    "exact-ops": "the op against HF's: the dtype it computes in and the order of its casts",
    "note": "what the note says was found at this point",
}


def hint(kind: str, cause: str) -> str:
    """What to check next for a divergence of ``cause`` (a ``WHY`` key) first at a point of ``kind``
    (``attn.out``); the lookup order is the module's."""
    if cause not in WHY:
        raise KeyError(f"unknown cause {cause!r}: one of {', '.join(WHY)}")
    by_kind = HINTS.get(kind, {})
    if cause in by_kind:
        return by_kind[cause]
    if cause in COLLECTIVE or "*" not in by_kind:
        return BY_CAUSE[cause]
    return by_kind["*"]
