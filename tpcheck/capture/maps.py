"""Ready name maps for ``tpcheck.capture``: impl, Hugging Face's causal LMs (one device, and under transformers'
``tp_plan``), vLLM / SGLang.

Module names are as ``model.named_modules()`` gives them on the object you pass to ``install``: impl's
``runner.model`` and vLLM's / SGLang's ``Qwen2ForCausalLM`` (``model.layers.{i}...``), HF's ``Qwen2ForCausalLM``,
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen3ForCausalLM`` (the same names; Qwen3 adds
``self_attn.q_norm`` / ``k_norm``, whose rules match nothing in the other families). None of the maps reports
the KV-cache points (``layers.{i}.kv.k|v``): a cache is read back after the step, in each engine's own layout
(impl: ``tpcheck.engines.impl.ranks.read_kv``)."""
from __future__ import annotations

from dataclasses import replace

from impl.placements import Fused, Replicate, Shard
from tpcheck.capture.rules import NameMap, Rule, declared, of_sibling, weight_placement

_L = r"model\.layers\.{layer}\."
_P = "layers.{layer}."


_GEMMA = "pre_feedforward_layernorm"  # a model with it is Gemma 3 (four norms a layer)


def _sandwich_rules(placement=Replicate()) -> tuple[Rule, ...]:
    """Gemma 3's layer norms (the same module names in impl, HF and HF TP; each acts on replicated, all-reduced
    data): ``post_attention_layernorm`` on the attention's output (``attn.post_norm``), ``pre_feedforward_layernorm``
    the MLP's input norm (``attn.residual`` in, ``post_attn_norm`` out), ``post_feedforward_layernorm`` on the MLP's
    output (``mlp.post_norm``). The other families' ``post_attention_layernorm`` rules carry ``model_lacks``."""
    return (
        Rule(_L + "post_attention_layernorm", _P + "attn.post_norm", placement, model_has=_GEMMA),
        Rule(_L + "pre_feedforward_layernorm", _P + "attn.residual", Replicate(), input=True),
        Rule(_L + "pre_feedforward_layernorm", _P + "post_attn_norm", placement),
        Rule(_L + "post_feedforward_layernorm", _P + "mlp.post_norm", placement),
    )


def _impl_k_rope(module, parent):
    return Shard(-1, parent.qkv_proj.kv_replicas)


IMPL_MAP = NameMap("impl", (
    Rule(r"model\.embed_tokens", "embed", declared()),
    Rule(_L + "input_layernorm", _P + "input_norm", declared()),
    Rule(_L + r"self_attn\.qkv_proj", _P + "attn.", declared(), parts=("q", "k", "v")),
    # Qwen3 (HeadRMSNorm, [T, local heads, head_dim]): q's placement Shard(-1), k's Shard(-1, KV replicas)
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", declared()),
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", declared()),
    Rule(_L + r"self_attn\.attn", _P + "attn.q_rope", Shard(-1), input=True, index=0),
    Rule(_L + r"self_attn\.attn", _P + "attn.k_rope", _impl_k_rope, input=True, index=1),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.context", of_sibling("attn"), input=True),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.out", declared()),
    Rule(_L + "post_attention_layernorm", _P + "attn.residual", Replicate(), input=True, model_lacks=_GEMMA),
    Rule(_L + "post_attention_layernorm", _P + "post_attn_norm", declared(), model_lacks=_GEMMA),
    *_sandwich_rules(declared()),
    Rule(_L + r"mlp\.gate_up_proj", _P + "mlp.", declared(), parts=("gate", "up")),
    Rule(_L + r"mlp\.down_proj", _P + "mlp.act", of_sibling("act_fn"), input=True),
    # mixture of experts (impl.layers.moe): router, top-k (weights, ids), the partial routed and shared outputs
    Rule(_L + r"mlp\.gate", _P + "moe.router", declared()),
    Rule(_L + r"mlp\.topk", _P + "moe.topk_weights", declared(), index=0),
    Rule(_L + r"mlp\.topk", _P + "moe.topk_ids", declared(), index=1),
    Rule(_L + r"mlp\.experts", _P + "moe.experts", declared()),
    Rule(_L + r"mlp\.shared_expert", _P + "moe.shared", declared()),
    Rule(_L + r"mlp\.shared_expert_gate", _P + "moe.shared_gate", declared()),
    Rule(_L + "mlp", _P + "mlp.out", Replicate()),  # dense: down_proj's all-reduced output; sparse: the block's
    Rule(r"model\.layers\.{layer}", _P + "out", Replicate()),
    Rule(r"model\.norm", "final_norm", declared()),
    # the LM head returns the gathered logits (padding stripped) on rank 0, None elsewhere
    Rule(r"lm_head", "logits", Replicate()),
), doc="""impl (``runner.model``): the points and placements of ``tpcheck.engines.impl.ranks``'s hooks, from the
modules' declared ``output_placement``; ``qkv_proj`` / ``gate_up_proj`` whole with their ``Fused`` placement
(``layers.{i}.attn.`` → q, k, v; ``layers.{i}.mlp.`` → gate, up); Qwen3's per-head q/k norms from
``q_norm`` / ``k_norm`` (``HeadRMSNorm``, placed like the heads they normalise); q/k after RoPE from
``Attention``'s inputs; ``attn.context`` / ``mlp.act`` from o_proj's / down_proj's input with the placement
their producer declares.
Everything but the KV cache.""")


