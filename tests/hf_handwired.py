"""The hand-wired Hugging Face capture as it was before ``HFCapture`` was driven by ``HF_MAP``: a frozen test
oracle (hooks, pre-hooks and teacher pre-hooks written out one by one), which the map-driven ``HFCapture`` must
match bit for bit, and the baseline its speed is measured against."""
from __future__ import annotations

import torch
from torch import nn

from tpcheck.reference import hf
from tpcheck.reference.reductions import Reductions, row_parallel_linear


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t[0] if isinstance(t, tuple) else t
    return t[0].reshape(t.shape[1], -1)


def _teacher_hook(owner, i: int):
    def hook(mod, args, kwargs):
        if owner.teacher is None:
            return None
        x = owner.teacher[i].to(dtype=owner.model.dtype, device=owner.model.device)[None]
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}
    return hook


class HandWiredHFCapture:
    """``HFCapture``'s interface (``step``, ``model``, ``num_layers``) over hand-registered hooks."""

    def __init__(self, model: nn.Module):
        hf.register_attention()
        model.config._attn_implementation = hf.ATTN_NAME
        self.model, self.sink, self.teacher = model, None, None
        self.reductions: Reductions | None = None
        self.num_layers = model.config.num_hidden_layers
        m = model.model
        out = lambda name: (lambda mod, args, output: self._emit(name, _rows(output)))  # noqa: E731
        pre = lambda name: (lambda mod, args: self._emit(name, _rows(args[0])))  # noqa: E731
        m.embed_tokens.register_forward_hook(out("embed"))
        for i, layer in enumerate(m.layers):
            p, a, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
            layer.register_forward_pre_hook(_teacher_hook(self, i), with_kwargs=True)
            layer.input_layernorm.register_forward_hook(out(p + "input_norm"))
            for proj, name in ((a.q_proj, "attn.q"), (a.k_proj, "attn.k"), (a.v_proj, "attn.v")):
                proj.register_forward_hook(out(p + name))
            for module, name in (("q_norm", "attn.q_norm"), ("k_norm", "attn.k_norm")):
                if hasattr(a, module):
                    getattr(a, module).register_forward_hook(out(p + name))
            a.o_proj.register_forward_pre_hook(pre(p + "attn.context"))
            a.o_proj.register_forward_hook(out(p + "attn.out"))
            layer.post_attention_layernorm.register_forward_pre_hook(pre(p + "attn.residual"))
            layer.post_attention_layernorm.register_forward_hook(out(p + "post_attn_norm"))
            mlp.gate_proj.register_forward_hook(out(p + "mlp.gate"))
            mlp.up_proj.register_forward_hook(out(p + "mlp.up"))
            mlp.down_proj.register_forward_pre_hook(pre(p + "mlp.act"))
            mlp.down_proj.register_forward_hook(out(p + "mlp.out"))
            for proj in (a.o_proj, mlp.down_proj):
                proj.forward = self._row_parallel(proj)
            layer.register_forward_hook(out(p + "out"))
        m.norm.register_forward_pre_hook(_teacher_hook(self, self.num_layers), with_kwargs=True)
        m.norm.register_forward_hook(out("final_norm"))
        model.lm_head.register_forward_hook(out("logits"))

    def _emit(self, name: str, t: torch.Tensor) -> None:
        if self.sink is not None:
            self.sink(name, t.detach())

    def _row_parallel(self, linear: nn.Linear):
        def forward(x):
            if self.reductions is None or not self.reductions.emulated:
                return nn.Linear.forward(linear, x)
            return row_parallel_linear(x, linear.weight, linear.bias, self.reductions)
        return forward

    @torch.no_grad()
    def run(self, input_ids, cache, start, sink, teacher=None) -> None:
        self.sink, self.teacher = sink, teacher
        hf._STATE["sink"] = self._emit
        try:
            ids = torch.tensor([input_ids])
            pos = torch.arange(start, start + len(input_ids))[None]
            self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        finally:
            self.sink = self.teacher = None
            hf._STATE["sink"] = None

    def step(self, tokens, caches, starts, teacher=None, with_kv=False, reductions=None) -> dict:
        parts: dict[str, list[torch.Tensor]] = {}
        offset = 0
        self.reductions = reductions
        try:
            for b, toks in enumerate(tokens):
                t_b = None if teacher is None else {i: x[offset:offset + len(toks)] for i, x in teacher.items()}
                self.run(toks, caches[b], starts[b], lambda n, t: parts.setdefault(n, []).append(t), t_b)
                offset += len(toks)
        finally:
            self.reductions = None
        out = {n: ts[0] if len(ts) == 1 else torch.cat(ts) for n, ts in parts.items()}
        if with_kv:
            for i in range(self.num_layers):
                ks, vs = zip(*(hf.cache_kv(c, i) for c in caches))
                out[f"layers.{i}.kv.k"], out[f"layers.{i}.kv.v"] = torch.cat(ks), torch.cat(vs)
        return out
