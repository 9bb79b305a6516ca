"""Mixture-of-experts block with vLLM's ``FusedMoE`` contract, under tensor and expert parallelism.

One sparse layer's ``mlp`` (``SparseMoeBlock``) is built from submodules, one per stage, so a forward hook on
each sees that stage's output:

* ``gate``: the router, ``ReplicatedLinear(hidden, E)`` (no bias): ``router_logits [T, E]``, replicated;
* ``topk``: ``(topk_weights [T, k], topk_ids [T, k] int64)`` from the logits, as Hugging Face computes them:
  softmax in float32, top-k of the probabilities, divided by their sum when the config renormalises (in
  float32), then cast back to the activations' dtype (Qwen2-MoE, Qwen3-MoE) or kept in float32 (Mixtral);
* ``experts`` (``FusedMoE``): every local expert's ``w13`` (gate | up) and ``w2`` (down) as 3-D parameters;
  its output is this rank's **partial** routed output ``[T, hidden]`` (not reduced);
* ``shared_expert`` (Qwen2-MoE): a gated MLP, column/row parallel over all tp ranks with its reduction deferred
  (partial), and ``shared_expert_gate``, ``ReplicatedLinear(hidden, 1)``: ``sigmoid`` of it scales the shared
  expert per token;
* the block: ``all_reduce(routed_r + sigmoid(shared_expert_gate(x)) * shared_r)``: one all-reduce for the
  whole layer (vLLM's contract), output replicated.

Experts math, per token t with top-k ids ``e_1..e_k`` and weights ``w_1..w_k``:
``routed(t) = sum_j w_j * down_{e_j}(silu(gate_{e_j}(x_t)) * up_{e_j}(x_t))``. Each product ``w_j * y_j`` is
formed in the promoted dtype of the two (the activations' dtype for Qwen, float32 for Mixtral), the k products
are summed (``sum`` over the k slots) and cast to the activations' dtype, as transformers 5's default
``grouped_mm`` experts do (bit for bit in bfloat16 at tp 1, tested). Its ``eager`` experts (the only ones that
run in float64) add the experts one by one into an output of the activations' dtype instead: in float32 that
differs by rounding only, in bfloat16 by one more rounding per expert.

Sharding at tp ranks and ep expert groups (``impl.moe_config``; ``moe_tp = tp / ep``):

* **TP** (``ep = 1``): every rank holds every expert; expert e's gate/up rows ``[r*I/tp, (r+1)*I/tp)``
  (column parallel) and the matching columns of down (row parallel). Rank r's
  ``routed_r(t) = sum_j w_j * down_{e_j}[:, I_r](silu(gate_{e_j}[I_r] x) * up_{e_j}[I_r] x)`` and
  ``sum_r routed_r = routed`` because silu-and-multiply acts elementwise on the intermediate units and the
  weighting and the sum over j are linear.
* **EP** (``ep > 1``): rank r is in group ``g = r // moe_tp`` and holds experts ``[g*E/ep, (g+1)*E/ep)``, each
  split ``moe_tp`` ways as above (its shard ``r % moe_tp``). The activations are replicated on every tp rank
  already, so dispatch is local: each rank computes only the (token, slot) pairs routed to its own experts
  and leaves the others zero. Summing over all tp ranks then adds, for each pair, the ``moe_tp`` shards of its
  expert's group and zeros from every other group: ``sum_r routed_r = routed`` again, so the combine is the
  same single all-reduce over the tp ranks, which also sums the shared expert's tensor-parallel partials.
  No all-to-all: every rank already has every token, and each token's output is needed on every rank.

The router and the shared expert's gate are replicated (loaded whole), so every rank picks the same experts
for every token."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import batch_invariant
from impl.config import ModelConfig
from impl.distributed import all_reduce, get_tp_rank, get_tp_size
from impl.layers.activation import SiluAndMul
from impl.layers.linear import ReplicatedLinear, check_shape
from impl.layers.mlp import GatedMLP
from impl.moe_config import MoeConfig
from impl.placements import Partial, Replicate

SHARD_IDS = ("w1", "w3", "w2")  # vLLM's names of an expert's gate, up and down in a checkpoint mapping


class TopK(nn.Module):
    """``forward(router_logits [T, E]) -> (topk_weights [T, k], topk_ids [T, k] int64)``: HF's routing (module
    docstring). Replicated: the logits are, and so is everything computed from them."""

    def __init__(self, top_k: int, renormalize: bool, weights_in_activation_dtype: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_in_activation_dtype = weights_in_activation_dtype
        self.output_placement = Replicate()

    def forward(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_activation_dtype:
            weights = weights.to(router_logits.dtype)
        return weights, ids


class FusedMoE(nn.Module):
    """The local experts of one sparse layer (vLLM's ``FusedMoE``): ``w13_weight [local_E, 2*I_r, hidden]``
    (expert e's gate rows of this rank, then its up rows) and ``w2_weight [local_E, hidden, I_r]``, with
    ``I_r = I / moe_tp``; ``forward(hidden, topk_weights, topk_ids)`` -> this rank's partial routed output
    ``[T, hidden]`` (``Partial``: the block sums it over the tp ranks).

    ``weight_loader(param, loaded, shard_id)`` takes one expert's checkpoint tensor with
    ``shard_id = (global expert id, "w1" | "w3" | "w2")`` (gate, up, down) and reads only this rank's rows
    (gate, up) or columns (down) of it; the loader never hands it another group's expert."""

    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype, ep_size: int = 1):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        moe.check_layout(tp, ep_size)
        self.layout = moe.rank_layout(rank, tp, ep_size)
        self.num_experts, self.top_k, self.hidden_size = moe.num_experts, moe.top_k, hidden_size
        self.intermediate_size = moe.intermediate_size
        lay = self.layout
        self.expert_start, self.num_local_experts = lay.expert_start, lay.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(lay.num_local_experts, 2 * lay.intermediate, hidden_size,
                                                   dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(lay.num_local_experts, hidden_size, lay.intermediate,
                                                  dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()
        self.output_placement = Partial()

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int, str]) -> None:
        expert_id, part = shard_id
        e, n, j = expert_id - self.expert_start, self.layout.intermediate, self.layout.moe_tp_rank
        if not 0 <= e < self.num_local_experts:
            raise ValueError(f"expert {expert_id} is not held by this rank (experts {self.layout.local_experts})")
        if part == "w2":
            check_shape(loaded, (self.hidden_size, self.intermediate_size))
            param.data[e].copy_(loaded.narrow(1, j * n, n))
            return
        check_shape(loaded, (self.intermediate_size, self.hidden_size))
        param.data[e].narrow(0, 0 if part == "w1" else n, n).copy_(loaded.narrow(0, j * n, n))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # one row per (token, slot): weighted in the promoted dtype, zero where another group's expert was chosen
        out = hidden.new_zeros((*topk_ids.shape, self.hidden_size),
                               dtype=torch.promote_types(hidden.dtype, topk_weights.dtype))
        local = topk_ids - self.expert_start
        for e in range(self.num_local_experts):
            token, slot = torch.where(local == e)
            if token.numel() == 0:
                continue
            y = batch_invariant.linear(hidden[token], lambda rows, e=e: F.linear(
                self.act_fn(F.linear(rows, self.w13_weight[e])), self.w2_weight[e]))
            out[token, slot] = y * topk_weights[token, slot, None]
        return out.sum(dim=1).to(hidden.dtype)


class SparseMoeBlock(nn.Module):
    """A sparse layer's ``mlp``: ``gate`` (router) -> ``topk`` -> ``experts``, plus ``shared_expert`` /
    ``shared_expert_gate`` where the family has them; one all-reduce (module docstring). Output replicated."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ep_size: int = 1):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.spelling = moe.spelling
        self.gate = ReplicatedLinear(h, moe.num_experts, bias=False, dtype=dtype)
        self.topk = TopK(moe.top_k, moe.renormalize, moe.spelling.weights_in_activation_dtype)
        self.experts = FusedMoE(moe, h, dtype, ep_size)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, moe.shared_expert_intermediate_size, bias=False, dtype=dtype,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(h, 1, bias=False, dtype=dtype)
        self.output_placement = Replicate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.topk(self.gate(x))
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            gate = batch_invariant.rowwise(torch.sigmoid, self.shared_expert_gate(x))  # [T, 1]: see rowwise
            out = out + gate * self.shared_expert(x)
        return all_reduce(out)

    def checkpoint_tensors(self, prefix: str) -> tuple[dict[str, tuple[str, object]], set[str]]:
        """For the loader (``impl.loader.expected_tensors``), with ``prefix`` this block's name in the model
        (``model.layers.3.mlp``): ``{checkpoint tensor: (parameter name, shard id)}`` of the router and this
        rank's experts, and the set of the other expert groups' tensors (skipped unread). Checkpoint names are
        the family's: ``...mlp.experts.5.gate_proj.weight``, Mixtral's ``...block_sparse_moe.experts.5.w1.weight``.
        The shared expert and its gate load as ordinary parameters."""
        base = f"{prefix.rsplit('.', 1)[0]}.{self.spelling.checkpoint_prefix}"
        wanted: dict[str, tuple[str, object]] = {f"{base}.gate.weight": (f"{prefix}.gate.weight", None)}
        foreign: set[str] = set()
        local = self.experts.layout.local_experts
        for e in range(self.experts.num_experts):
            names = {f"{base}.experts.{e}.{name}.weight": (f"{prefix}.experts.{'w2' if sid == 'w2' else 'w13'}_weight",
                                                           (e, sid))
                     for name, sid in zip(self.spelling.expert_names, SHARD_IDS)}
            if e in local:
                wanted.update(names)
            else:
                foreign.update(names)
        return wanted, foreign