HF_MAP = NameMap("hf", (
    Rule(r"model\.embed_tokens", "embed"),
    Rule(_L + "input_layernorm", _P + "input_norm"),
    Rule(_L + r"self_attn\.q_proj", _P + "attn.q"),
    Rule(_L + r"self_attn\.k_proj", _P + "attn.k"),
    Rule(_L + r"self_attn\.v_proj", _P + "attn.v"),
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", model_lacks=_GEMMA),  # Qwen3
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", model_lacks=_GEMMA),
    # Gemma 3 normalises q and k after moving the heads ahead of the sequence: [batch, heads, seq, head_dim]
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", model_has=_GEMMA, heads_first=True),
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", model_has=_GEMMA, heads_first=True),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.context", input=True),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.out"),
    Rule(_L + "post_attention_layernorm", _P + "attn.residual", input=True, model_lacks=_GEMMA),
    Rule(_L + "post_attention_layernorm", _P + "post_attn_norm", model_lacks=_GEMMA),
    *_sandwich_rules(),
    Rule(_L + r"mlp\.gate_proj", _P + "mlp.gate"),
    Rule(_L + r"mlp\.up_proj", _P + "mlp.up"),
    Rule(_L + r"mlp\.down_proj", _P + "mlp.act", input=True),
    # mixture of experts (transformers 5: the router returns (logits, top-k weights, top-k ids))
    Rule(_L + r"mlp\.gate", _P + "moe.router", index=0, token_dims=1),  # the MoE modules see [tokens, ...]
    Rule(_L + r"mlp\.gate", _P + "moe.topk_weights", index=1, token_dims=1),
    Rule(_L + r"mlp\.gate", _P + "moe.topk_ids", index=2, token_dims=1),
    Rule(_L + r"mlp\.experts", _P + "moe.experts", token_dims=1),
    Rule(_L + r"mlp\.shared_expert", _P + "moe.shared", token_dims=1),
    Rule(_L + r"mlp\.shared_expert_gate", _P + "moe.shared_gate", token_dims=1),
    Rule(_L + "mlp", _P + "mlp.out"),
    Rule(r"model\.layers\.{layer}", _P + "out"),
    Rule(r"model\.norm", "final_norm"),
    Rule(r"lm_head", "logits"),
), token_dims=2, doc="""Hugging Face ``Qwen2ForCausalLM`` (or Llama, Mistral, Qwen3, and the MoE families) on one device: every point
``Replicate()``, tensors ``[batch, seq, ...]`` (run one prompt per forward: padding would become rows). Not
reported: ``attn.q_rope`` / ``attn.k_rope`` (HF applies RoPE in a function, not a module: ``tpcheck.reference.hf``
sees them through a registered attention function) and the KV cache.""")


