"""Named, injectable tensor-parallel bugs, applied inside the rank workers of a live impl engine.

Each fault reproduces a bug that a TP implementation really makes (review notes on real TP engines and vLLM's history):
the harness injects it into a correct engine and checks that the layer-by-layer diff finds it, and finds it
where the bug is (``Fault.expected_origin``: the first canonical point whose value differs from a correct
engine).

Use from the driver::

    llm.call("tpcheck.faults:apply", ["rope_skipped"], 1)   # every rank, decoder layer 1 only
    llm.call("tpcheck.faults:apply", ["gate_up_swapped"])   # every decoder layer
    ...
    llm.load(llm.model_dir)                                 # undo: recreates every rank's runner

or ``inject(llm, names, layer)`` (the same call, and it also drops the driver's prefix cache, whose blocks
the clean model computed), or ``with injected(llm, ["rope_skipped"], layer=1): ...``, which restores the
engine on exit.

``apply`` mutates the rank's already-loaded model in place: parameters (load-time bugs re-read the
checkpoint tensors they need from ``runner.cfg.model_dir`` and rewrite the rank's shard, through the
layers' own ``weight_loader`` at most, never ``impl.loader`` again) or per-instance method overrides
(``module.forward = ...``) on the chosen modules only. impl's classes and files are never touched, so
other engines and other layers stay correct. There is no "un-apply": reload the runner (``LLM.load``
recreates it) to get a clean engine back. Every modified module is marked with ``_tpcheck_faults`` (a
list of fault names); ``describe`` reports the marks.

Applying a fault twice to the same module is a no-op (a swap applied twice would otherwise undo itself).
Faults compose: several may be applied to the same engine and layer.

Choices and blind spots:

* ``full_state_dict_every_rank`` is a memory fault (``Fault.check == "memory"``): the numerics are
  unchanged and ``tpcheck diff`` passes; ``tpcheck.fault_matrix.rank_memory`` (tensor bytes each rank
  holds against its share of the checkpoint) flags it.
* ``vocab_ids_not_masked`` is the variant of "vocab padding / out-of-shard ids" that shows numerically (at
  ``embed``, tp > 1). Padding rows left uninitialised cannot show in impl: no token id selects a padding
  row of the embedding, and the LM head strips the padding columns before anything sees the logits.
* "QKVParallelLinear output size pre-multiplied by tp" is not a fault of its own: ``(H/tp + 2*K_local) * tp *
  head_dim`` is how vLLM's QKVParallelLinear (and impl's) states its width, so that KV replicas count; the
  review's point is readability. A width that did not cancel out would give each rank a weight of the
  wrong shape, which the weight loader refuses at load time with an error naming the tensor and both shapes.
  The QKV bug that shows in the numbers is the dim-1 shard (``qkv_shard_dim1``).
* ``rope_wrong_layout`` rotates interleaved pairs (GPT-J) instead of halves (neox). The other
  wrong layout, cos/sin broadcast over the heads axis instead of the tokens axis, only runs when the
  token count equals the head count (or is 1), so it is not a fault here.
* ``rmsnorm_weight_before_cast`` rounds once where HF rounds twice: the engine gets *closer* to the float64
  golden than HF at the same dtype, so the noise-floor gate cannot flag it (0.27x its threshold);
  ``tpcheck diff --exact-ops`` does (``tpcheck.exact_ops``: HF's RMSNorm on the engine's own input gives
  other bits).
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from impl.config import ConfigError, ModelConfig
from impl.context import get_context
from impl.distributed import all_reduce
from impl.layers.attention import block_slots

MARK = "_tpcheck_faults"
DEFAULT_ROPE_THETA = 10000.0     # what a config reader falls back to when it misses rope_theta
LOW_PRECISION_REDUCE = torch.bfloat16


# ---- configuration arithmetic (mirrors QKVParallelLinear) ---------------------------------------------

def _tp_ok(cfg: ModelConfig, tp: int) -> bool:
    try:
        cfg.check_tp(tp)
    except ConfigError:
        return False
    return True


def heads_local(cfg: ModelConfig, tp: int) -> int:
    return cfg.num_heads // tp


def kv_heads_local(cfg: ModelConfig, tp: int) -> int:
    return cfg.num_kv_heads // tp if tp <= cfg.num_kv_heads else 1


# ---- the registry -------------------------------------------------------------------------------------

# (predicates are module-level functions so that a Fault pickles: it may travel to a worker)

def _always(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return True


def _tp_gt_1(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return tp > 1


def _dim1_shardable(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return tp > 1 and cfg.hidden_size % tp == 0


def _kv_heads_repeatable(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return heads_local(cfg, tp) > kv_heads_local(cfg, tp)


def _kv_replicated_multi(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return tp > cfg.num_kv_heads > 1


def _tied(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return cfg.tie_word_embeddings


def _half_precision(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return dtype in ("bfloat16", "float16")


def _rope_theta_not_default(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return cfg.rope_theta != DEFAULT_ROPE_THETA


def _tp_gt_1_float32(cfg: ModelConfig, tp: int, dtype: str) -> bool:
    return tp > 1 and dtype == "float32"


@dataclass(frozen=True)
class Fault:
    """A named TP bug. ``applies(cfg, tp, dtype)``: whether it can show in that configuration;
    ``origin(layer)``: where a layer-by-layer diff must place its origin."""

    name: str
    description: str        # one line
    shows_when: str         # human text: "tp > 1", "always", ...
    expected_origin: str    # canonical point, a template with {layer} for per-layer faults
    decode_only: bool = False
    predicate: Callable[[ModelConfig, int, str], bool] = field(default=_always, repr=False, compare=False)
    # which check catches it: "diff" (the layer-by-layer numerics) or "memory" (per-rank memory figures;
    # the numerics are unchanged, so ``tpcheck diff`` passes and ``expected_origin`` is "memory")
    check: str = "diff"
    # the step of the expected origin: "prefill" (step 0), "decode" (the first decode step, 1) or
    # "block_boundary" (the first decode step whose position is a multiple of the KV block size)
    origin_step: str = "prefill"
    # as accurate as HF at the dtype: only ``tpcheck diff --exact-ops`` sees it
    needs_exact_ops: bool = False

    @property
    def per_layer(self) -> bool:
        """Whether the fault acts on decoder layers (and ``apply``'s ``layer`` selects one)."""
        return "{layer}" in self.expected_origin

    def origin(self, layer: int | None = None) -> str:
        """The expected origin for a fault applied to ``layer`` (None: all layers, so the first, 0)."""
        return self.expected_origin.format(layer=0 if layer is None else layer)

    def applies(self, cfg: ModelConfig, tp: int, dtype: str = "float32") -> bool:
        """Whether the fault can show at all with this model, TP size and dtype (False where the TP size
        cannot split the model)."""
        return _tp_ok(cfg, tp) and bool(self.predicate(cfg, tp, dtype))

    def silent_because(self, cfg: ModelConfig, tp: int, dtype: str, decode_steps: int, exact_ops: bool) -> str | None:
        """Why a ``tpcheck diff`` of this configuration cannot fail on this fault (None: it should fail)."""
        if not self.applies(cfg, tp, dtype):
            return f"cannot show at tp {tp} in {dtype} with this model (shows: {self.shows_when})"
        if self.decode_only and decode_steps == 0:
            return "shows only while decoding, and --decode-steps is 0"
        if self.check == "memory":
            return "changes memory, not numbers (`tpcheck faults matrix` runs its memory check)"
        if self.needs_exact_ops and not exact_ops:
            return "is as accurate as HF at the dtype: only --exact-ops sees it"
        return None


_FAULT_LIST = [
    Fault("nan_causal_mask",
          "causal mask built as triu(ones, 1) * -inf and added to the scores: 0 * -inf = NaN everywhere",
          "always (a prefill of >= 2 tokens)", "layers.{layer}.attn.context"),
    Fault("qkv_shard_dim1",
          "q/k/v weights sharded along dim 1 (in_features) instead of dim 0, reshaped to the local shape",
          "tp > 1", "layers.{layer}.attn.q",
          predicate=_dim1_shardable),
    Fault("rope_skipped",
          "RoPE not applied: rotary_emb returns q and k unchanged",
          "always (any position > 0)", "layers.{layer}.attn.q_rope"),
    Fault("qkv_bias_missing",
          "q/k/v projection biases not loaded (left at zero)",
          "always", "layers.{layer}.attn.q"),
    Fault("gqa_cache_repeated_heads",
          "KV cache stores K/V heads repeated to the local query-head count (numerically harmless, "
          "heads/kv_heads times the memory)",
          "decode (KV cache in use), where local query heads > local KV heads", "layers.{layer}.kv.k",
          decode_only=True,
          predicate=_kv_heads_repeatable),
    Fault("kv_replica_index",
          "replicated KV head index computed as tp_rank % num_kv_heads instead of tp_rank // replicas",
          "KV replication (tp > num_kv_heads) with num_kv_heads > 1", "layers.{layer}.attn.k",
          predicate=_kv_replicated_multi),
    Fault("row_bias_every_rank",
          "row-parallel (o_proj) bias added by every rank before the all-reduce instead of once",
          "tp > 1", "layers.{layer}.attn.out",
          predicate=_tp_gt_1),
    Fault("gate_up_swapped",
          "gate and up halves of the fused gate_up_proj swapped",
          "always", "layers.{layer}.mlp.gate"),
    Fault("skip_o_proj_allreduce",
          "all-reduce after o_proj skipped: each rank keeps its partial sum (ranks disagree on a replicated tensor)",
          "tp > 1", "layers.{layer}.attn.out",
          predicate=_tp_gt_1),
    Fault("decode_position_off_by_one",
          "decode steps pass position p + 1 instead of p to RoPE",
          "decode only", "layers.{layer}.attn.q_rope", decode_only=True, origin_step="decode"),
    Fault("untied_lm_head",
          "tied lm_head not tied (AutoModel fallback): the head is a fresh N(0, 0.02) tensor, not the embedding",
          "tied checkpoints (tie_word_embeddings)", "logits",
          predicate=_tied),
    Fault("rope_wrong_layout",
          "RoPE rotates interleaved pairs (GPT-J: x[2i], x[2i+1]) where Qwen2 rotates halves (neox: x[i], x[i+d/2])",
          "always (any position > 0)", "layers.{layer}.attn.q_rope"),
    Fault("full_state_dict_every_rank",
          "every rank also materialises the whole checkpoint state dict and keeps it (numerics unchanged)",
          "memory figures only, tp > 1: a rank holds >= the full checkpoint instead of its ~1/tp share; "
          "tpcheck diff passes", "memory",
          predicate=_tp_gt_1, check="memory"),
    Fault("vocab_ids_not_masked",
          "vocab-parallel embedding does not zero ids outside the rank's vocab range: each rank adds its row 0",
          "tp > 1", "embed",
          predicate=_tp_gt_1),
    Fault("every_rank_loads_rank0_shard",
          "every rank loads rank 0's slice of the layer's sharded weights (q/k/v, o_proj, gate/up, down): "
          "the weight loader narrows at offset 0 instead of tp_rank * size",
          "tp > 1", "layers.{layer}.attn.q",
          predicate=_tp_gt_1),
    Fault("rmsnorm_weight_before_cast",
          "RMSNorm multiplies by its weight in float32 and casts back after (HF casts back, then multiplies)",
          "half precision only (bfloat16, float16), and only with --exact-ops: it is closer to float64 than HF, "
          "so the noise-floor gate passes it", "layers.{layer}.input_norm",
          predicate=_half_precision, needs_exact_ops=True),
    Fault("rope_theta_default",
          "rope_theta silently defaulted to 10000 when the checkpoint's config says otherwise",
          "checkpoints with rope_theta != 10000 (any position > 0)", "layers.{layer}.attn.q_rope",
          predicate=_rope_theta_not_default),
    Fault("slot_mapping_off_by_one_at_block_boundary",
          "a decode token that opens a new KV block is written one slot early, over the previous token's "
          "K/V, leaving its own slot empty",
          "decode only, when a sequence crosses a block boundary", "layers.{layer}.kv.k",
          decode_only=True, origin_step="block_boundary"),
    Fault("allreduce_low_precision",
          "the o_proj and down_proj all-reduces run in bfloat16 while the activations are float32",
          "tp > 1 with float32 activations", "layers.{layer}.attn.out",
          predicate=_tp_gt_1_float32),
]
FAULTS: dict[str, Fault] = {f.name: f for f in _FAULT_LIST}
assert len(FAULTS) == len(_FAULT_LIST), "duplicate fault names"


def fault_names() -> list[str]:
    return list(FAULTS)


def get_fault(name: str) -> Fault:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    return FAULTS[name]


def applicable(cfg: ModelConfig, tp: int, dtype: str = "float32") -> list[str]:
    """Names of the faults that can show in this configuration."""
    return [n for n, f in FAULTS.items() if f.applies(cfg, tp, dtype)]


# ---- helpers run inside a rank -------------------------------------------------------------------------

def _mark(module: nn.Module, name: str) -> bool:
    """Record ``name`` on ``module``; False if it was already there (the fault is not applied twice)."""
    marks = module.__dict__.setdefault(MARK, [])
    if name in marks:
        return False
    marks.append(name)
    return True


def _read_tensors(runner, names: list[str]) -> dict[str, torch.Tensor]:
    """Full checkpoint tensors by name, cast to the runner's dtype."""
    from impl.loader import checkpoint_files
    want, out = set(names), {}
    for fname, in_file in checkpoint_files(runner.cfg.model_dir).items():
        hits = want.intersection(in_file)
        if hits:
            with safe_open(fname, framework="pt") as f:
                for n in hits:
                    out[n] = f.get_tensor(n).to(runner.dtype)
    missing = want - set(out)
    if missing:
        raise ValueError(f"checkpoint {runner.cfg.model_dir} lacks {sorted(missing)}")
    return out


def _seeded_randn(shape, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


# ---- the faults, one function each: (runner, layer index, decoder layer) -------------------------------

def _nan_mask_prefill(self, q, k, v, ctx):
    """``Attention._prefill`` with an explicit softmax and an additive ``triu(ones) * -inf`` mask."""
    out = torch.empty_like(q)
    start = 0
    for i, (lq, lk) in enumerate(zip(ctx.seq_lens_q, ctx.seq_lens_k)):
        qs = q[start:start + lq]
        if ctx.block_tables is None:
            ks, vs = k[start:start + lq], v[start:start + lq]
        else:
            slots = block_slots(ctx.block_tables[i:i + 1], self.k_cache.shape[1], lk)[0]
            ks = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
            vs = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)[slots]
        rep = self.num_heads // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * self.scale
        if lq > 1:
            mask = torch.triu(torch.ones(lq, lk, device=q.device), diagonal=1 + lk - lq) * float("-inf")
            scores = scores + mask  # the bug: the zeros below the diagonal become NaN
        out[start:start + lq] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs.float()).to(q.dtype)
        start += lq
    return out


