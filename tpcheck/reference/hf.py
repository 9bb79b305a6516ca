"""Capture the canonical points of Hugging Face's causal LM of a supported family (the golden run and the
noise floor): the class ``impl.config.FAMILIES`` names for the checkpoint's ``model_type`` (``Qwen2ForCausalLM``,
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``), whose module names are the same
(``model.layers.{i}.self_attn.q_proj`` ...; Qwen3 adds ``self_attn.q_norm`` / ``k_norm``).

Forward hooks and pre-hooks on HF's own modules, placed by ``tpcheck.capture.HF_MAP`` (the one description of
which HF module gives which point), plus one custom attention function registered through transformers'
attention interface (to see the post-RoPE query/key): no fork of HF code. Each prompt runs as a batch of one,
so no padding reaches the comparison. ``teacher`` (isolate mode, ``tpcheck.capture.teacher``) replaces each
decoder layer's input and the final norm's input with given tensors. ``reductions`` (``tpcheck.reference.reductions``) makes
``o_proj`` and ``down_proj`` round as a ``tp``-way row-parallel engine does: the noise floor's TP reference."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from impl.config import HF_DTYPE_KEY, TRANSFORMERS_5, load_config, parse_dtype
from tpcheck.capture.core import install
from tpcheck.capture.maps import HF_MAP
from tpcheck.capture.teacher import Teacher
from tpcheck.reference.attention_fn import ATTN_NAME, _STATE, register_attention  # noqa: F401 (re-exported)
from tpcheck.reference.forced_route import forced_route
from tpcheck.reference.quantized import load_quantized_hf
from tpcheck.reference.reductions import Reductions, row_parallel_linear
import inspect


class RopeProbe(nn.Module):
    """An identity module the attention function calls with q and k after RoPE as ``[1, tokens, heads *
    head_dim]`` (the new tokens only), so module hooks (``tpcheck.capture``'s ``HF_TP_MAP``) can take them."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def hf_classes(model_dir) -> tuple[type, type]:
    """HF's config class and causal LM class of a checkpoint directory: those ``impl.config.FAMILIES`` names for
    its ``model_type`` (read and checked by ``impl.config.load_config``: an unsupported type, RoPE scaling or
    activation is a ``ConfigError`` naming it). Never ``trust_remote_code``: only transformers' own classes."""
    import transformers  # the family's class by name, at the version installed
    family = load_config(model_dir).family
    model_cls = getattr(transformers, family.hf_model_class, None)
    if model_cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {family.hf_model_class}")
    return family.hf_config_class(model_dir), model_cls


def load_hf_model(model_dir, dtype: str | torch.dtype = "float32", **kwargs) -> nn.Module:
    """Hugging Face's causal LM of a checkpoint directory (its family's class, ``hf_classes``) in ``dtype``, in
    eval mode (transformers 4.4x names the dtype keyword ``torch_dtype``, 4.56+ ``dtype``); ``kwargs`` go to
    ``from_pretrained`` (``tp_plan="auto"``: transformers' tensor parallelism)."""
    from transformers.utils import logging as hf_logging  # submodule: loaded with the first model
    config_cls, model_cls = hf_classes(model_dir)
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per reference model would bury tpcheck's output
    if load_config(model_dir).quant is not None:
        if kwargs:
            raise ValueError(f"{model_dir}: a quantized checkpoint has no Hugging Face TP or other loading options "
                             f"here (got {sorted(kwargs)})")
        return load_quantized_hf(model_dir, dtype, config_cls, model_cls)
    if parse_dtype(dtype) == torch.float64 and getattr(load_config(model_dir), "moe", None) is not None \
            and TRANSFORMERS_5:
        # transformers 5's default experts kernel (grouped_mm) has no float64: the golden adds expert by expert
        kwargs.setdefault("experts_implementation", "eager")
    return model_cls.from_pretrained(str(model_dir), **{HF_DTYPE_KEY: parse_dtype(dtype)}, **kwargs).eval()


class HFCapture:
    """``HF_MAP``'s hooks (``tpcheck.capture.install`` with a sink), the post-RoPE q/k of the attention function,
    the teacher pre-hooks (``tpcheck.capture.teacher``) and the emulated row-parallel ``o_proj`` / ``down_proj``,
    installed once on a model; ``sink(name, tensor)`` receives every point of a forward."""

    def __init__(self, model: nn.Module):
        register_attention()
        model.config._attn_implementation = ATTN_NAME
        self.model, self.sink = model, None
        self.reductions: Reductions | None = None  # set for one step by ``step(reductions=...)``
        # a quantized checkpoint's row-parallel o_proj / down_proj: each of the engine's tp ranks quantizes its own
        # slice of the input (its own per-token scale), so the golden and the references do too (set per run)
        self.quant_shards = 1
        self.num_layers = model.config.num_hidden_layers
        m = model.model
        self.teacher = Teacher(m.layers, m.norm, like=model, batch_dim=True)
        self.routes: dict[int, torch.Tensor] | None = None  # layer -> the route to follow (this prompt's rows)
        for i, layer in enumerate(m.layers):
            mlp = layer.mlp
            for proj in (layer.self_attn.o_proj, getattr(mlp, "down_proj", None),
                         getattr(getattr(mlp, "shared_expert", None), "down_proj", None)):
                if proj is not None:
                    proj.forward = self._row_parallel(proj)
            if hasattr(getattr(mlp, "gate", None), "top_k"):  # a mixture-of-experts router (transformers 5)
                mlp.gate.register_forward_hook(self._follow_route(i), prepend=True)  # before the capture's hook
        self.capture = install(model, HF_MAP, sink=self._emit)

    def _emit(self, name: str, t: torch.Tensor) -> None:
        if self.sink is not None:
            self.sink(name, t)

    def _row_parallel(self, linear: nn.Linear):
        quant = getattr(linear, "input_quant", None)  # a quantized checkpoint's (tpcheck.reference.quantized)

        def forward(x):
            if quant is not None:
                x = torch.cat([quant(part) for part in x.chunk(self.quant_shards, dim=-1)], dim=-1)
            if self.reductions is None or not self.reductions.emulated:
                return nn.Linear.forward(linear, x)
            return row_parallel_linear(x, linear.weight, linear.bias, self.reductions)
        return forward

    def _follow_route(self, layer: int):
        """A hook on an MoE router: where ``routes`` names a token's experts and they differ from the router's own
        choice, return that choice instead, weighted by the router's own probabilities (``tpcheck.judge.routing``:
        a reference follows the engine's legitimately flipped route, so later points compare like with like)."""
        def hook(module, args, output):
            want = None if self.routes is None else self.routes.get(layer)
            if want is None:
                return None
            logits, weights, ids = output
            w, new_ids = forced_route(logits, ids, want, getattr(module, "norm_topk_prob", True), weights.dtype)
            return None if w is None else (logits, w, new_ids)
        return hook

    @torch.no_grad()
    def run(self, input_ids: list[int], cache, start: int, sink, teacher: dict | None = None) -> None:
        """One forward of one prompt's new tokens at positions ``start..``, feeding ``cache``."""
        self.sink, self.teacher.inputs = sink, teacher
        _STATE["sink"] = self._emit
        try:
            forward_one(self.model, input_ids, cache, start)
        finally:
            self.sink = self.teacher.inputs = None
            _STATE["sink"] = None

    def step(self, tokens: list[list[int]], caches: list, starts: list[int], teacher: dict | None = None,
             with_kv: bool = False, reductions: Reductions | None = None,
             routes: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """One step of every prompt (each a batch of one: ``tokens[b]`` at positions ``starts[b]..``, into
        ``caches[b]``): every point, rows concatenated in prompt order. ``teacher``: ``{i: [rows, hidden]}``
        over all prompts' rows; ``with_kv``: also each layer's whole cache contents (``kv.k`` / ``kv.v``);
        ``reductions``: row-parallel linears rounded as that TP engine rounds them (``tpcheck.reference.reductions``);
        ``routes``: ``{layer: [rows, k] expert ids}`` each MoE router follows where its own choice differs."""
        parts: dict[str, list[torch.Tensor]] = {}
        offset = 0
        self.reductions = reductions
        try:
            for b, toks in enumerate(tokens):
                t_b = None if teacher is None else {i: x[offset:offset + len(toks)] for i, x in teacher.items()}
                self.routes = None if routes is None else {i: r[offset:offset + len(toks)] for i, r in routes.items()}
                self.run(toks, caches[b], starts[b], lambda n, t: parts.setdefault(n, []).append(t), t_b)
                offset += len(toks)
        finally:
            self.reductions = self.routes = None
        out = {n: ts[0] if len(ts) == 1 else torch.cat(ts) for n, ts in parts.items()}  # one prompt: no copy
        if with_kv:
            for i in range(self.num_layers):
                ks, vs = zip(*(cache_kv(c, i) for c in caches))
                out[f"layers.{i}.kv.k"], out[f"layers.{i}.kv.v"] = torch.cat(ks), torch.cat(vs)
        return out


def cache_keyword(model) -> str:
    """The forward's keyword for a KV cache: ``cache`` where the class takes it (transformers 5.2x renames it and
    warns at every call given ``past_key_values``), else ``past_key_values`` (transformers 4.x, early 5.x)."""
    cls = type(model)
    if cls not in _CACHE_KEYWORD:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORD[cls]


_CACHE_KEYWORD: dict[type, str] = {}


def new_cache(model):
    """An empty ``DynamicCache`` that keeps every position of every layer. transformers 5 gives a sliding-window
    layer (Mistral, Qwen3's sliding layers) a cache that drops the keys older than the window after each step;
    the window is the attention mask's business either way (HF masks by position), but the KV-cache points
    compare every cached position with the engine's cache (impl's paged cache keeps them all), so the golden
    keeps them all too. Layers without a window are the same either way."""
    from transformers import DynamicCache  # submodule: loaded with the first cache
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x: one full layer per decoder layer, created as the forward reaches it
        return DynamicCache()
    if any(getattr(cache, "is_sliding", ())):
        return DynamicCache()  # no config: full DynamicLayers, created as the forward reaches them
    return cache


def fill_cache(cache, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], head_dim: int, dtype: torch.dtype,
               device: torch.device | str) -> None:
    """Write a prompt's first positions into an empty ``DynamicCache``, layer by layer in order: ``kv[layer]`` is
    ``(keys after RoPE, values)``, ``[positions, kv_heads * head_dim]``, rounded to ``dtype`` on ``device`` (the
    model's: a cache lives where its model computes). A forward from the next position then attends over them as
    over its own earlier positions (the local pass on the last rows, ``tpcheck.pipeline.local_rows``)."""
    for i in sorted(kv):
        k, v = (t.to(dtype=dtype, device=device).view(t.shape[0], -1, head_dim).transpose(0, 1)[None] for t in kv[i])
        cache.update(k.contiguous(), v.contiguous(), i)


def fill_caches(caches: list, lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]], head_dim: int,
                dtype: torch.dtype, device: torch.device | str) -> None:
    """``fill_cache`` of each prompt ``b``'s first ``lens[b]`` positions into ``caches[b]`` on ``device``: ``kv``'s
    rows are every prompt's prefix, concatenated in order."""
    offset = 0
    for cache, n in zip(caches, lens):
        if n:
            fill_cache(cache, {i: (k[offset:offset + n], v[offset:offset + n]) for i, (k, v) in kv.items()},
                       head_dim, dtype, device)
        offset += n


