"""A stand-in for vLLM: a tensor-parallel Qwen2 engine with vLLM's module names, contracts and fused layers,
launched by torchrun, dumping its points through ``tpcheck.capture`` and ``VLLM_MAP``::

    TPCHECK_DUMP=dumps/vllm torchrun --standalone --nproc-per-node 2 examples/vllm_style_tp.py \\
        --model CKPT --prompt-ids 1,2,3,4,5 --prompt-ids 7,8,9 --decode-steps 2
    tpcheck compare dumps/vllm --model CKPT

A real vLLM worker hooks in the same way: one ``from_env`` call after loading, one ``step_done`` per step.
Sharding over tp ranks, rank r (H heads, K KV heads, head dim d, intermediate I, vocab V):

* ``qkv_proj`` (column-parallel, fused): q heads ``[r*H/tp, (r+1)*H/tp)``, KV head shard ``r // R`` of
  ``K / max(1, K/tp)`` with ``R = num_kv_head_replicas = max(1, tp // K)``; local output ``[q | k | v]`` of
  widths ``output_partition_sizes``. ``gate_up_proj``: ``[gate | up]``, rows ``[r*I/tp, (r+1)*I/tp)`` of each.
* ``o_proj`` / ``down_proj`` (row-parallel): weight columns of the rank's heads / I slice; partial sums
  all-reduced (in the activations' dtype).
* ``embed_tokens`` / ``lm_head`` (vocab-parallel): V padded to Vp, a multiple of 64; rank r holds rows
  ``[r*Vp/tp, (r+1)*Vp/tp)``. The lookup zeroes ids outside them, then all-reduces; ``logits_processor``
  gathers the logits shards of the sampled rows to rank 0 and strips the padding.
* norms, RoPE and attention (over the rank's own heads and KV cache): local.

``--bug`` is a test-only fault switch (tests/test_tpcheck/engines/dump/test_recipe_vllm_style.py): ``swap-q-shards``: rank
r loads the q rows of rank (r+1) % tp; ``skip-o-proj-allreduce``: o_proj returns its partial sums."""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from impl.config import ConfigError, load_config
from impl.distributed import all_reduce, broadcast_object, close_tp, gather, get_tp_rank, get_tp_size, init_tp
from impl.layers.linear import divide
from impl.loader import LazySlice, LoadError, checkpoint_files, default_weight_loader, open_safetensors

