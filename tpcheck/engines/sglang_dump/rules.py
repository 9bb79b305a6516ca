"""The name rules: which canonical point (``tpcheck.capture.points``) each dumped name is.

A rule file is TOML, a list of ``[[rule]]`` tables (the shipped one, ``rules.toml`` beside this module, documents
the fields and covers SGLang's and vLLM's Qwen2 / Llama / Mistral / Qwen3 / Qwen2-MoE / Gemma 3 module names). A
user's file (``tpcheck compare --name-rules FILE``) is read first, so its rules win. Every dumped name ends in one of
three ways, all reported: mapped to a point, ignored by a rule that says so (``point = ""``), or unmapped (no
rule matches: ``tpcheck compare`` refuses the dump, listing them, unless ``--allow-unmapped``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpcheck.capture.dump_format import DumpError
from tpcheck.capture.points import all_point_names
from tpcheck.engines.sglang_dump.dims import Dims, parse_dims

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

SHIPPED = Path(__file__).with_name("rules.toml")
FUSED_PARTS = (("q", "k", "v"), ("gate", "up"))
_KEYS = {"name", "point", "parts", "dims", "rows", "model_type", "engine"}
ENGINES = ("sglang", "vllm", "megatron")  # whose dumper wrote the files (the meta's ``{engine}_parallel_info``)
_TEMPLATE = re.compile(r"\{(\w*)\}")
_CANONICAL = set(all_point_names(6))


@dataclass(frozen=True)
class NameRule:
    """One rule (see ``rules.toml``): ``pattern`` fullmatches a dumped name, ``point`` the canonical template
    (``""``: not compared), ``parts`` a fused output's, ``dims`` the annotation where a file has none (several: the
    one that names as many dims as the tensor has), ``rows`` ``"last"`` for a point of each request's last row
    only, ``model_types`` / ``engines`` the checkpoints' ``model_type`` and the dumpers the rule is for (empty: any);
    ``source`` the file and index it came from."""

    pattern: re.Pattern
    point: str
    parts: tuple[str, ...] = ()
    dims: tuple[Dims, ...] = ()
    rows: str = "all"
    source: str = ""
    model_types: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()

    def dims_for(self, ndim: int) -> Dims | None:
        """The rule's annotation for a tensor of ``ndim`` dims: the alternative naming that many, else the first
        (whose misfit ``assemble`` then names), None where the rule gives none."""
        return next((d for d in self.dims if len(d.dims) == ndim), self.dims[0] if self.dims else None)

    def applies(self, model_type: str | None, engine: str | None) -> bool | None:
        """Whether the rule is for this checkpoint and dumper: True, False, or None where one it is restricted by
        is not known (two dumps compared without a checkpoint)."""
        known = True
        for allowed, value in ((self.model_types, model_type), (self.engines, engine)):
            if allowed and value is None:
                known = None
            elif allowed and value not in allowed:
                return False
        return known

    def point_name(self, layer: int | None, last: int) -> str | None:
        """The canonical name at layer ``layer`` (None where the template has none: ``{prev}`` of layer 0)."""
        keys = {"layer": layer, "prev": None if layer in (None, 0) else layer - 1, "last": last}
        if any(keys[k] is None for k in _TEMPLATE.findall(self.point)):
            return None
        return self.point.format(**keys)


@dataclass(frozen=True)
class Match:
    rule: NameRule
    point: str | None  # None: ignored by the rule (or a {prev} of layer 0)


def load_rules(extra: list[Path] | tuple[Path, ...] = ()) -> list[NameRule]:
    """The user's rule files (in order), then the shipped ones; a malformed rule is a DumpError naming its file."""
    return [r for path in [*extra, SHIPPED] for r in _read(Path(path))]