HF_TP_MAP = NameMap("hf-tp", (
    Rule(r"model\.embed_tokens", "embed"),                                  # vocab-parallel, all-reduced
    Rule(_L + "input_layernorm", _P + "input_norm"),
    Rule(_L + r"self_attn\.q_proj", _P + "attn.q", weight_placement("out")),
    Rule(_L + r"self_attn\.k_proj", _P + "attn.k", weight_placement("out")),
    Rule(_L + r"self_attn\.v_proj", _P + "attn.v", weight_placement("out")),
    # Qwen3: each rank's q_norm / k_norm normalises the heads its column-parallel q_proj / k_proj gave it
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", Shard(-1), model_lacks=_GEMMA),
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", Shard(-1), model_lacks=_GEMMA),
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", Shard(-1), model_has=_GEMMA, heads_first=True),
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", Shard(-1), model_has=_GEMMA, heads_first=True),
    Rule(_L + r"self_attn\.rope_probe", _P + "attn.q_rope", Shard(-1), input=True, index=0),
    Rule(_L + r"self_attn\.rope_probe", _P + "attn.k_rope", Shard(-1), input=True, index=1),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.context", weight_placement("in"), input=True),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.out", weight_placement("out")),
    Rule(_L + "post_attention_layernorm", _P + "attn.residual", input=True, model_lacks=_GEMMA),
    Rule(_L + "post_attention_layernorm", _P + "post_attn_norm", model_lacks=_GEMMA),
    *_sandwich_rules(),
    Rule(_L + r"mlp\.gate_proj", _P + "mlp.gate", weight_placement("out")),
    Rule(_L + r"mlp\.up_proj", _P + "mlp.up", weight_placement("out")),
    Rule(_L + r"mlp\.down_proj", _P + "mlp.act", weight_placement("in"), input=True),
    # mixture of experts: the router replicated; the experts ("moe_tp_experts") each split over the ranks, their
    # partial outputs all-reduced by transformers' own output hook, which runs before this capture's
    Rule(_L + r"mlp\.gate", _P + "moe.router", index=0, token_dims=1),
    Rule(_L + r"mlp\.gate", _P + "moe.topk_weights", index=1, token_dims=1),
    Rule(_L + r"mlp\.gate", _P + "moe.topk_ids", index=2, token_dims=1),
    Rule(_L + r"mlp\.experts", _P + "moe.experts", token_dims=1),
    Rule(_L + r"mlp\.shared_expert", _P + "moe.shared", token_dims=1),          # not in the TP plan: replicated
    Rule(_L + r"mlp\.shared_expert_gate", _P + "moe.shared_gate", token_dims=1),
    Rule(_L + "mlp", _P + "mlp.out"),  # dense: down_proj's all-reduced output; sparse: the block's
    Rule(r"model\.layers\.{layer}", _P + "out"),
    Rule(r"model\.norm", "final_norm"),
    Rule(r"lm_head", "logits"),                                             # colwise_gather_output: full
), token_dims=2, doc="""Hugging Face ``Qwen2ForCausalLM`` (or Llama, Mistral, Qwen3) loaded with
``tp_plan="auto"`` (transformers' own tensor parallelism: weights are DTensors, activations plain local tensors).
Placements are read from each linear layer's weight (``weight_placement``: a column-parallel weight ``Shard(0)``
gives a ``Shard(-1)`` output, a row-parallel one ``Shard(1)`` takes a ``Shard(-1)`` input and gives the
all-reduced output); a module that returns a DTensor is read from the DTensor itself. Qwen3's ``q_norm`` /
``k_norm`` (a replicated ``[head_dim]`` weight) normalise each rank's own heads: ``Shard(-1)`` (tp never exceeds
the KV heads here: ``tpcheck.engines.hf_tp.adapter.check_layout``). q/k after RoPE come from a ``rope_probe`` module that
``tpcheck.engines.hf_tp`` attaches to each attention and calls from its attention function (HF applies RoPE in a function,
not a module). The embedding (vocab-parallel, all-reduced) and ``lm_head`` (``colwise_gather_output``) give full
tensors. The KV cache is read from each rank's ``DynamicCache`` (``tpcheck.engines.hf_tp``).""")


def vllm_qkv_placement(module, parent) -> Fused:
    """vLLM's / SGLang's ``QKVParallelLinear``: local ``[q | k | v]`` (``output_partition_sizes``), KV heads
    replicated over ``num_kv_head_replicas`` consecutive ranks when tp > the KV head count."""
    sizes = getattr(module, "output_partition_sizes", None)
    if not sizes:
        d = module.head_size
        sizes = [module.num_heads * d, module.num_kv_heads * d, module.num_kv_heads * getattr(module, "v_head_size", d)]
    kv = Shard(-1, getattr(module, "num_kv_head_replicas", 1))
    return Fused((("q", sizes[0], Shard(-1)), ("k", sizes[1], kv), ("v", sizes[2], kv)))


