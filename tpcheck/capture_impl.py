"""The impl side of the adapter, run inside each TP rank through ``LLM.call(capture_impl.step, ...)``.

Hooks read each module's declared ``output_placement``; points captured from a module's *input* take
the placement of the module that produced it (o_proj's input is the attention's ``Shard(-1)``, down_proj's
input the activation's ``Shard(-1)``, norms' inputs the replicated residual stream). A fused output
(``qkv``, ``gate_up``) is returned whole with its ``Fused`` placement, named with a trailing dot
(``layers.0.attn.``): the harness splits it into ``layers.0.attn.q`` etc. Returned tensors are
``[rows, features]`` on CPU, in the engine's dtype."""
from __future__ import annotations

import torch

from impl.placements import Replicate, Shard

_STATE = "_tpcheck"


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(t.shape[0], -1).to("cpu", copy=True)


def setup(runner, num_blocks: int, block_size: int) -> None:
    """Allocate a KV cache of the given layout and install the capture hooks (once per loaded model)."""
    runner.allocate_kv_cache(num_blocks, block_size)
    if getattr(runner.model, _STATE, None) is not None:
        return
    st = {"points": None, "teacher": None}
    setattr(runner.model, _STATE, st)
    m = runner.model.model

    def put(name, placement, t):
        if st["points"] is not None and t is not None:
            st["points"][name] = (placement, _flat(t))

    def out(name, placement=None):
        return lambda mod, args, o: put(name, placement or mod.output_placement, o)

    def pre(name, placement):
        return lambda mod, args: put(name, placement, args[0])

    def teach(i):
        def hook(mod, args):
            if st["teacher"] is None:
                return None
            x = st["teacher"][i].to(dtype=runner.dtype, device=runner.device)
            return (args[0], x) if len(args) == 2 else (x,)
        return hook

    def rope(p, kv):  # Attention's inputs: q and k after RoPE
        def hook(mod, args):
            put(p + "attn.q_rope", Shard(-1), args[0])
            put(p + "attn.k_rope", kv, args[1])
        return hook

    m.embed_tokens.register_forward_hook(out("embed"))
    for i, layer in enumerate(m.layers):
        p, a, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
        kv = Shard(-1, a.qkv_proj.kv_replicas)
        layer.register_forward_pre_hook(teach(i))
        layer.input_layernorm.register_forward_hook(out(p + "input_norm"))
        a.qkv_proj.register_forward_hook(out(p + "attn."))
        a.attn.register_forward_pre_hook(rope(p, kv))
        a.o_proj.register_forward_pre_hook(pre(p + "attn.context", a.attn.output_placement))
        a.o_proj.register_forward_hook(out(p + "attn.out"))
        layer.post_attention_layernorm.register_forward_pre_hook(pre(p + "attn.residual", Replicate()))
        layer.post_attention_layernorm.register_forward_hook(out(p + "post_attn_norm"))
        mlp.gate_up_proj.register_forward_hook(out(p + "mlp."))
        mlp.down_proj.register_forward_pre_hook(pre(p + "mlp.act", mlp.act_fn.output_placement))
        mlp.down_proj.register_forward_hook(out(p + "mlp.out"))
        layer.register_forward_hook(out(p + "out", Replicate()))
    m.norm.register_forward_pre_hook(teach(len(m.layers)))
    m.norm.register_forward_hook(out("final_norm"))
    # the LM head's forward returns the gathered logits on rank 0 only (None elsewhere): Replicate on rank 0
    runner.model.lm_head.register_forward_hook(out("logits", Replicate()))


def step(runner, batch, teacher: dict | None = None, kv_lens: list[int] | None = None) -> dict:
    """Run one step (``ModelRunner.step`` with every token's logits) and return its points
    ``{name: (placement, tensor)}``; with ``kv_lens``, also each layer's cache contents for every prompt."""
    st = getattr(runner.model, _STATE)
    st["points"], st["teacher"] = {}, teacher
    try:
        runner.step(batch, all_logits=True)
        points = st["points"]
    finally:
        st["points"] = st["teacher"] = None
    if kv_lens is not None:
        points.update(read_kv(runner, [table for _, _, table in batch], kv_lens))
    return points


def read_kv(runner, tables: list[list[int]], lens: list[int]) -> dict:
    """Each layer's cached keys/values of every prompt, read back from the paged blocks."""
    from impl.layers.attention import block_slots
    out = {}
    for i, layer in enumerate(runner.model.model.layers):
        attn = layer.self_attn.attn
        kv = Shard(-1, layer.self_attn.qkv_proj.kv_replicas)
        bs = attn.k_cache.shape[1]
        heads = attn.k_cache.shape[2]  # what the cache actually holds (a faulty cache may hold more heads)
        slots = torch.cat([block_slots(torch.tensor([t]), bs, n)[0] for t, n in zip(tables, lens)])
        for name, cache in (("k", attn.k_cache), ("v", attn.v_cache)):
            out[f"layers.{i}.kv.{name}"] = (kv, _flat(cache.view(-1, heads, cache.shape[3])[slots]))
    return out