def _f_nan_causal_mask(runner, i, layer):
    attn = layer.self_attn.attn
    if _mark(attn, "nan_causal_mask"):
        attn._prefill = types.MethodType(_nan_mask_prefill, attn)


@torch.no_grad()
def _f_qkv_shard_dim1(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if not _mark(qkv, "qkv_shard_dim1"):
        return
    p = f"model.layers.{i}.self_attn."
    w = _read_tensors(runner, [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"])
    hidden = qkv.weight.shape[1]
    # q is split tp ways; k/v over the distinct KV shards (tp, or num_kv_heads when replicated)
    parts = {"q": (qkv.tp_size, qkv.tp_rank), "k": (qkv.tp_size // qkv.kv_replicas, qkv.tp_rank // qkv.kv_replicas)}
    parts["v"] = parts["k"]
    offsets = {"q": (0, qkv.q_size), "k": (qkv.q_size, qkv.kv_size), "v": (qkv.q_size + qkv.kv_size, qkv.kv_size)}
    for s in ("q", "k", "v"):
        n, r = parts[s]
        if hidden % n:
            raise ValueError(f"qkv_shard_dim1: hidden_size {hidden} is not divisible by {n}")
        cols = hidden // n
        off, rows = offsets[s]
        full = w[f"{p}{s}_proj.weight"]
        qkv.weight.data[off:off + rows].copy_(full[:, r * cols:(r + 1) * cols].reshape(rows, hidden))


def _no_rope(positions, q, k):
    return q, k


def _f_rope_skipped(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if _mark(rot, "rope_skipped"):
        rot.forward = _no_rope


@torch.no_grad()
def _f_qkv_bias_missing(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if _mark(qkv, "qkv_bias_missing"):
        qkv.bias.data.zero_()


def _f_gqa_cache_repeated_heads(runner, i, layer):
    attn = layer.self_attn.attn
    rep = attn.num_heads // attn.num_kv_heads
    if rep <= 1 or not _mark(attn, "gqa_cache_repeated_heads"):
        return  # nothing to repeat (MHA, or one query head per KV head on this rank)
    prev = attn.forward
    attn._tpcheck_kv_repeat = rep

    def forward(q, k, v):
        return prev(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))

    attn.num_kv_heads = attn.num_heads  # cache writes and decode reads now view the repeated heads
    attn.forward = forward
    if not getattr(runner, "_tpcheck_alloc_patched", False):
        prev_alloc = runner.allocate_kv_cache

        def allocate_kv_cache(num_blocks, block_size):
            prev_alloc(num_blocks, block_size)
            for a in runner.attention_layers():
                if getattr(a, "_tpcheck_kv_repeat", 1) > 1:
                    shape = (num_blocks, block_size, a.num_heads, a.head_dim)
                    a.k_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
                    a.v_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)

        runner.allocate_kv_cache = allocate_kv_cache
        runner._tpcheck_alloc_patched = True
    # re-allocate now with the current layout (the engine allocated its cache at load)
    k0 = runner.attention_layers()[0].k_cache
    if k0.dim() == 4 and k0.numel():
        runner.allocate_kv_cache(*k0.shape[:2])


def _init_row_parallel(m) -> None:
    """An instance ``forward`` for a row-parallel layer (o_proj, down_proj) whose behaviour the row-parallel
    faults switch on through attributes."""
    if "forward" in m.__dict__:
        return

    def forward(x):
        y = F.linear(x, m.weight, m.bias if m.tp_rank == 0 else None)
        extra = getattr(m, "_tpcheck_extra_bias", None)
        if extra is not None and m.tp_rank > 0:  # the bug adds b on every rank; rank 0's copy is the
            y = y + extra                        # correct one, so only the extra copies are added
        if getattr(m, "_tpcheck_skip_allreduce", False):
            return y
        low = getattr(m, "_tpcheck_reduce_dtype", None)
        if low is not None and low != y.dtype:  # partial sums rounded to, and summed in, the lower precision
            return all_reduce(y.to(low)).to(y.dtype)
        return all_reduce(y)

    m.forward = forward


def _f_row_bias_every_rank(runner, i, layer):
    o = layer.self_attn.o_proj
    if _mark(o, "row_bias_every_rank"):
        # Qwen2's o_proj has no bias: a fixed b (zero for a correct engine) that every rank adds
        o._tpcheck_extra_bias = _seeded_randn((o.output_size,), 1000 + i, o.weight.dtype, o.weight.device) * 0.1
        _init_row_parallel(o)


def _f_skip_o_proj_allreduce(runner, i, layer):
    o = layer.self_attn.o_proj
    if _mark(o, "skip_o_proj_allreduce"):
        o._tpcheck_skip_allreduce = True
        _init_row_parallel(o)


@torch.no_grad()
def _f_gate_up_swapped(runner, i, layer):
    gu = layer.mlp.gate_up_proj
    if _mark(gu, "gate_up_swapped"):
        n = gu.weight.shape[0] // 2
        gu.weight.data.copy_(torch.cat([gu.weight.data[n:], gu.weight.data[:n]]))


def _f_decode_position_off_by_one(runner, i, layer):
    sa = layer.self_attn
    if not _mark(sa, "decode_position_off_by_one"):
        return
    prev = sa.forward

    def forward(positions, x):
        if get_context().is_decode:
            positions = positions + 1
        return prev(positions, x)

    sa.forward = forward


@torch.no_grad()
def _f_untied_lm_head(runner, i, layer):
    model = runner.model
    if not runner.cfg.tie_word_embeddings or not _mark(model.lm_head, "untied_lm_head"):
        return
    head = model.lm_head
    old = head.weight
    # the same full matrix on every TP size: rank r keeps its vocab rows; padding rows stay zero
    full = _seeded_randn((head.padded_size, old.shape[1]), 2024, old.dtype, old.device) * 0.02
    full[head.vocab_size:] = 0
    head.weight = nn.Parameter(full[head.start:head.end].clone(), requires_grad=False)


@torch.no_grad()
def _f_kv_replica_index(runner, i, layer):
    qkv = layer.self_attn.qkv_proj
    if qkv.kv_replicas == 1 or not _mark(qkv, "kv_replica_index"):
        return  # KV heads partitioned: no replica index to get wrong
    total_kv = runner.cfg.num_kv_heads
    head = qkv.tp_rank % total_kv  # the bug; correct: tp_rank // kv_replicas
    p = f"model.layers.{i}.self_attn."
    names = [p + f"{s}_proj.{t}" for s in ("k", "v") for t in ("weight", "bias")]
    w = _read_tensors(runner, names)
    d = qkv.kv_size  # one KV head per rank under replication
    for s, off in (("k", qkv.q_size), ("v", qkv.q_size + qkv.kv_size)):
        qkv.weight.data[off:off + d].copy_(w[f"{p}{s}_proj.weight"][head * d:(head + 1) * d])
        qkv.bias.data[off:off + d].copy_(w[f"{p}{s}_proj.bias"][head * d:(head + 1) * d])


def _rope_interleaved(rot):
    """``RotaryEmbedding.forward`` in the GPT-J layout: pairs (x[2i], x[2i+1]) rotated by angle i."""

    def forward(positions, q, k):
        freqs = positions.to(torch.float32)[:, None] * rot.inv_freq.to(torch.float32)[None, :]  # [T, d/2]
        cos, sin = freqs.cos().to(q.dtype)[:, None, :], freqs.sin().to(q.dtype)[:, None, :]

        def rotate(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

        return rotate(q), rotate(k)

    return forward


def _f_rope_wrong_layout(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if _mark(rot, "rope_wrong_layout"):
        rot.forward = _rope_interleaved(rot)


def _f_full_state_dict_every_rank(runner, i, layer):
    from safetensors.torch import load_file

    from impl.loader import checkpoint_files
    if getattr(runner, "_tpcheck_full_state", None) is None:
        state: dict[str, torch.Tensor] = {}
        for fname in checkpoint_files(runner.cfg.model_dir):
            state.update({n: t.to(runner.dtype) for n, t in load_file(fname).items()})
        runner._tpcheck_full_state = state  # kept referenced for the runner's lifetime, as the bug does


def _f_vocab_ids_not_masked(runner, i, layer):
    emb = runner.model.model.embed_tokens
    if emb.tp_size == 1 or not _mark(emb, "vocab_ids_not_masked"):
        return  # one rank owns every id: nothing to mask

    def forward(ids):
        mine = (ids >= emb.start) & (ids < emb.end)
        # the bug: out.masked_fill(~mine[..., None], 0) is missing, so foreign ids contribute local row 0
        return all_reduce(F.embedding(torch.where(mine, ids - emb.start, 0), emb.weight))

    emb.forward = forward


@torch.no_grad()
def _f_every_rank_loads_rank0_shard(runner, i, layer):
    sa, mlp = layer.self_attn, layer.mlp
    p = f"model.layers.{i}."
    targets = [(sa.qkv_proj, f"self_attn.{s}_proj", s) for s in ("q", "k", "v")]
    targets += [(sa.o_proj, "self_attn.o_proj", None), (mlp.gate_up_proj, "mlp.gate_proj", 0),
                (mlp.gate_up_proj, "mlp.up_proj", 1), (mlp.down_proj, "mlp.down_proj", None)]
    if not _mark(sa.qkv_proj, "every_rank_loads_rank0_shard"):
        return
    for m in (sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
        _mark(m, "every_rank_loads_rank0_shard")
    names = [p + f"{hf}.{t}" for m, hf, _ in targets for t in ("weight", "bias") if getattr(m, t) is not None]
    full = _read_tensors(runner, names)
    for m, hf, sid in targets:
        rank = m.tp_rank
        m.tp_rank = 0  # the layer's own weight loader, narrowing at rank 0's offset
        try:
            for t in ("weight", "bias"):
                param = getattr(m, t)
                if param is not None:
                    m.weight_loader(param, full[p + f"{hf}.{t}"], sid)
        finally:
            m.tp_rank = rank


def _norm_weight_before_cast(norm):
    def forward(x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (norm.weight * h).to(dtype)  # HF: norm.weight * h.to(dtype)

    return forward


def _f_rmsnorm_weight_before_cast(runner, i, layer):
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if _mark(norm, "rmsnorm_weight_before_cast"):
            norm.forward = _norm_weight_before_cast(norm)


def _f_rope_theta_default(runner, i, layer):
    rot = layer.self_attn.rotary_emb
    if _mark(rot, "rope_theta_default"):
        d = rot.head_dim
        rot.inv_freq = 1.0 / (DEFAULT_ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)).to(
            rot.inv_freq.device)


def _f_slot_mapping_off_by_one(runner, i, layer):
    attn = layer.self_attn.attn
    if not _mark(attn, "slot_mapping_off_by_one_at_block_boundary"):
        return
    prev = attn.forward

    def forward(q, k, v):
        ctx = get_context()
        if not ctx.is_decode or ctx.slot_mapping is None or not attn.k_cache.numel():
            return prev(q, k, v)
        bs = attn.k_cache.shape[1]
        pos = torch.tensor(ctx.seq_lens_k, device=ctx.slot_mapping.device) - 1  # one new token per sequence
        opens_block = (pos % bs == 0) & (pos > 0)
        good = ctx.slot_mapping
        ctx.slot_mapping = good - opens_block.to(good.dtype)  # the bug: one slot short at the boundary
        try:
            return prev(q, k, v)
        finally:
            ctx.slot_mapping = good

    attn.forward = forward


def _f_allreduce_low_precision(runner, i, layer):
    for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
        if _mark(m, "allreduce_low_precision"):
            m._tpcheck_reduce_dtype = LOW_PRECISION_REDUCE
            _init_row_parallel(m)


_APPLY: dict[str, Callable] = {
    "nan_causal_mask": _f_nan_causal_mask,
    "qkv_shard_dim1": _f_qkv_shard_dim1,
    "rope_skipped": _f_rope_skipped,
    "qkv_bias_missing": _f_qkv_bias_missing,
    "gqa_cache_repeated_heads": _f_gqa_cache_repeated_heads,
    "kv_replica_index": _f_kv_replica_index,
    "row_bias_every_rank": _f_row_bias_every_rank,
    "gate_up_swapped": _f_gate_up_swapped,
    "skip_o_proj_allreduce": _f_skip_o_proj_allreduce,
    "decode_position_off_by_one": _f_decode_position_off_by_one,
    "untied_lm_head": _f_untied_lm_head,
    "rope_wrong_layout": _f_rope_wrong_layout,
    "full_state_dict_every_rank": _f_full_state_dict_every_rank,
    "vocab_ids_not_masked": _f_vocab_ids_not_masked,
    "every_rank_loads_rank0_shard": _f_every_rank_loads_rank0_shard,
    "rmsnorm_weight_before_cast": _f_rmsnorm_weight_before_cast,
    "rope_theta_default": _f_rope_theta_default,
    "slot_mapping_off_by_one_at_block_boundary": _f_slot_mapping_off_by_one,
    "allreduce_low_precision": _f_allreduce_low_precision,
}


assert set(_APPLY) == set(FAULTS)


# ---- worker-side entry points (through LLM.call) -------------------------------------------------------

def apply(runner, names: list[str] | str, layer: int | None = None) -> list[str]:
    """Inject faults into this rank's loaded model: every decoder layer (``layer`` None) or only
    ``runner.model.model.layers[layer]``; layer-independent faults ignore ``layer``. Returns the names
    applied. Run on every rank: ``llm.call("tpcheck.faults:apply", ["rope_skipped"], 1)``.
    Undo by reloading the runner (``llm.load(llm.model_dir)``).

    The driver's prefix cache is not the rank's to clear: after a plain ``llm.call`` a request sharing a
    full block with an earlier one reuses KV the clean model wrote (for ``gqa_cache_repeated_heads``,
    zeros: the cache is re-allocated). ``inject`` / ``injected`` reset it; use them for ``generate``."""
    names = [names] if isinstance(names, str) else list(names)
    faults = [get_fault(n) for n in names]  # validate all before touching anything
    layers = runner.model.model.layers
    if layer is not None and not -len(layers) <= layer < len(layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(layers)} decoder layers")
    idx = list(range(len(layers))) if layer is None else [layer % len(layers)]
    for f in faults:
        if f.per_layer:
            for i in idx:
                _APPLY[f.name](runner, i, layers[i])
        else:
            _APPLY[f.name](runner, None, None)
            _mark(runner.model, f.name)
    return names


def describe(runner) -> dict:
    """What this rank carries, for checking that a fault landed where it was aimed:

    * ``model``: faults marked on the model itself (layer-independent ones);
    * ``layers``: per decoder layer, the fault names marked on its modules;
    * ``overrides``: per decoder layer, the instance-level method overrides on its modules
      (``"self_attn.rotary_emb.forward"``): a clean layer has none;
    * ``kv_heads``: per attention layer, the head count of its KV cache (None before allocation)."""
    layers, overrides = [], []
    for layer in runner.model.model.layers:
        found, over = [], []
        for mname, m in layer.named_modules():
            for n in m.__dict__.get(MARK, []):
                if n not in found:
                    found.append(n)
            over += [f"{mname}.{a}".lstrip(".") for a in ("forward", "_prefill", "_decode") if a in m.__dict__]
        layers.append(found)
        overrides.append(over)
    return {"model": list(runner.model.__dict__.get(MARK, [])), "layers": layers, "overrides": overrides,
            "kv_heads": [int(a.k_cache.shape[2]) if a.k_cache.dim() == 4 else None
                         for a in runner.attention_layers()]}


# ---- driver side -----------------------------------------------------------------------------------------

def inject(llm, names: list[str] | str, layer: int | None = None) -> list[list[str]]:
    """``apply`` on every rank of ``llm``, then forget the driver's prefix cache: its blocks were computed by
    the clean model (and ``gqa_cache_repeated_heads`` re-allocates the cache, zeroing them), so a request
    sharing a prefix with an earlier one would otherwise reuse them. Returns the per-rank results."""
    out = llm.call("tpcheck.faults:apply", names, layer)
    reset = getattr(llm, "_reset_scheduler", None)
    if reset is not None:
        reset()
    return out


def restore(llm) -> None:
    """Reload every rank's runner, dropping all faults; checkpoint, dtype and cache layout unchanged."""
    if hasattr(llm, "reload"):
        llm.reload()
    else:
        llm.load(llm.model_dir, num_kv_blocks=getattr(llm, "_num_kv_blocks", None))


@contextlib.contextmanager
def injected(llm, names: list[str] | str, layer: int | None = None):
    """``with injected(llm, ["rope_skipped"]): ...`` — the faults are live inside, the engine clean after."""
    try:
        inject(llm, names, layer)
        yield llm
    finally:
        if not llm.executor.closed:
            restore(llm)
