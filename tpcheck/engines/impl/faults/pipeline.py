"""Faults at pipeline-stage boundaries (``impl.pipeline``): what one stage hands the next, and what a stage does
that only the first or the last should. They need ``--pp`` >= 2 (``Fault.pp``). Each shows where the wrong
stage's work first meets the stream: what stage 0 hands over (``layers.{boundary}.handoff``, its last layer), the
first layer of stage 1 (``layers.{stage1}.*``, the stage-1 start of the run's partition), its KV cache, the logits,
or the first decode step's RoPE there."""
from __future__ import annotations

import torch
from torch import nn

from impl.context import get_context
from impl.layers.norm import RMSNorm
from impl.loader import load_weights
from impl.models.decoder import DecoderLayer
from tpcheck.engines.impl.faults.patching import mark, read_tensors
from tpcheck.engines.impl.faults.registry import fault


def _tied(cfg, plan, dtype) -> bool:
    return bool(cfg.tie_word_embeddings)


def _wrap_stage(runner, name: str, here: bool, wrap) -> None:
    """Where ``here`` (and not yet done), replace the stage's model forward with ``wrap(runner, forward)``."""
    m = runner.model.model
    if here and mark(m, name):
        m.forward = wrap(runner, m.forward)


def _wrap_stage_input(runner, name: str, edit) -> None:
    """On every stage after the first, pass the received ``IntermediateTensors`` and positions through
    ``edit(intermediate, positions) -> (intermediate, positions)`` before the stage's layers run."""
    def wrap(runner, prev):
        def forward(input_ids, positions, intermediate=None):
            intermediate, positions = edit(intermediate, positions)
            return prev(input_ids, positions, intermediate)
        return forward

    _wrap_stage(runner, name, not runner.stage.is_first, wrap)


@fault(46, "pp_residual_not_sent",
       "a stage after the first starts from hidden_states alone: the residual it should add is taken as zero",
       shows_when="pp >= 2", expected_origin="layers.{stage1}.input_norm", pp=2)
def pp_residual_not_sent(runner, i, layer):
    _wrap_stage_input(runner, "pp_residual_not_sent",
                      lambda inter, pos: ({**inter, "residual": torch.zeros_like(inter["residual"])}, pos))


@fault(47, "pp_final_norm_mid_stage",
       "a stage before the last applies the final norm to what it sends (as if it were the last stage)",
       shows_when="pp >= 2", expected_origin="layers.{boundary}.handoff", pp=2)
def pp_final_norm_mid_stage(runner, i, layer):
    _wrap_stage(runner, "pp_final_norm_mid_stage", not runner.stage.is_last, _normed_output)


def _normed_output(runner, prev):
    cfg = runner.cfg
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, runner.dtype).to(runner.device)
    norm.weight.data.copy_(read_tensors(runner, ["model.norm.weight"])["model.norm.weight"])

    def forward(input_ids, positions, intermediate=None):
        out = prev(input_ids, positions, intermediate)
        h = norm(out["residual"] + out["hidden_states"])
        return {"hidden_states": h, "residual": torch.zeros_like(h)}
    return forward


@fault(48, "pp_lm_head_untied",
       "tied embeddings: the last stage's LM head is not loaded from the embedding (left zero)",
       shows_when="pp >= 2 and tied embeddings", expected_origin="logits", pp=2, shows=_tied)
def pp_lm_head_untied(runner, i, layer):
    head = runner.model.lm_head
    if not runner.stage.is_last or runner.stage.is_first or not mark(head, "pp_lm_head_untied"):
        return
    head.weight.data.zero_()


def _stage_relative(inter, positions):
    """Positions rebuilt from the step's tokens alone: 0 .. n-1 per sequence (right at a prefill from 0)."""
    ctx = get_context()
    return inter, torch.cat([torch.arange(n, device=positions.device) for n in ctx.seq_lens_q])


