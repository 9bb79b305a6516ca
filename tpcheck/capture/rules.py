"""Name-map rules for ``tpcheck.capture``: ``Rule`` (one capture site: a module-name pattern, the canonical point it
gives, which input / output element, and its placement), ``NameMap`` (one engine's rules) and the placement
specs a rule can read at each call (``declared``, ``of_sibling``, ``weight_placement``; ``dtensor_placement`` for
a DTensor). The hooks that apply them: ``tpcheck.capture.core``."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from impl.placements import Partial, Replicate, Shard
from tpcheck.capture.points import all_point_names, point_names

_LAYER_GROUP = "{layer}"
_FORMAT_KEYS = re.compile(r"\{(\w*)\}")

PlacementSpec = object  # a Placement, or a callable (module, parent module) -> Placement, read at each call


@dataclass(frozen=True)
class Rule:
    """One capture site. ``module``: a regex fullmatched against a module's qualified name (as
    ``model.named_modules()`` names it); ``{layer}`` stands for the layer index (``\\d+``). ``point``: the
    canonical name it gives, a template over ``{layer}``, ``{prev}`` (layer - 1: sites at a layer's input
    that carry the previous layer's output) and ``{last}`` (the last layer: sites after the decoder stack);
    a name ending in ``.`` is a fused output whose ``parts`` (the ``Fused`` placement's part names, in order)
    complete it (``layers.{layer}.attn.`` + ``q``/``k``/``v``). ``placement``: a ``Placement``, or a callable
    ``(module, parent) -> Placement`` read at every call (``declared()``, ``of_sibling(...)``). ``input``:
    take the module's input (a forward pre-hook) instead of its output. ``index``: which input (position, or
    keyword name) or which element of a tuple output (position) / attribute of an object output (name); a
    plain tensor output is element 0, and has no other element (the site then gives nothing that call).
    ``token_dims``: how many leading dims of this site's tensor are tokens, where it differs from the map's
    (Hugging Face's MoE modules work on ``[tokens, ...]``, its other modules on ``[batch, seq, ...]``).
    ``heads_first``: the tensor is ``[batch, heads, seq, head_dim]`` and its rows are taken after moving the heads
    behind the sequence (HF's Gemma 3 normalises q and k after transposing them). ``model_has`` / ``model_lacks``:
    the rule applies only to a model that has / lacks a module named ``<...>.<that name>``: one map serves
    families whose same-named module gives different points (Gemma 3's ``post_attention_layernorm`` normalises the
    attention's output, the other families' the MLP's input)."""

    module: str
    point: str
    placement: PlacementSpec = Replicate()
    input: bool = False
    index: int | str = 0
    parts: tuple[str, ...] = ()
    token_dims: int | None = None  # this site's leading token dims, where they differ from the map's
    heads_first: bool = False  # the tensor is [batch, heads, seq, head_dim] (HF Gemma 3's q/k norms): heads moved
    model_has: str = ""    # the rule applies only to a model with a module whose name ends with ".<this>"
    model_lacks: str = ""  # ... only to one without (Gemma 3's post_attention_layernorm is another point)

    def __post_init__(self):
        keys = set(_FORMAT_KEYS.findall(self.point)) - {"layer", "prev", "last"}
        if keys:
            raise ValueError(f"rule {self.module!r}: point {self.point!r} uses {sorted(keys)}; only "
                             "{layer}, {prev}, {last}")
        if (("{layer}" in self.point or "{prev}" in self.point) and _LAYER_GROUP not in self.module):
            raise ValueError(f"rule {self.module!r}: point {self.point!r} needs {{layer}} in the module pattern")
        if self.point.endswith(".") != bool(self.parts):
            raise ValueError(f"rule {self.module!r}: a fused point ends with '.' and names its parts "
                             f"(point {self.point!r}, parts {self.parts!r})")
        for name in self.names(3, 5):  # a point name tpcheck does not know is a misconfigured map
            if name not in _CANONICAL:
                raise ValueError(f"rule {self.module!r}: {name!r} is not a canonical point (tpcheck.capture.points)")

    def applies(self, suffixes: set[str]) -> bool:
        """Whether this rule applies to a model whose module names end with ``suffixes`` (each name's last part)."""
        return (not self.model_has or self.model_has in suffixes) and \
            (not self.model_lacks or self.model_lacks not in suffixes)

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(self.module.replace(_LAYER_GROUP, r"(?P<layer>\d+)"))

    def name(self, layer: int | None, last: int | None) -> str | None:
        """The point name at a site of layer ``layer`` (None where the site gives none: ``{prev}`` of layer 0,
        ``{last}`` of a model without layers)."""
        keys = {"layer": layer, "prev": None if layer is None or layer == 0 else layer - 1, "last": last}
        used = _FORMAT_KEYS.findall(self.point)
        if any(keys[k] is None for k in used):
            return None
        return self.point.format(**keys)

    def names(self, layer: int | None, last: int | None) -> list[str]:
        """The canonical names a site gives (fused: one per part)."""
        n = self.name(layer, last)
        return [] if n is None else [n + p for p in self.parts] if self.parts else [n]


_CANONICAL = set(all_point_names(6))  # every family's names (Qwen3's q/k norms too)


@dataclass(frozen=True)
class NameMap:
    """The rules of one engine's module tree. ``token_dims``: how many leading dims of a captured tensor are
    rows (1: ``[tokens, ...]``; 2: ``[batch, seq, ...]``, Hugging Face)."""

    name: str
    rules: tuple[Rule, ...]
    token_dims: int = 1
    doc: str = ""

    def reports(self, num_layers: int, qk_norm: bool = False) -> list[str]:
        """The canonical points this map gives for a model of ``num_layers`` layers, in execution order;
        ``qk_norm``: a model with per-head q/k norms (Qwen3), where the maps' ``attn.q_norm`` rules match."""
        got = set()
        for rule in self.rules:
            layers = range(num_layers) if _LAYER_GROUP in rule.module else [None]
            for i in layers:
                got.update(rule.names(i, num_layers - 1 if num_layers else None))
        return [n for n in point_names(num_layers, with_kv=True, qk_norm=qk_norm) if n in got]

    def not_reported(self, num_layers: int, with_kv: bool = False) -> list[str]:
        """The canonical points this map never gives (what ``tpcheck.judge.coverage`` will list as not reported)."""
        got = set(self.reports(num_layers))
        return [n for n in point_names(num_layers, with_kv) if n not in got]

    def without(self, *points: str) -> "NameMap":
        """This map less the rules whose point template is one of ``points`` (e.g. ``"layers.{prev}.out"``)."""
        return replace(self, rules=tuple(r for r in self.rules if r.point not in points))

    def with_placement(self, point: str, placement: PlacementSpec) -> "NameMap":
        """This map with the rules of point template ``point`` given another placement (e.g.
        ``VLLM_MAP.with_placement("layers.{layer}.attn.out", Partial())`` for an o_proj that does not
        all-reduce)."""
        if not any(r.point == point for r in self.rules):
            raise KeyError(f"{self.name}: no rule gives {point!r}")
        return replace(self, rules=tuple(replace(r, placement=placement) if r.point == point else r
                                         for r in self.rules))


def declared(attr: str = "output_placement") -> Callable:
    """Placement spec: the matched module's own attribute (impl's declared ``output_placement``)."""
    return lambda module, parent: getattr(module, attr)


def of_sibling(path: str, attr: str = "output_placement") -> Callable:
    """Placement spec: an attribute of a sibling module (``path`` relative to the matched module's parent),
    for a point captured from a module's input but produced by its sibling."""
    return lambda module, parent: getattr(parent.get_submodule(path), attr)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def dtensor_placement(t):
    """The ``impl.placements`` placement of a 1-D-mesh DTensor's local tensor: ``Shard(d)`` on the last dim
    → ``Shard(-1)``, ``Replicate`` → ``Replicate()``, ``Partial`` → ``Partial()``. Captured tensors are
    ``[rows, features]``: a shard along any other dim has no meaning there and is refused."""
    (p,) = t.placements  # tensor parallelism alone: a 1-D device mesh
    if p.is_replicate():
        return Replicate()
    if p.is_partial():
        return Partial()
    if p.is_shard() and p.dim in (-1, t.ndim - 1):
        return Shard(-1)
    raise ValueError(f"tpcheck.capture: a DTensor sharded as {p} (shape {tuple(t.shape)}): only the last dim "
                     "maps onto captured [rows, features]")


def weight_placement(side: str = "out") -> Callable:
    """Placement spec for a linear layer sharded by its weight, as transformers' ``tp_plan`` shards it (the
    weight a DTensor, the activations plain local tensors): ``side="out"``: a weight ``Shard(0)``
    (column-parallel) gives an output ``Shard(-1)``, anything else a full output (row-parallel outputs are
    all-reduced); ``side="in"``: a weight ``Shard(1)`` (row-parallel) takes its input ``Shard(-1)``."""
    want = 0 if side == "out" else 1

    def spec(module, parent):
        w = getattr(module, "weight", None)
        if _is_dtensor(w) and any(p.is_shard() and p.dim == want for p in w.placements):
            return Shard(-1)
        return Replicate()
    return spec
