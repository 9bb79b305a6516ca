"""A pipelined engine's dump (``TPCHECK_DUMP`` under vLLM's ``pipeline_parallel_size``), replayed by ``tpcheck
compare`` as one engine of ``pp`` stages.

Layout: one ``tpcheck.capture.dump`` directory per stage, its ranks numbered by TP rank within the stage::

    DIR/stage{s}/stage.json            {"stage": s, "pp": pp, "layers": [start, end]}   (TP rank 0 writes it)
    DIR/stage{s}/rank{r}/step{n}.*     what TP rank r of stage s recorded at step n

Each stage records its own layers' points (and, where it sends or receives across a boundary, the hand-off
``layers.{i}.handoff``); every stage must record the same steps, requests, tokens and positions, the same tp and
dtype, and the stages' layers must follow one another from layer 0. ``PipelineDumpAdapter`` takes each point from
the stage that computed it (``tpcheck.engines.impl.adapter.stage_points``, vLLM's owner rule
``tpcheck.capture.points.fused_out_stage``), the hand-off held bit for bit to what the stage before sent."""
from __future__ import annotations

import re
from pathlib import Path

from tpcheck.capture.dump_format import DumpError
from tpcheck.engines.adapter import EngineAdapter
from tpcheck.engines.dump.replay import Dump, DumpAdapter, read_dump
from impl.config import load_config
from tpcheck.capture.points import fused_out_stage, model_point_names, point_stage, stage_handoffs
from tpcheck.capture.rounding import least_known
from tpcheck.engines.impl.adapter import stage_points
from tpcheck.capture.stages import STAGE_FILE
from tpcheck.inputs.files.validate import int_in, read_json

_STAGE = re.compile(r"stage(\d+)")


def is_pipeline_dump(root: str | Path) -> bool:
    """Whether ``root`` holds per-stage dumps (``stage{s}/`` directories)."""
    root = Path(root)
    return root.is_dir() and any(d.is_dir() and _STAGE.fullmatch(d.name) for d in root.iterdir())


def open_dump(root: str | Path, reductions) -> tuple[Dump, object, tuple[tuple[int, int], ...] | None]:
    """``tpcheck compare``'s dump: (its first stage's ``Dump``, the adapter that replays it, the stages' layers or
    None). ``DIR/stage{s}/`` directories: a pipelined engine's (``PipelineDumpAdapter``); else one ``DumpAdapter``.
    ``reductions(tp)``: the engine's declared reductions."""
    if not is_pipeline_dump(root):
        dump = read_dump(root)
        return dump, DumpAdapter(dump, reductions(dump.tp)), None
    dumps, stages = read_pipeline_dump(root)
    return dumps[0], PipelineDumpAdapter(dumps, stages, reductions(dumps[0].tp)), stages


def stage_options(engine, stages: tuple[tuple[int, int], ...] | None, model: str) -> dict:
    """The ``DiffOptions`` fields of a pipelined dump (``pp`` and the stages' layer counts: the golden's hand-off
    points), and the points ``engine`` (a ``PipelineDumpAdapter``) must find each stage reporting (else exit 3) on
    the checkpoint ``model``; ``{}`` for one stage. Stages that do not cover ``model``'s layers are a
    ``DumpError`` naming the last stage's file."""
    if stages is None:
        return {}
    cfg = load_config(model)
    if stages[-1][1] != cfg.num_layers:  # named here: as --pp-partition it would name a flag nobody gave
        where = Path(engine.dump.root).parent / f"stage{len(stages) - 1}" / STAGE_FILE
        raise DumpError(f"{where}: the stages' layers end at layer {stages[-1][1]}, but --model {model} has "
                        f"{cfg.num_layers} layers (a dump of another model, or a stage file changed)")
    sizes = [end - start for start, end in stages]
    engine.expected = tuple(model_point_names(cfg, engine.decode_steps > 0, stage_handoffs(sizes)))
    return {"pp": len(stages), "pp_partition": ",".join(map(str, sizes))}


