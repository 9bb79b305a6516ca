"""An SGLang dumper directory read into tpcheck's dump model: ``SglangDump`` is a ``tpcheck.engines.dump.replay.Dump``
whose ``points(step)`` reads SGLang's files, so ``DumpAdapter`` replays it and ``tpcheck compare`` judges it
exactly as it judges tpcheck's own dumps (no second pipeline).

``read_sglang_dump``: the files' names parsed and mapped by the rules (``rules.py``), the steps' requests from
the auxiliary dumps (``batches.py``), the world and tp sizes from the files' meta, every rank present. A point's
files are loaded (safely: ``files.py``) and unsharded (``assemble.py``) when its step is compared."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from impl.config import load_config
from impl.placements import Fused, Shard
from impl.shard_plan import kv_split
from tpcheck.engines.dump.replay import Dump, DumpAdapter
from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.sglang_dump import batches, passes, rules as name_rules, sniff_format
from tpcheck.engines.sglang_dump.assemble import PARALLEL_INFO_KEYS, assemble, axis_coords
from tpcheck.engines.sglang_dump.dims import parse_dims
from tpcheck.engines.sglang_dump.files import DumpFile, load_file, scan
from tpcheck.engines.dump.stages import open_dump

_HIDDEN_KINDS = {"embed", "input_norm", "attn.out", "attn.residual", "post_attn_norm", "mlp.out", "out", "final_norm",
                 "moe.experts", "moe.shared"}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class NameReport:
    """What became of every dumped name: ``mapped`` {name: point}, ``ignored`` {name: the rule that says so},
    ``unmapped`` {name: one of its files} (no rule matches)."""

    mapped: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"names:      {len(self.mapped)} mapped to points, {len(self.ignored)} not compared by a rule, "
               f"{len(self.unmapped)} unmapped"]
        out += [f"  not compared: {n}  ({r})" for n, r in sorted(self.ignored.items())]
        out += [f"  UNMAPPED:     {n}  (e.g. {f})" for n, f in sorted(self.unmapped.items())]
        return out


@dataclass
class SglangDump(Dump):
    """A ``Dump`` read from SGLang's dumper files: ``index[step][point]`` the files of that point (every rank),
    ``rule_of`` each point's rule, ``cfg`` the checkpoint's config (the fused parts' widths), ``steps`` SGLang's
    own step numbers (tpcheck numbers them from 0)."""

    index: list[dict[str, list[DumpFile]]] = field(default_factory=list)
    rule_of: dict[str, name_rules.NameRule] = field(default_factory=dict)
    cfg: object = None
    steps: list[int] = field(default_factory=list)
    names: NameReport = field(default_factory=NameReport)

    def points(self, step: int) -> dict:
        out = {}
        for point, files in self.index[step].items():
            rule = self.rule_of[point]
            placement, tensors, dims = assemble_files(files, rule)
            where = str(files[0].path)
            if rule.parts:
                placement = self._fused(rule.parts, placement, tensors[0], where)
            else:
                placement = self._kv_replicas(point, placement)
                self._check_width(point, placement, tensors, where, dims)
            out[point] = (placement, tensors)
        return out

    def _kv_replicas(self, point: str, placement):
        """Keys split over tp where tp exceeds the KV heads: each rank holds one head, ``tp // kv_heads`` ranks the
        same one (``impl.shard_plan.kv_split``); the dims grammar has no spelling for that, so ``h[tp]`` is read
        with the replicas the model's KV heads imply (checked by the width, compared by the replica rule)."""
        if point.endswith(".attn.k_rope") and placement == Shard(-1):
            _, replicas = kv_split(self.cfg.num_kv_heads, self.tp)
            return Shard(-1, replicas)
        return placement

    def _check_width(self, point: str, placement, tensors: list[torch.Tensor], where: str, dims) -> None:
        """The whole point's width (the ranks' widths summed where tp splits the features) must be the model's:
        a tensor split over tp but annotated as replicated (or the reverse) is a wrong annotation, named here."""
        cfg = self.cfg
        kind = point.split(".", 2)[-1] if point.startswith("layers.") else point
        hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        want = {"attn.q_rope": q, "attn.context": q, "attn.k_rope": kv, "mlp.act": cfg.intermediate_size,
                "logits": cfg.vocab_size}.get(kind, hidden if kind in _HIDDEN_KINDS else None)
        split = isinstance(placement, Shard) and placement.dim == -1
        got = sum(t.shape[-1] for t in tensors) // (placement.replicas if split else 1) if split \
            else tensors[0].shape[-1]
        if want is not None and got != want:
            raise DumpError(f"{where}: {point} is {got} wide as dims {dims.text if dims else None!r} assemble it, the "
                            f"model's is {want}: the dims annotation is wrong (or the rule maps another tensor)")

    def _fused(self, parts: tuple[str, ...], placement, t: torch.Tensor, where: str) -> Fused:
        """A fused output's per-rank parts (``q k v``: the heads and KV heads each rank holds; ``gate up``: the
        intermediate size over tp), checked against the tensor's width."""
        cfg, tp = self.cfg, self.tp
        if tp > 1 and placement != Shard(-1):
            raise DumpError(f"{where}: a fused {'|'.join(parts)} output must be split over tp on its features "
                            f"(dims ... h[tp]), got {placement}")
        if parts == ("q", "k", "v"):
            kv_heads, replicas = kv_split(cfg.num_kv_heads, tp)
            q, kv = cfg.num_heads // tp * cfg.head_dim, kv_heads * cfg.head_dim
            spec = (("q", q, Shard(-1)), ("k", kv, Shard(-1, replicas)), ("v", kv, Shard(-1, replicas)))
        else:
            w = cfg.intermediate_size // tp
            spec = (("gate", w, Shard(-1)), ("up", w, Shard(-1)))
        if sum(w for _, w, _ in spec) != t.shape[-1]:
            raise DumpError(f"{where}: {t.shape[-1]} features per rank, but {'|'.join(parts)} of this model at tp "
                            f"{tp} is {'+'.join(str(w) for _, w, _ in spec)} (another checkpoint, or wrong dims)")
        return Fused(spec)


def assemble_files(files: list[DumpFile], rule: name_rules.NameRule):
    """(tp placement, per-tp-rank tensors, dims) of one name at one step from every rank's file, unsharded by the
    files' dims (else the rule's); a list where a tensor belongs, or ranks annotated differently, a DumpError."""
    loaded = []
    for f in files:
        value, meta = load_file(f)
        if not isinstance(value, torch.Tensor):
            raise DumpError(f"{f.path}: {f.name} holds a list, not a tensor")
        dims = parse_dims(meta["dims"], str(f.path)) if meta.get("dims") is not None else rule.dims_for(value.dim())
        loaded.append((str(f.path), value, axis_coords(meta, str(f.path)), dims))
    dims = loaded[0][3]
    for where, _, _, d in loaded[1:]:
        if d != dims:
            raise DumpError(f"{where}: dims {d.text if d else None!r}, rank 0's {dims.text if dims else None!r}")
    placement, tensors = assemble(files[0].name, [(w, t, c) for w, t, c, _ in loaded], dims)
    return placement, tensors, dims


def dump_root(root: Path) -> Path:
    """The directory holding the files: ``root`` itself, or its one experiment directory (SGLang writes
    ``{DUMPER_DIR}/{exp_name}/``); several experiments there are an error naming them."""
    if not root.is_dir():
        raise DumpError(f"{root}: no such dump directory")
    if any(p.suffix == ".pt" for p in root.iterdir()):
        return root
    exps = sorted(d for d in root.iterdir() if d.is_dir() and any(p.suffix == ".pt" for p in d.iterdir()))
    if len(exps) != 1:
        raise DumpError(f"{root}: {'no' if not exps else len(exps)} experiment directories of .pt files "
                        f"{[d.name for d in exps][:5]}; give the one to compare")
    return exps[0]


def read_sglang_dump(root: str | Path, model: str, rule_files=(), allow_unmapped: bool = False,
                     layout: str = "sglang") -> SglangDump:
    """Read and check the dump under ``root`` for the checkpoint ``model``; every inconsistency (an unmapped name
    unless ``allow_unmapped``, a missing rank or step's auxiliary values, a pickled object) a DumpError naming the
    file. ``layout``: ``"sglang"`` the dumper's ``key=value___...pt`` files, ``"sglang-passes"`` the older
    forward-hook dumper's ``TP*_PP*_Rank*_pid*/Pass*.pt`` (``passes.py``: its own rules first)."""
    extra = [Path(p) for p in rule_files] + ([passes.RULES] if layout == "sglang-passes" else [])
    root = Path(root) if layout == "sglang-passes" else dump_root(Path(root))
    if not root.is_dir():
        raise DumpError(f"{root}: no such dump directory")
    cfg = load_config(model)
    files = passes.scan(root) if layout == "sglang-passes" else scan(root)
    report, aux, by_step, rule_of = NameReport(), {}, {}, {}
    for f in files:
        if f.name in batches.AUX_NAMES:
            aux.setdefault(f.step, {}).setdefault(f.name, []).append(f)
    tp, first_meta, steps, step_batches = read_batches(root, files, aux)
    engine = next((k.rsplit("_parallel_info", 1)[0] for k in PARALLEL_INFO_KEYS if k in first_meta), "sglang")
    rule_list = name_rules.for_run(name_rules.load_rules(extra), cfg.model_type, engine)
    for f in files:
        if f.name in batches.AUX_NAMES:
            continue
        m = name_rules.match(rule_list, f.name, f.tags.get("layer_id"), cfg.num_layers, str(f.path))
        if m is None:
            report.unmapped.setdefault(f.name, str(f.path))
        elif m.point is None:
            report.ignored.setdefault(f.name, m.rule.source)
        else:
            if report.mapped.setdefault(f.name, m.point) != m.point:
                raise DumpError(f"{f.path}: {f.name} maps to {m.point}, in another file to {report.mapped[f.name]}")
            by_step.setdefault(f.step, {}).setdefault(m.point, []).append(f)
            rule_of[m.point] = m.rule
    if report.unmapped and not allow_unmapped:
        names = sorted(report.unmapped)
        raise DumpError(f"{report.unmapped[names[0]]}: {len(names)} dumped name(s) no rule maps to a tpcheck point: "
                        f"{names[:8]}; add a rule (--name-rules FILE.toml, see docs/sglang.md) or pass "
                        "--allow-unmapped to compare the rest")
    _check_sources(report, root)
    index = [by_step.get(s, {}) for s in steps]
    for s in set(by_step) - set(steps):
        raise DumpError(f"{next(iter(by_step[s].values()))[0].path}: step {s} has points but no input_ids / "
                        "positions / seq_lens")
    for b, pts in zip(step_batches, index):
        b.rows.update({p: batches.last_rows(b) for p in pts if rule_of[p].rows == "last"})
    dtype = _dtype(index)
    return SglangDump(root, tp, dtype, engine if engine == "sglang" else f"{engine}-dumper",
                      [b.tokens for b in step_batches], [b.starts for b in step_batches], batches=step_batches,
                      point_names=[frozenset(n for p in pts for n in _with_parts(p, rule_of[p])) for p in index],
                      index=index, rule_of=rule_of, cfg=cfg, steps=steps, names=report)


def read_batches(root: Path, files: list[DumpFile], aux: dict[int, dict[str, list[DumpFile]]]):
    """(tp size, a file's meta, SGLang's step numbers, each step's ``StepBatch``) from the auxiliary files ``aux``
    ({step: {name: every rank's files}}): every world rank present, every rank's batch the same."""
    steps = sorted(aux)
    if not steps:
        raise DumpError(f"{root}: no input_ids / positions / seq_lens dumped: the requests of each step come from "
                        "SGLang's auxiliary dumps (non-intrusive mode core or all)")
    world, tp, first_meta = _world(root, files, aux[steps[0]])
    ids, step_batches = batches.RequestIds(), []
    for s in steps:
        values = {name: _agreed(name, fs, world) for name, fs in aux[s].items()}
        step_batches.append(batches.step_batch(values, ids, s))
    return tp, first_meta, steps, step_batches


def _with_parts(point: str, rule) -> list[str]:
    return [point] + [point + p for p in rule.parts]


def _check_sources(report: NameReport, root: Path) -> None:
    """Two dumped names mapped to one point would be compared twice as one: refused."""
    seen: dict[str, str] = {}
    for name, point in report.mapped.items():
        if point in seen and seen[point] != name:
            raise DumpError(f"{root}: {seen[point]!r} and {name!r} both map to {point}: give one a rule of its own "
                            "(point = \"\" to leave it out)")
        seen[point] = name


def _world(root: Path, files: list[DumpFile], aux0: dict) -> tuple[int, int, dict]:
    """(world size, tp size, a meta) from step 0's ``input_ids`` files; every world rank must have written files."""
    f0 = aux0.get("input_ids", [None])[0] or next(iter(aux0.values()))[0]
    _, meta = load_file(f0)
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise DumpError(f"{f0.path}: meta world_size {world!r} is not a positive integer")
    coords = axis_coords(meta, str(f0.path))
    tp = coords.get("tp", (0, 1))[1]
    if world > 1 and not any(isinstance(meta.get(k), dict) for k in PARALLEL_INFO_KEYS):
        raise DumpError(f"{f0.path}: world_size {world} but no parallel info ({', '.join(PARALLEL_INFO_KEYS)}): "
                        "the tp rank of each file cannot be told")
    for key in ("pp_size", "attn_dp_size", "moe_dp_size"):
        info = next((meta[k] for k in PARALLEL_INFO_KEYS if isinstance(meta.get(k), dict)), {})
        if isinstance(info.get(key), int) and info[key] > 1:
            raise DumpError(f"{f0.path}: {key} {info[key]}: dumps of pipeline or data parallel runs are not read yet")
    ranks = {f.rank for f in files}
    if ranks != set(range(world)):
        raise DumpError(f"{root}: world_size {world} ({f0.path}) but files of ranks {sorted(ranks)} (missing "
                        f"{sorted(set(range(world)) - ranks)})")
    return world, tp, meta


def _agreed(name: str, files: list[DumpFile], world: int):
    """An auxiliary value every rank dumped: the same on each (the step's batch is one), else a DumpError. A value
    dumped again in a step (the dumper writes one under its own name wherever a module takes it as a keyword:
    SGLang's Gemma 3 hands its layers ``positions=`` as ``[1, tokens]`` on GPUs) must hold the same values; a tensor
    is read flat, as the batch's one dim."""
    if len({f.rank for f in files}) != world:
        missing = sorted(set(range(world)) - {f.rank for f in files})
        raise DumpError(f"{files[0].path}: step {files[0].step}: no {name} from rank(s) {missing}")
    flat = lambda v: v.reshape(-1) if isinstance(v, torch.Tensor) else v  # noqa: E731
    v0 = flat(load_file(files[0])[0])
    for f in files[1:]:
        v = flat(load_file(f)[0])
        same = torch.equal(v, v0) if isinstance(v, torch.Tensor) and isinstance(v0, torch.Tensor) else v == v0
        if not same:
            raise DumpError(f"{f.path}: {name} differs from {files[0].path}: ranks of one step ran other batches")
    return v0, str(files[0].path)


def _dtype(index: list[dict[str, list[DumpFile]]]) -> str:
    """The run's dtype: that of its first floating-point point."""
    for pts in index:
        for files in pts.values():
            value, _ = load_file(files[0])
            if isinstance(value, torch.Tensor) and value.dtype in _DTYPES:
                return _DTYPES[value.dtype]
    raise DumpError("the dump holds no floating-point point (float32, bfloat16, float16) to compare")


def open_any(root: str | Path, fmt: str, model: str, reductions, rule_files=(), allow_unmapped: bool = False):
    """``tpcheck compare``'s dump in format ``fmt`` (``"auto"``: ``sniff_format``): (its ``Dump``, the adapter that
    replays it, a pipelined dump's stages or None); tpcheck's own by ``tpcheck.engines.dump.stages.open_dump``."""
    fmt = sniff_format(root) if fmt == "auto" else fmt
    if fmt.startswith("sglang"):
        return open_sglang(root, fmt, model, reductions, rule_files, allow_unmapped)
    return open_dump(root, reductions)


def open_sglang(root: str | Path, fmt: str, model: str, reductions, rule_files=(), allow_unmapped: bool = False):
    """``tpcheck compare --format sglang``'s dump: (the ``SglangDump``, the ``DumpAdapter`` that replays it, None:
    one stage), its names' fate printed first (what is compared, what a rule leaves out, what no rule maps).
    ``fmt``: ``"sglang"`` (the dumper's files, or ``--format sglang`` given for either layout) or
    ``"sglang-passes"`` (the older forward-hook dumper's Pass files)."""
    if fmt == "sglang" and sniff_format(root) == "sglang-passes":
        fmt = "sglang-passes"
    dump = read_sglang_dump(root, model, rule_files, allow_unmapped, fmt)
    print("\n".join(dump.names.lines()))
    return dump, DumpAdapter(dump, reductions(dump.tp)), None
