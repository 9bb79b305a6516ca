"""Engine-side capture: forward hooks driven by a *name map*, importable inside any rank of any engine.

A name map (``NameMap``, ``tpcheck.capture.rules``) is a list of ``Rule``: a module-name pattern (``{layer}`` stands for the layer index)
→ a canonical point (``tpcheck.capture.points``), taken from the module's output or its input, with the placement
that says how the rank's local tensor makes the full one (``impl.placements``). Ready maps (defined in
``tpcheck.capture.maps``, importable from here): ``IMPL_MAP`` (impl), ``HF_MAP`` (Hugging Face
``Qwen2ForCausalLM``, tp 1), ``HF_TP_MAP`` (the same under transformers' ``tp_plan``), ``VLLM_MAP`` (vLLM / SGLang module names; read its docstring for what a fused
add + RMSNorm engine reports).

Turning it on — one call, or one environment variable::

    cap = tpcheck.capture.install(model, VLLM_MAP, writer=DumpWriter(dir, rank, tp, "bfloat16", "vllm"))
    ...                                     # one forward (one engine step)
    cap.step_done(step, tokens, starts)     # the step's points go to the writer; the capture is cleared
    cap.remove()                            # every hook removed

    cap = tpcheck.capture.from_env(model, VLLM_MAP, rank, tp, "bfloat16", "vllm")   # None unless TPCHECK_DUMP

``from_env`` registers nothing and returns None when ``TPCHECK_DUMP`` is unset or empty (no hook: no cost);
with ``TPCHECK_DUMP=DIR`` it writes ``DIR/rank{r}/step{s}.{json,safetensors}`` (``tpcheck.capture.dump``) and also reads
``TPCHECK_DUMP_POINTS`` (a regex of point names to keep; hooks are registered only where a kept point can come
from) and ``TPCHECK_DUMP_BUDGET_MB`` (a bound on the bytes written per rank: past it the capture stops, logs why
and removes its hooks, so a debugging dump never kills the serving run).

How a hook picks, copies and shapes a tensor, and what vLLM / SGLang need (eager mode): docs/adapters.md,
"Capturing inside your engine".
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from impl.env import env_number
from impl.placements import Fused, Replicate
# the rules and placement specs live in tpcheck.capture.rules; imported here so ``tpcheck.capture.core``'s names stay
from tpcheck.capture.rules import (NameMap, PlacementSpec, Rule, _is_dtensor, declared, dtensor_placement, of_sibling,
                                   weight_placement)
from tpcheck.capture.dump import DumpWriter
from tpcheck.capture.copies import queued_host_copy, row_view
import torch.distributed as dist

logger = logging.getLogger("tpcheck.capture")

ENV_DIR, ENV_POINTS, ENV_BUDGET = "TPCHECK_DUMP", "TPCHECK_DUMP_POINTS", "TPCHECK_DUMP_BUDGET_MB"
ENV_QUEUE = "TPCHECK_DUMP_QUEUE_MB"  # bytes of steps a rank's writer thread may hold unwritten (0: write in the step)
QUEUE_MB = 256


def _select(value, index: int | str, kwargs: dict | None = None):
    if isinstance(index, str):
        if kwargs is not None:
            return kwargs.get(index)
        return getattr(value, index, None)
    if isinstance(value, torch.Tensor):
        return value if index == 0 else None
    if isinstance(value, (tuple, list)):
        return value[index] if -len(value) <= index < len(value) else None
    return None


def handoff(hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A pipeline stage boundary's point (``layers.{i}.handoff``): the ``IntermediateTensors`` one stage hands the
    next, ``[rows, hidden_states | residual]``; both are replicated over the stage's TP ranks."""
    return torch.cat([row_view(hidden_states), row_view(residual)], dim=-1)


def with_handoffs(points: dict[str, torch.Tensor], handoffs) -> dict[str, torch.Tensor]:
    """``points`` (a one-device run's: the golden's, a reference's) with the handoff of each layer in ``handoffs``
    made from what that layer computed: the hidden_states vLLM sends, its MLP's output as the layer adds it to the
    stream (``mlp.post_norm`` where the family normalises it first, Gemma 3; else ``mlp.out``), and its
    ``attn.residual`` (the stream before that add), where both were captured."""
    for i in handoffs:
        sent = points.get(f"layers.{i}.mlp.post_norm")
        parts = sent if sent is not None else points.get(f"layers.{i}.mlp.out"), points.get(f"layers.{i}.attn.residual")
        if parts[0] is not None and parts[1] is not None:
            points[f"layers.{i}.handoff"] = handoff(*parts)
    return points


@dataclass
class _Site:
    module_name: str
    rule: Rule
    name: str          # the point name (fused: the prefix, ending in ".")
    parent: nn.Module = field(repr=False)