def cut_cache(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of a ``DynamicCache`` (a request recomputed from an earlier position).
    ``crop`` with a negative count removes that many tokens on every transformers this supports (4.x and 5.x up
    to 5.19 also took a positive length to keep; 5.23 refuses one)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def cache_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[positions, kv_heads * head_dim]`` keys and values of one layer of a DynamicCache."""
    if hasattr(cache, "layers"):  # transformers 5.x
        k, v = cache.layers[layer].keys, cache.layers[layer].values
    else:
        k, v = cache.key_cache[layer], cache.value_cache[layer]
    flat = lambda t: t[0].transpose(0, 1).reshape(t.shape[2], -1)  # noqa: E731
    return flat(k), flat(v)


def forward_one(model, input_ids: list[int], cache, start: int):
    """One forward of one prompt's new tokens at positions ``start..`` into ``cache``: a batch of one, so no padding
    becomes rows (the golden, the references and the hf-tp engine all step prompts this way)."""
    dev = model.device
    ids = torch.tensor([input_ids], device=dev)
    pos = torch.arange(start, start + len(input_ids), device=dev)[None]
    return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_keyword(model): cache})


def hf_logits(model_dir: str | Path, dtype: str, prompts: list[list[int]], device: str = "cpu") -> list[torch.Tensor]:
    """HF's logits of each prompt alone (one forward each, no cache kept) at ``dtype`` on ``device``, left there
    (``tpcheck check``)."""
    model = load_hf_model(model_dir, dtype).to(device)
    with torch.no_grad():
        return [model(torch.tensor([p], device=model.device)).logits[0] for p in prompts]