@fault(49, "pp_stage_relative_positions",
       "a stage after the first rebuilds the position ids from the tokens of the step (0 .. n-1 per sequence) "
       "instead of receiving them",
       shows_when="pp >= 2, decode (a step not starting at position 0)",
       expected_origin="layers.{stage1}.attn.q_rope", pp=2, decode_only=True, origin_step="decode")
def pp_stage_relative_positions(runner, i, layer):
    _wrap_stage_input(runner, "pp_stage_relative_positions", _stage_relative)


def _boundary_layer(runner) -> DecoderLayer:
    """A second copy of the previous stage's last layer (``stage.start - 1``), loaded from the checkpoint, with
    its own KV cache of this stage's layout."""
    cfg, b = runner.cfg, runner.stage.start - 1
    model = runner.model
    copy = DecoderLayer(cfg, b, runner.dtype, model.attention_cls, model.ep_size).to(runner.device)
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleDict({str(b): copy})
    holder.cfg, holder.packed_modules_mapping = cfg, model.packed_modules_mapping
    holder.holds_tensor = lambda name: name.startswith(f"model.layers.{b}.")
    load_weights(holder, cfg.model_dir, runner.dtype)
    like = runner.attention_layers()[0]
    copy.self_attn.attn.k_cache = torch.zeros_like(like.k_cache)
    copy.self_attn.attn.v_cache = torch.zeros_like(like.v_cache)
    return copy


@fault(50, "pp_boundary_layer_twice",
       "an off-by-one partition: a stage after the first also runs the previous stage's last layer on what it "
       "received (that layer applied twice)",
       shows_when="pp >= 2", expected_origin="layers.{stage1}.input_norm", pp=2)
def pp_boundary_layer_twice(runner, i, layer):
    _wrap_stage(runner, "pp_boundary_layer_twice", not runner.stage.is_first, _boundary_twice)


def _boundary_twice(runner, prev):
    copy = _boundary_layer(runner)

    def forward(input_ids, positions, intermediate=None):
        h = copy(positions, intermediate["residual"] + intermediate["hidden_states"])
        return prev(input_ids, positions, {"hidden_states": h, "residual": torch.zeros_like(h)})
    return forward


@fault(51, "pp_kv_global_layer_id",
       "a stage after the first writes each layer's keys and values into its cache list at the layer's global id "
       "(the list holds the stage's layers by stage-relative index; attention reads its own entry)",
       shows_when="pp >= 2, decode (the cache read back)", expected_origin="layers.{stage1}.kv.k", pp=2,
       decode_only=True)
def pp_kv_global_layer_id(runner, i, layer):
    if runner.stage.is_first:
        return
    spare: dict = {}  # the list's entries past the stage's own layers: written, never read

    def entry(index: int):
        """Entry ``index`` of the stage's cache list as allocated now: stage-relative index j is the cache of
        layer ``start + j``; past the stage's layers, a spare pair of the same layout."""
        own = runner.attention_layers()
        if index < len(own):
            return own[index].k_cache, own[index].v_cache
        like = own[0].k_cache
        if index not in spare or spare[index][0].shape != like.shape:
            spare[index] = (torch.zeros_like(like), torch.zeros_like(like))
        return spare[index]

    for g in range(runner.stage.start, runner.stage.end):
        attn = runner.model.model.layers[g].self_attn.attn
        if mark(attn, "pp_kv_global_layer_id"):
            attn.forward = _write_at(attn, attn.forward, lambda g=g: entry(g))


def _write_at(attn, prev, target):
    """``attn``'s forward storing the step's keys and values into ``target()``'s caches instead of its own, then
    attending as before over its own (the store suppressed there)."""
    def forward(q, k, v):
        ctx = get_context()
        slots = ctx.slot_mapping
        if slots is not None and attn.k_cache.numel():
            kc, vc = target()
            kc.view(-1, attn.num_kv_heads, attn.head_dim)[slots] = k
            vc.view(-1, attn.num_kv_heads, attn.head_dim)[slots] = v
        ctx.slot_mapping = None
        try:
            return prev(q, k, v)
        finally:
            ctx.slot_mapping = slots
    return forward