@dataclass
class Capture:
    """Hooks installed by ``install``. ``sites``: what is hooked; ``dropped``: points ``step_done`` dropped,
    with why; ``error``: why the capture stopped (a dump past its budget), or None; ``sink``: where each tensor
    goes as it is captured instead (``install(sink=...)``); ``armed``: False makes every hook a no-op (a capture
    installed once on an engine that also serves undumped: impl's ranks arm it for the forwards they capture)."""

    model: nn.Module = field(repr=False)
    name_map: NameMap = field(repr=False)
    writer: object = None
    keep: re.Pattern | None = None
    on_error: str = "raise"
    sites: list[_Site] = field(default_factory=list, repr=False)
    dropped: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    step: int = 0
    sink: Callable[[str, torch.Tensor], None] | None = None
    armed: bool = True
    _pending: dict = field(default_factory=dict, repr=False)
    _handles: list = field(default_factory=list, repr=False)
    _devices: set = field(default_factory=set, repr=False)  # CUDA devices with a copy in flight (queued_host_copy)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` as a hook makes it (``queued_host_copy``): a CUDA tensor's is read only after this
        step's ``step_done`` (or ``clear``)."""
        return queued_host_copy(t, self._devices)

    def _settle(self) -> None:
        """Wait for the host copies in flight (``queued_host_copy``): once a step, not once a hook."""
        while self._devices:
            torch.cuda.synchronize(self._devices.pop())

    @property
    def names(self) -> list[str]:
        """Every canonical point name the installed hooks can give (fused outputs by part)."""
        out = []
        for s in self.sites:
            out += [s.name + p for p in s.rule.parts] if s.rule.parts else [s.name]
        return out

    def _put(self, site: _Site, module: nn.Module, value) -> None:
        if value is None:
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tpcheck.capture: {site.module_name} ({site.rule.point}) gave a "
                            f"{type(value).__name__}, not a tensor: fix the rule's index")
        spec = site.rule.placement
        placement = spec(module, site.parent) if callable(spec) else spec
        if _is_dtensor(value):  # a DTensor says itself how it is laid out: that wins over the rule
            placement, value = dtensor_placement(value), value.to_local()
        if site.rule.parts:
            names = tuple(p for p, _, _ in placement.parts) if isinstance(placement, Fused) else None
            if names != site.rule.parts:
                raise ValueError(f"tpcheck.capture: {site.module_name}: fused point {site.name!r} wants a Fused "
                                 f"placement with parts {site.rule.parts}, got {placement}")
        entry = self._pending.setdefault(site.name, (placement, []))
        if site.rule.heads_first:
            value = value.transpose(-3, -2)
        entry[1].append(self.host_copy(row_view(value, site.rule.token_dims or self.name_map.token_dims)))

    def _hook_out(self, sites: list[_Site]):
        if self.sink is not None:
            return self._sink_hook(sites, False)

        def hook(module, args, output):
            if self.armed:
                for s in sites:
                    self._put(s, module, _select(output, s.rule.index))
        return hook

    def _hook_in(self, sites: list[_Site]):
        if self.sink is not None:
            return self._sink_hook(sites, True)

        def hook(module, args, kwargs):
            if self.armed:
                for s in sites:
                    idx = s.rule.index
                    self._put(s, module, _select(args, idx) if isinstance(idx, int) else kwargs.get(idx))
        return hook

    def _sink_hook(self, sites: list[_Site], is_input: bool):
        # A sink's hook hands each tensor on at once: whole one-device tensors (install checked), so no placement
        # to read and nothing pending. Lean on purpose: the Hugging Face reference runs ~15 hooks per layer per
        # forward, and going through _put cost a small model's step ~4% (measured).
        sink, dims = self.sink, self.name_map.token_dims
        picks = [(s.name, s.rule.index, s) for s in sites]

        def rows(site: _Site, value) -> torch.Tensor:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"tpcheck.capture: {site.module_name} ({site.rule.point}) gave a "
                                f"{type(value).__name__}, not a tensor: fix the rule's index")
            if site.rule.heads_first:
                value = value.transpose(-3, -2)
            return row_view(value, site.rule.token_dims or dims)

        if is_input:
            def hook(module, args, kwargs):
                for name, idx, site in picks:
                    value = _select(args, idx) if isinstance(idx, int) else kwargs.get(idx)
                    if value is not None:
                        sink(name, rows(site, value))
        else:
            def hook(module, args, output):
                for name, idx, site in picks:
                    value = _select(output, idx)
                    if value is not None:
                        sink(name, rows(site, value))
        return hook

    def _kept(self, name: str, placement, t: torch.Tensor) -> list[tuple[str, object, torch.Tensor]]:
        """The point (or, when only some parts of a fused point are kept, those parts) the filter keeps."""
        if self.keep is None:
            return [(name, placement, t)]
        if isinstance(placement, Fused):
            parts = [(part, sub) for part, _, sub in placement.parts]
            wanted = [self.keep.fullmatch(name + part) is not None for part, _ in parts]
            if all(wanted):
                return [(name, placement, t)]
            pieces = t.split([w for _, w, _ in placement.parts], dim=-1)
            return [(name + part, sub, piece.contiguous()) for (part, sub), piece, w in zip(parts, pieces, wanted)
                    if w]
        return [(name, placement, t)] if self.keep.fullmatch(name) else []

    def step_done(self, step: int | None = None, tokens: list[list[int]] | None = None,
                  starts: list[int] | None = None) -> dict:
        """Close one step: ``{name: (placement, local [rows, features] tensor)}`` of every point captured
        since the last call (fused outputs whole, under their ``.``-ending name, unless ``keep`` keeps only
        some parts), handed to the writer (``tpcheck.capture.dump.DumpWriter``) as step ``step`` (default: a counter
        from 0) and returned; the capture is then cleared. ``tokens``: per prompt, the token ids this step
        consumed; ``starts``: their first positions (the writer needs both)."""
        step = self.step if step is None else step
        self.step = step + 1
        self._settle()  # the step's copies are complete from here on
        pending, self._pending = self._pending, {}
        rows = None if tokens is None else sum(len(t) for t in tokens)
        points = {}
        for name, (placement, ts) in pending.items():
            t = ts[0] if len(ts) == 1 else torch.cat(ts)
            if rows is not None and t.shape[0] != rows:
                why = f"step {step}: {t.shape[0]} rows, the step has {rows} tokens"
                if name not in self.dropped:
                    logger.info(f"tpcheck.capture: {name} dropped ({why})")
                self.dropped[name] = why
                continue
            for n, p, x in self._kept(name, placement, t):
                points[n] = (p, x)
        if self.writer is not None and self.error is None:
            if tokens is None or starts is None:
                raise ValueError("step_done: a writer needs the step's tokens and starts")
            try:
                self.writer.write(step, tokens, starts, points)
            except Exception as e:
                if self.on_error == "raise":
                    raise
                self.error = f"step {step}: {e}"
                logger.error(f"tpcheck.capture: dump stopped, hooks removed ({self.error})")
                self.remove()
        return points

    def clear(self) -> None:
        """Forget what was captured since the last ``step_done`` (a warm-up or profiling forward)."""
        self._settle()
        self._pending = {}

    def remove(self) -> None:
        """Remove every hook this capture registered; a writer with a thread of its own writes what it holds and
        stops (its error: raised with ``on_error="raise"``, else logged and kept in ``error``)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._settle()
        self._pending = {}
        close = getattr(self.writer, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:
                if self.on_error == "raise":
                    raise
                if self.error is None:  # else already logged, where it stopped the capture
                    self.error = f"closing the dump: {e}"
                    logger.error(f"tpcheck.capture: {self.error}")


def install(model: nn.Module, name_map: NameMap, writer=None, points: str | None = None,
            on_error: str = "raise", sink: Callable[[str, torch.Tensor], None] | None = None) -> Capture:
    """Register the map's hooks on ``model`` and return the ``Capture``. ``points``: a regex of point names
    to keep (fullmatched; a fused output is kept whole when all its parts are kept, else split into the kept
    parts); sites that cannot give a kept point get no hook. ``on_error``: ``"raise"`` a writer's error from
    ``step_done``, or ``"stop"``: log it, remove the hooks and carry on. A map that matches no module of the
    model is a ValueError (a misconfigured map must not pass silently). ``sink``: a one-device capture that
    calls ``sink(name, tensor)`` with each point as the forward gives it (``[rows, features]``, a view of the
    model's tensor: neither copied nor kept) instead of collecting them for ``step_done``; every matched rule
    must then be a whole ``Replicate()`` point (``HF_MAP``)."""
    if sink is not None and writer is not None:
        raise ValueError("install: a sink or a writer, not both")
    if on_error not in ("raise", "stop"):
        raise ValueError(f"on_error must be 'raise' or 'stop', got {on_error!r}")
    keep = re.compile(points) if points else None
    modules = dict(model.named_modules())
    matches: list[tuple[str, Rule, int | None]] = []
    suffixes = {n.rpartition(".")[2] for n in modules}  # what Rule.model_has / model_lacks look for
    layers: set[int] = set()
    for mname in modules:
        for rule in name_map.rules:
            m = rule.pattern.fullmatch(mname)
            if m and rule.applies(suffixes):
                layer = int(m.group("layer")) if "layer" in m.groupdict() else None
                matches.append((mname, rule, layer))
                if layer is not None:
                    layers.add(layer)
    if not matches:
        sample = [n for n in modules if n][:6]
        raise ValueError(f"tpcheck.capture: {name_map.name} matches no module of {type(model).__name__} "
                         f"(its modules are named like {sample})")
    last = max(layers) if layers else None
    if sink is not None:
        bad = sorted({r.point for _, r, _ in matches if r.parts or r.placement != Replicate()})
        if bad:
            raise ValueError(f"tpcheck.capture: a sink takes whole one-device tensors; {name_map.name} places "
                             f"{bad} otherwise")
    cap = Capture(model, name_map, writer, keep, on_error, sink=sink)
    by_module: dict[tuple[str, bool], list[_Site]] = {}  # one hook per module and direction, rules in map order
    for mname, rule, layer in matches:
        name = rule.name(layer, last)
        if name is None:
            continue
        if keep is not None and not any(keep.fullmatch(n) for n in rule.names(layer, last)):
            continue
        parent = modules[mname.rpartition(".")[0]]
        site = _Site(mname, rule, name, parent)
        cap.sites.append(site)
        by_module.setdefault((mname, rule.input), []).append(site)
    for (mname, is_input), sites in by_module.items():
        mod = modules[mname]
        if is_input:
            cap._handles.append(mod.register_forward_pre_hook(cap._hook_in(sites), with_kwargs=True))
        else:
            cap._handles.append(mod.register_forward_hook(cap._hook_out(sites)))
    return cap


def _mib(env: str) -> int | None:
    """An environment variable's MiB as bytes (None: unset); anything but a finite number >= 0 is a ValueError
    naming it (``impl.env.env_number``)."""
    mib = env_number(env, what="MiB")
    return None if mib is None else int(mib * 2**20)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def from_env(model: nn.Module, name_map: NameMap, rank: int | None = None, tp: int | None = None,
             dtype: str | torch.dtype = "float32", engine: str = "?", checkpoint: str | None = None,
             stage: int | None = None, cpu_bf16_rounding: bool | None = None) -> Capture | None:
    """``install`` with a ``tpcheck.capture.dump.DumpWriter`` when ``TPCHECK_DUMP=DIR`` is set; None (and no hook)
    otherwise. ``TPCHECK_DUMP_POINTS``: the ``points`` regex; ``TPCHECK_DUMP_BUDGET_MB``: the writer's budget
    (past it the capture stops and logs why); ``TPCHECK_DUMP_QUEUE_MB``: the files are written by a thread of the
    writer's own, off the step, with at most that many MiB queued (default 256; ``0``: written inside the step). ``rank`` / ``tp`` default to torch.distributed's. ``checkpoint``:
    the checkpoint directory the engine loaded, whose fingerprint the dump records (``tpcheck compare`` then
    refuses a ``--model`` of another checkpoint). ``stage``: the pipeline stage of this rank (``rank`` / ``tp`` then
    within the stage), whose ranks write a dump of their own under ``DIR/stage{stage}`` (``tpcheck.engines.dump.stages``).
    ``cpu_bf16_rounding``: recorded in every step (``DumpWriter``; None: not recorded)."""
    root = os.environ.get(ENV_DIR, "")
    if not root:
        return None
    if stage is not None:
        root = os.path.join(root, f"stage{stage}")
    points = os.environ.get(ENV_POINTS) or None
    if points is not None:
        try:
            re.compile(points)
        except re.error as e:
            raise ValueError(f"{ENV_POINTS}={points!r} is not a regular expression: {e}") from None
    budget, queue = (_mib(env) for env in (ENV_BUDGET, ENV_QUEUE))
    queue = QUEUE_MB * 2**20 if queue is None else queue or None  # 0: no thread, each step written in the step
    if rank is None or tp is None:
        on = dist.is_available() and dist.is_initialized()
        rank = rank if rank is not None else (dist.get_rank() if on else 0)
        tp = tp if tp is not None else (dist.get_world_size() if on else 1)
    writer = DumpWriter(root, rank, tp, _dtype_name(dtype), engine, budget_bytes=budget, model=checkpoint,
                        background_bytes=queue, cpu_bf16_rounding=cpu_bf16_rounding)
    cap = install(model, name_map, writer, points=points, on_error="stop")
    logger.info(f"tpcheck.capture: {name_map.name} dump of rank {rank}/{tp} to {root} "
                f"({len(cap.sites)} sites{', points ' + points if points else ''})")
    return cap


__all__ = ["Rule", "NameMap", "PlacementSpec", "Capture", "install", "from_env", "declared", "of_sibling",
           "weight_placement", "dtensor_placement"]