def _read(path: Path) -> list[NameRule]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise DumpError(f"{path}: cannot read the name rules: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise DumpError(f"{path}: not TOML: {e}") from None
    if set(doc) - {"rule"} or not isinstance(doc.get("rule", []), list):
        raise DumpError(f"{path}: a rule file holds [[rule]] tables only, got {sorted(doc)}")
    return [_rule(t, f"{path} rule {i + 1}") for i, t in enumerate(doc.get("rule", []))]


def _rule(t: dict, where: str) -> NameRule:
    if not isinstance(t, dict) or set(t) - _KEYS or not {"name", "point"} <= set(t):
        raise DumpError(f"{where}: a rule has name and point, optionally parts, dims, rows, model_type, engine (got "
                        f"{sorted(t) if isinstance(t, dict) else t!r})")
    name, point = t["name"], t["point"]
    if not isinstance(name, str) or not isinstance(point, str):
        raise DumpError(f"{where}: name and point must be strings")
    try:
        pattern = re.compile(name.replace("{layer}", r"(?P<layer>\d+)"))
    except re.error as e:
        raise DumpError(f"{where}: name {name!r} is not a regex: {e}") from None
    parts = tuple(t.get("parts", ()))
    if parts and parts not in FUSED_PARTS:
        raise DumpError(f"{where}: parts {list(parts)} is not one of {[list(p) for p in FUSED_PARTS]}")
    if point and point.endswith(".") != bool(parts):
        raise DumpError(f"{where}: a fused point ends with '.' and names its parts (point {point!r}, parts "
                        f"{list(parts)})")
    unknown = set(_TEMPLATE.findall(point)) - {"layer", "prev", "last"}
    if unknown:
        raise DumpError(f"{where}: point {point!r} uses {sorted(unknown)}; only {{layer}}, {{prev}}, {{last}}")
    rows = t.get("rows", "all")
    if rows not in ("all", "last"):
        raise DumpError(f"{where}: rows must be \"all\" or \"last\", got {rows!r}")
    dims = t.get("dims", [])
    dims = tuple(parse_dims(d, where) for d in ([dims] if isinstance(dims, str) else dims))
    model_types, engines = _names(t, "model_type", where), _names(t, "engine", where)
    if bad := set(engines) - set(ENGINES):
        raise DumpError(f"{where}: engine {sorted(bad)} is not one of {list(ENGINES)}")
    rule = NameRule(pattern, point, parts, dims, rows, where, model_types, engines)
    for n in ([] if not point else [rule.point_name(3, 5)]):
        names = [n + p for p in parts] if parts else [n]
        if any(x not in _CANONICAL for x in names):
            raise DumpError(f"{where}: point {point!r} is not a canonical point (tpcheck.capture.points)")
    return rule


def _names(t: dict, key: str, where: str) -> tuple[str, ...]:
    """A rule's ``model_type`` / ``engine``: one string or a list of them."""
    v = t.get(key, [])
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise DumpError(f"{where}: {key} must be a string or a list of strings, got {t[key]!r}")
    return tuple(v)


def for_run(rules: list[NameRule], model_type: str | None, engine: str | None) -> list[NameRule]:
    """The rules that apply to a dump of a ``model_type`` checkpoint written by ``engine``'s dumper, in order; where
    either is not known (None), the rules restricted by it come after every unrestricted one (tried only where no
    rule for any model matches)."""
    fate = [(r, r.applies(model_type, engine)) for r in rules]
    return [r for r, a in fate if a] + [r for r, a in fate if a is None]


def match(rules: list[NameRule], name: str, layer_tag: str | None, num_layers: int, where: str) -> Match | None:
    """The first rule matching ``name`` and the point it gives (None: no rule matches). The layer is the
    pattern's ``{layer}``, else the file's ``layer_id`` tag; a point that needs one and has neither, or a layer
    outside the model, is a DumpError naming the file. ``rules``: ``for_run``'s, for the dump's model and dumper."""
    for rule in rules:
        m = rule.pattern.fullmatch(name)
        if m is None:
            continue
        if not rule.point:
            return Match(rule, None)
        layer = m.groupdict().get("layer") or layer_tag
        if layer is not None and not str(layer).isdigit():
            raise DumpError(f"{where}: layer_id {layer!r} is not a layer index")
        layer = None if layer is None else int(layer)
        if layer is not None and layer >= num_layers:
            raise DumpError(f"{where}: layer {layer} of a model of {num_layers} layers (another checkpoint's dump?)")
        if layer is None and re.search(r"\{(layer|prev)\}", rule.point):
            raise DumpError(f"{where}: rule {rule.source} gives {rule.point!r}, but the name has no layer and the "
                            "file no layer_id tag")
        return Match(rule, rule.point_name(layer, num_layers - 1))
    return None


def engine_name(rules: list[NameRule], point: str, num_layers: int) -> tuple[str, NameRule, int | None] | None:
    """The dumped name a rule gives ``point`` (the first rule that does; a fused point by its ``.`` name), that
    rule and the layer of the module it names (None: outside the layers): what a writer of the format calls the
    point. None where no rule gives it. ``rules``: ``for_run``'s, for the run's model and the dumper written."""
    for rule in rules:
        if not rule.point:
            continue
        for layer in ([None] if "{" not in rule.point else range(num_layers)):
            if rule.point_name(layer, num_layers - 1) == point:
                return _unpattern(rule.pattern.pattern, layer), rule, layer
    return None


def _unpattern(pattern: str, layer: int | None) -> str:
    """A rule's regex back to the one name it matches at ``layer`` (the shipped rules' patterns: escaped dots,
    an optional group taken as absent)."""
    text = pattern.replace(r"(?P<layer>\d+)", str(layer))
    text = re.sub(r"\([^()]*\)\?", "", text)
    return text.replace("\\.", ".")