def vllm_gate_up_placement(module, parent) -> Fused:
    """vLLM's / SGLang's ``MergedColumnParallelLinear`` for gate | up: each part column-sharded."""
    sizes = getattr(module, "output_partition_sizes", None)
    if not sizes:
        sizes = [s // getattr(module, "tp_size", 1) for s in module.output_sizes]
    return Fused((("gate", sizes[0], Shard(-1)), ("up", sizes[1], Shard(-1))))


def _vllm_k_rope(module, parent):
    return Shard(-1, getattr(parent.qkv_proj, "num_kv_head_replicas", 1))


VLLM_MAP = NameMap("vllm", (
    Rule(r"model\.embed_tokens", "embed", model_lacks=_GEMMA),             # all-reduced: Replicate
    # Gemma 3 scales the embedding outside embed_tokens (Gemma3Model.embed_input_ids): layer 0's input holds it
    Rule(r"model\.layers\.0", "embed", input=True, index=1, model_has=_GEMMA),
    Rule(_L + "input_layernorm", _P + "input_norm", index=0),
    Rule(_L + "input_layernorm", "layers.{prev}.out", index=1),            # fused add+norm: updated residual
    Rule(_L + r"self_attn\.qkv_proj", _P + "attn.", vllm_qkv_placement, index=0, parts=("q", "k", "v")),
    # per-head q/k norms (Qwen3, Gemma 3: [tokens, local heads, head_dim]), placed like the heads they normalise
    Rule(_L + r"self_attn\.q_norm", _P + "attn.q_norm", Shard(-1)),
    Rule(_L + r"self_attn\.k_norm", _P + "attn.k_norm", _vllm_k_rope),
    Rule(_L + r"self_attn\.attn", _P + "attn.q_rope", Shard(-1), input=True, index=0),
    Rule(_L + r"self_attn\.attn", _P + "attn.k_rope", _vllm_k_rope, input=True, index=1),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.context", Shard(-1), input=True),
    Rule(_L + r"self_attn\.o_proj", _P + "attn.out", index=0),             # (output, bias): after all-reduce
    Rule(_L + "post_attention_layernorm", _P + "post_attn_norm", index=0, model_lacks=_GEMMA),
    Rule(_L + "post_attention_layernorm", _P + "attn.residual", index=1, model_lacks=_GEMMA),
    # Gemma 3: post_attention_layernorm is a plain norm of the attention's output; pre_feedforward_layernorm the fused
    # add + norm (its second output the residual after the attention); post_feedforward_layernorm the MLP's output's
    Rule(_L + "post_attention_layernorm", _P + "attn.post_norm", model_has=_GEMMA),
    Rule(_L + "pre_feedforward_layernorm", _P + "post_attn_norm", index=0),
    Rule(_L + "pre_feedforward_layernorm", _P + "attn.residual", index=1),
    Rule(_L + r"mlp\.gate_up_proj", _P + "mlp.", vllm_gate_up_placement, index=0, parts=("gate", "up")),
    Rule(_L + r"mlp\.down_proj", _P + "mlp.act", Shard(-1), input=True),
    Rule(_L + r"mlp\.down_proj", _P + "mlp.out", index=0),
    Rule(_L + "post_feedforward_layernorm", _P + "mlp.post_norm"),
    # mixture of experts: the router (a replicated linear: (logits, bias)); the experts its router object chose,
    # through the module tpcheck.engines.vllm.routes attaches (attach_route_probes: call it before install); the
    # FusedMoE runner's output, all-reduced, is the sparse block's (no shared expert outside it)
    Rule(_L + r"mlp\.gate", _P + "moe.router", index=0),
    Rule(_L + r"mlp\.route_probe", _P + "moe.topk_weights", index=0),
    Rule(_L + r"mlp\.route_probe", _P + "moe.topk_ids", index=1),
    Rule(_L + r"mlp\.experts", _P + "mlp.out"),
    Rule(r"model\.norm", "final_norm", index=0),
    Rule(r"model\.norm", "layers.{last}.out", index=1),
    Rule(r"logits_processor", "logits"),                                   # gathered, padding stripped
), doc="""vLLM / SGLang ``Qwen2ForCausalLM`` (``model.layers.{i}.self_attn.qkv_proj`` / ``.attn`` / ``o_proj``,
``mlp.gate_up_proj`` / ``down_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``model.embed_tokens``,
``model.norm``, ``logits_processor``). Install it on the ``Qwen2ForCausalLM`` module of each TP worker (vLLM:
the worker's ``model_runner.model``), with ``enforce_eager=True`` (SGLang: ``--disable-cuda-graph``).

* Linear layers return ``(output, bias)``: element 0. ``qkv_proj`` / ``gate_up_proj`` are captured whole with a
  ``Fused`` placement read from the layer (``vllm_qkv_placement``: KV replicas when tp > KV heads), split by
  the harness into ``attn.q/k/v`` and ``mlp.gate/up``. q/k after RoPE are the inputs of ``self_attn.attn``
  (vLLM's RoPE kernel rotates q/k in place inside the qkv buffer: the capture copies qkv before that).
* ``o_proj`` / ``down_proj`` outputs are ``Replicate()`` (``reduce_results=True``, the default). An engine that
  defers that all-reduce into the next norm reports them with ``with_placement(..., Partial())``.
* The residual stream, with a fused add + RMSNorm (``norm(x, residual) -> (normed, x + residual)``, updated
  in place): HF's residual-add outputs are not separate ops here, but they are the fused norms' second
  output. ``attn.residual`` of layer i is ``post_attention_layernorm``'s second output, ``out`` of layer i is
  layer i+1's ``input_layernorm``'s second output (the last layer's: ``model.norm``'s). Layer 0's
  ``input_layernorm`` gets no residual and returns one tensor: nothing else there. The fused kernel adds in
  float32 and rounds once, so ``--exact-ops`` may flag last-bit differences there that mean nothing.
  ``VLLM_NORMS_ONLY_MAP`` is for a norm that does not return the residual: the residual stream is then
  compared only through the norm outputs (``input_norm``, ``post_attn_norm``, ``final_norm``);
  ``attn.residual`` and ``out`` are not reported and coverage lists them (drop ``layers\\.\\d+\\.out`` from
  ``--require-points``, which requires it by default).
* ``logits``: ``logits_processor``'s output, gathered to rank 0 (None elsewhere: not written), vocab padding
  stripped. vLLM computes logits only for the rows it samples: at decode steps that is every row; at a
  prefill one row per prompt, which ``Capture.step_done`` drops (rows ≠ tokens), so logits are compared at
  decode steps. (``ParallelLMHead`` itself never runs forward in vLLM: no ``lm_head`` rule.) SGLang's logits
  processor returns an object: ``Rule("logits_processor", "logits", index="next_token_logits")``.
* ``step_done(step, tokens, starts)``: ``tokens`` per sequence in the order of the batch's rows, each
  sequence at the same index every step (vLLM may reorder requests between steps: map them back).
* Mixture of experts: ``mlp.gate`` is the router (``moe.router``); ``mlp.route_probe`` is the module
  ``tpcheck.engines.vllm.routes.attach_route_probes`` puts between the FusedMoE runner and its router's
  ``select_experts`` (call it before ``install``): ``moe.topk_weights`` / ``moe.topk_ids``, what the experts
  kernel receives; ``mlp.experts`` (the runner) gives the block's all-reduced output, ``mlp.out``. Not reported:
  ``moe.experts`` (the kernel returns only the weighted sum).
* Not reported: the KV cache (paged, engine-specific layout).""")

VLLM_NORMS_ONLY_MAP = replace(
    VLLM_MAP.without("layers.{prev}.out", "layers.{layer}.attn.residual", "layers.{last}.out"), name="vllm-norms-only",
    doc="VLLM_MAP less the residual points taken from a fused norm's second output (see VLLM_MAP).")

MAPS = {"impl": IMPL_MAP, "hf": HF_MAP, "hf-tp": HF_TP_MAP, "vllm": VLLM_MAP, "sglang": VLLM_MAP, "vllm-norms-only": VLLM_NORMS_ONLY_MAP}