def read_pipeline_dump(root: str | Path) -> tuple[list[Dump], tuple[tuple[int, int], ...]]:
    """Each stage's ``Dump`` and its layers ``[start, end)``; a missing stage, a stage file that names another
    stage or count, layers that do not follow one another, or stages that disagree on the run (tp, dtype, steps,
    requests, tokens) is a ``DumpError`` naming the stage and the file."""
    root = Path(root)
    found = sorted(int(m.group(1)) for d in root.iterdir() if d.is_dir() and (m := _STAGE.fullmatch(d.name)))
    dumps, stages = [], []
    for s in found:
        where = root / f"stage{s}" / STAGE_FILE
        meta = read_json(where, DumpError, "pipeline stage")
        pp = int_in(meta.get("pp"), 1, 1024, f"{where}: pp", DumpError)
        layers = meta.get("layers")
        if meta.get("stage") != s or not isinstance(layers, list) or len(layers) != 2:
            raise DumpError(f"{where}: must name stage {s} and its layers [start, end], got {meta}")
        start, end = (int_in(x, 0, 2**20, f"{where}: layers", DumpError) for x in layers)
        if found != list(range(pp)):
            raise DumpError(f"{root}: pp={pp} ({where}) but stage directories {found}")
        want = stages[-1][1] if stages else 0
        if start != want or end <= start:
            raise DumpError(f"{where}: layers [{start}, {end}) do not follow the stage before (next layer {want})")
        stages.append((start, end))
        dumps.append(read_dump(root / f"stage{s}"))
    first = dumps[0]
    for s, d in enumerate(dumps[1:], 1):
        for what, a, b in (("tp", d.tp, first.tp), ("dtype", d.dtype, first.dtype),
                           ("requests and tokens", [(x.ids, x.tokens, x.starts) for x in d.batches],
                            [(x.ids, x.tokens, x.starts) for x in first.batches])):
            if a != b:
                raise DumpError(f"{root}/stage{s}: {what} differ from stage 0's (stages of different runs)")
    return dumps, tuple(stages)


class PipelineDumpAdapter(EngineAdapter):
    """The stages' dumps replayed as one engine (``tpcheck.engines.adapter.EngineAdapter``, as ``DumpAdapter``):
    each step's points from the stage that computed them, a boundary's hand-off checked against what the stage
    before sent (a finding in ``point_notes``), a stage that recorded none of its expected points exit 3."""

    def __init__(self, dumps: list[Dump], stages: tuple[tuple[int, int], ...], reductions=None):
        self.parts = [DumpAdapter(d, reductions) for d in dumps]
        self.dump, self.stages, self.reductions = dumps[0], stages, reductions
        self.tp = dumps[0].tp
        self.rounding = least_known(d.rounding for d in dumps)  # the stages' declared rounding, as one
        # vLLM adds a stage's last output in the next stage's fused norm: that stage reports it
        self.point_stage = fused_out_stage if self.dump.engine == "vllm" else point_stage
        self.expected: tuple[str, ...] = ()
        self.point_notes: dict[str, str] = {}
        self.point_rows: dict[str, list[int]] = {}

    @property
    def prompts(self) -> list[list[int]]:
        return self.parts[0].prompts

    @property
    def decode_steps(self) -> int:
        return self.parts[0].decode_steps

    def schedule(self, step: int):
        return self.parts[0].schedule(step)

    def recorded_tokens(self, step: int) -> list[list[int]]:
        return self.parts[0].recorded_tokens(step)

    def begin(self, prompts, decode_steps) -> None:
        for p in self.parts:
            p.begin(prompts, decode_steps)

    def lacking(self, names: list[str]) -> dict[str, int]:
        """``DumpAdapter.lacking`` of each name in the stage that computes it."""
        out: dict[str, int] = {}
        for n in names:
            out.update(self.parts[self.point_stage(n, self.stages)].lacking([n]))
        return out

    def step(self, new_tokens, teacher, capture_kv):
        per_rank: list[dict] = []
        self.point_rows = {}
        for part in self.parts:
            points = part.step(new_tokens, teacher, capture_kv)
            self.point_rows.update(part.point_rows)
            per_rank += [{n: (p, ranks[r]) for n, (p, ranks) in points.items() if ranks[r] is not None}
                         for r in range(self.tp)]
        self.point_notes = {}
        return stage_points(per_rank, self.tp, self.stages, self.expected, self.point_notes, owner=self.point_stage)

    def close(self) -> None:
        for p in self.parts:
            p.close()