BUG: str | None = None  # --bug (tests only)


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rank's rows].T + b[rank's rows]`` (output ``Shard(-1)``); returns ``(y, None)``."""

    def __init__(self, in_size: int, out_local: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_local, in_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden: int, d: int, heads: int, kv_heads: int):
        tp = get_tp_size()
        self.head_size, self.num_heads = d, divide(heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, tp, "num_key_value_heads") if tp <= kv_heads else 1
        self.num_kv_head_replicas = divide(tp, kv_heads, "tp_size") if tp > kv_heads else 1
        self.output_partition_sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        super().__init__(hidden, sum(self.output_partition_sizes), bias=True)

    def weight_loader(self, param, loaded, shard_id: str):  # q_proj / k_proj / v_proj into their part
        q, kv = self.output_partition_sizes[:2]
        if shard_id == "q":
            rank = (self.tp_rank + 1) % self.tp_size if BUG == "swap-q-shards" else self.tp_rank
            offset, size, start = 0, q, rank * q
        else:
            offset, size, start = q if shard_id == "k" else q + kv, kv, self.tp_rank // self.num_kv_head_replicas * kv
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, in_size: int, output_sizes: list[int]):
        self.output_sizes = output_sizes
        self.output_partition_sizes = [divide(s, get_tp_size(), "intermediate_size") for s in output_sizes]
        super().__init__(in_size, sum(self.output_partition_sizes), bias=False)

    def weight_loader(self, param, loaded, shard_id: int):  # gate_proj (0) / up_proj (1) into their part
        n = self.output_partition_sizes[shard_id]
        param.data.narrow(0, shard_id * n, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W[:, rank's columns].T)``: input ``Shard(-1)``, output ``Replicate()``
    (``Partial()`` with ``reduce_results=False``); returns ``(y, None)``."""

    def __init__(self, in_size: int, out_size: int, reduce_results: bool = True):
        super().__init__()
        self.tp_rank, self.reduce_results = get_tp_rank(), reduce_results
        in_local = divide(in_size, get_tp_size(), "in_features")
        self.weight = nn.Parameter(torch.empty(out_size, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x):
        y = F.linear(x, self.weight)
        return (all_reduce(y) if self.reduce_results else y), None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.org_vocab_size, padded = vocab, -(-vocab // 64) * 64
        n = divide(padded, get_tp_size(), "padded vocab")
        self.vocab_start_index, self.vocab_end_index = get_tp_rank() * n, (get_tp_rank() + 1) * n
        self.weight = nn.Parameter(torch.zeros(n, hidden), requires_grad=False)  # padding rows stay 0
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        n = max(0, min(param.shape[0], self.org_vocab_size - self.vocab_start_index))
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start_index, n))

    def forward(self, ids):
        mine = (ids >= self.vocab_start_index) & (ids < self.vocab_end_index)
        out = F.embedding((ids - self.vocab_start_index) * mine, self.weight)
        return all_reduce(out.masked_fill_(~mine[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, ids):
        raise RuntimeError("as in vLLM, the LM head never runs forward: logits_processor reads its weight")


class LogitsProcessor(nn.Module):
    """Logits of the rows it is given (the sampled ones) on rank 0, padding stripped; None on other ranks."""

    def __init__(self, vocab: int):
        super().__init__()
        self.org_vocab_size = vocab

    def forward(self, lm_head, hidden):
        logits = gather(F.linear(hidden, lm_head.weight), dim=-1, dst=0)
        return None if logits is None else logits[:, :self.org_vocab_size]


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (``forward_native``). ``norm(x, residual)``: fused add + norm, in place: the float32 sum
    rounded into ``residual``, its normed value into ``x``; returns ``(x, residual)``."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x, residual=None):
        h = x.float() if residual is None else x.float() + residual.float()
        if residual is not None:
            residual.copy_(h)
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return out if residual is None else (x.copy_(out), residual)


class RotaryEmbedding(nn.Module):
    """Neox RoPE rotating q and k in place (views into the qkv buffer, as vLLM's kernel does); the cos|sin
    cache is cast to the model dtype with the model."""

    def __init__(self, d: int, max_pos: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.einsum("i,j->ij", torch.arange(max_pos, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)
        self.d = d

    def forward(self, positions, q, k):
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        for x in (q, k):
            h = x.view(x.shape[0], -1, self.d)
            x1, x2 = h[..., : self.d // 2], h[..., self.d // 2:]
            h.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
        return q, k


class Attention(nn.Module):
    """Causal GQA attention over the rank's heads. Sequence s's keys / values are ``*_cache[s, :length]``;
    ``STEP`` (vLLM: the forward context) says where each sequence's rows of this step start."""

    STEP = {"starts": [], "lens": []}

    def __init__(self, kv_heads: int, d: int):
        super().__init__()
        self.kv_heads, self.d = kv_heads, d
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q, k, v):
        out, row = q.new_empty(q.shape), 0
        for s, (start, n) in enumerate(zip(self.STEP["starts"], self.STEP["lens"])):
            end = start + n
            self.k_cache[s, start:end], self.v_cache[s, start:end] = k[row:row + n], v[row:row + n]
            qs, ks, vs = (x.reshape(len(x), -1, self.d).transpose(0, 1)
                          for x in (q[row:row + n], self.k_cache[s, :end], self.v_cache[s, :end]))
            mask = torch.arange(end, device=q.device)[None] <= torch.arange(start, end, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[row:row + n] = o.transpose(0, 1).reshape(n, -1)
            row += n
        return out


class Qwen2Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads)
        self.q_size, self.kv_size = self.qkv_proj.output_partition_sizes[:2]
        self.rotary_emb = RotaryEmbedding(d, cfg.max_position, cfg.rope_theta)
        self.attn = Attention(self.qkv_proj.num_kv_heads, d)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, BUG != "skip-o-proj-allreduce")

    def forward(self, positions, x):
        q, k, v = self.qkv_proj(x)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))[0]


class Qwen2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen2MLP(cfg)

    def forward(self, positions, hidden, residual):  # vLLM's: the residual stream rides in the fused norms
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, ids, positions):
        hidden, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class Qwen2ForCausalLM(nn.Module):
    STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, cfg, dtype):
        super().__init__()
        self.cfg, self.model = cfg, Qwen2Model(cfg)
        self.lm_head = (self.model.embed_tokens if cfg.tie_word_embeddings  # tied: the same module, as in vLLM
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size))
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.to(dtype)

    def forward(self, ids, positions):
        return self.model(ids, positions)

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)

    def load_weights(self, model_dir, dtype):
        """Each rank reads only its slices (``LazySlice``); q/k/v and gate/up go into their fused parameter."""
        params, seen = dict(self.named_parameters()), set()
        wanted = {n for p in params for n in [p.replace(f, o) for f, o, _ in self.STACKED if f".{f}." in p] or [p]}
        for fname, names in checkpoint_files(model_dir).items():
            for name in names:
                if name.endswith("rotary_emb.inv_freq") or (self.cfg.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                pname, sid = next(((name.replace(o, f), s) for f, o, s in self.STACKED if f".{o}." in name),
                                  (name, None))
                if pname not in params:
                    raise LoadError(f"unexpected tensor {name!r} in {fname}")
                with open_safetensors(fname) as f:
                    p = params[pname]
                    getattr(p, "weight_loader", default_weight_loader)(p, LazySlice(f.get_slice(name), dtype), sid)
                seen.add(name)
        if wanted - seen:
            raise LoadError(f"{model_dir}: checkpoint lacks {sorted(wanted - seen)}")


@torch.no_grad()
def generate(model, prompts: list[list[int]], decode_steps: int, cap=None, device="cpu") -> list[list[int]]:
    """Greedy decode; every sequence in one batched forward per step (the prompts, then one token each)."""
    for layer in model.model.layers:
        a, n = layer.self_attn.attn, max(map(len, prompts)) + decode_steps
        a.k_cache, a.v_cache = (model.model.norm.weight.new_zeros(len(prompts), n, a.kv_heads * a.d) for _ in "kv")
    tokens, starts, out = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    for step in range(decode_steps + 1):
        lens = Attention.STEP["lens"] = [len(t) for t in tokens]
        Attention.STEP["starts"] = starts
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(device)
        hidden = model(torch.tensor(sum(tokens, []), device=device), positions)
        logits = model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])  # sampled: each sequence's last row
        nxt = broadcast_object(None if logits is None else logits.argmax(-1).tolist())  # rank 0 samples
        if cap is not None:
            cap.step_done(step, tokens, starts)
        tokens, starts = [[t] for t in nxt], [s + n for s, n in zip(starts, lens)]
        for o, t in zip(out, nxt):
            o.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    global BUG
    import tpcheck.capture
    from tpcheck.inputs.arg_types import int_list
    from tpcheck.capture.maps import VLLM_MAP
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node TP examples/vllm_style_tp.py",
                                 description="a vLLM-style TP Qwen2 engine (greedy); TPCHECK_DUMP=DIR dumps its "
                                             "points, then: tpcheck compare DIR --model CKPT")
    ap.add_argument("--model", required=True, help="checkpoint directory (HF layout, safetensors)")
    ap.add_argument("--prompt-ids", type=int_list, action="append", required=True, metavar="IDS",
                    help="comma-separated token ids; repeat for more prompts")
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bug", choices=["swap-q-shards", "skip-o-proj-allreduce"], help="tests only: inject a TP bug")
    a = ap.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        ap.error("run me under torchrun (WORLD_SIZE is not set): torchrun --standalone --nproc-per-node 2 "
                 "examples/vllm_style_tp.py --model CKPT --prompt-ids 1,2,3")
    BUG, rank, tp, dtype = a.bug, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), getattr(torch, a.dtype)
    cfg = load_config(a.model)
    if cfg.model_type != "qwen2" or cfg.rope_scaling is not None:
        raise ConfigError(f"{a.model}: this example runs plain Qwen2 only (model_type {cfg.model_type!r})")
    cfg.check_tp(tp)
    device = f"cuda:{os.environ['LOCAL_RANK']}" if a.device == "cuda" else a.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    init_tp(rank, tp, None, device=device)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg, dtype)
        model.load_weights(a.model, dtype)
        cap = tpcheck.capture.from_env(model, VLLM_MAP, rank, tp, a.dtype, "vllm-style")  # None: no TPCHECK_DUMP
        out = generate(model, a.prompt_ids, a.decode_steps, cap, device)
        if rank == 0:
            dumped = f"; dumped to {os.environ['TPCHECK_DUMP']}" if cap is not None else ""
            print(f"generated {out} (tp={tp}, {a.dtype}{dumped})")
    finally:
        close_tp()
    return 0


if __name__ == "__main__":
    sys.exit(main())
