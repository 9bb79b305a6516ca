"""The rows of one pass's step (``tpcheck.pipeline.steps``): each engine point unsharded
(``tpcheck.measure.unshard``) and checked against the canonical names, measured against the golden's rows (or
the rows it holds; the KV cache's rows), MoE routes compared as expert sets per token (``tpcheck.judge.routing``),
``--exact-ops``'s op checked, and the own-input error where a point comes near its threshold
(``tpcheck.measure.own_input``). A row holds measurements and, in its note, structural findings; the judge
(``tpcheck.judge``) sets its threshold, excess and verdict."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from tpcheck.capture.batches import StepBatch
from tpcheck.capture.points import all_point_names, kind_of, point_order, split_point
from tpcheck.judge.coverage import check_known
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure import exact_ops, own_attention, own_input, own_moe
from tpcheck.measure.ahead import Ahead
from tpcheck.measure.gain import RowScale, gain_fields, row_scale_allowance, scale_source
from tpcheck.measure.metrics import compare, mismatch, rel_err, ulp_floor
from tpcheck.measure.unshard import unshard
from tpcheck.measure.wording import shape_text
from tpcheck.pipeline.kv_history import KvHistory
from tpcheck.pipeline.routes import sort_unit_routes
from tpcheck.result.table import NAN, Row


class RowMaker:
    """One pass's row maker (``mode``: propagated or isolated), sharing the pass's noise floor (``floor``: its
    ``engine_rel_err`` and ``row_fields``) and route book (``routes``); ``reported`` and ``rows_not_produced`` are
    what the run's coverage counts."""

    def __init__(self, ctx, floor, routes, isolated: bool):
        self.ctx, self.floor, self.routes, self.isolated = ctx, floor, routes, isolated
        self.mode = "isolated" if isolated else "propagated"
        # every family's points (Qwen3's attn.q_norm / k_norm included), in execution order
        self.canonical = set(all_point_names(ctx.num_layers))
        self.reported: set[str] = set()  # the canonical points the engine reported (coverage)
        self.rows_not_produced: dict[str, int] = {}  # point -> golden rows the engine did not produce (coverage)
        self._ahead = Ahead()  # a step's statistics computed ahead (_rows)
        self._scales: dict[str, RowScale | None] = {}  # a step's per-row scale allowances (_rows)
        self.kv_history = KvHistory(ctx.num_layers)  # the KV cache as its own keys and values wrote it (_rows)

    def rows(self, step, points, gold, batch: StepBatch, order: list[int], eng_teacher, subsets) -> list[Row]:
        """Each reported point, unsharded and measured against the golden (``--exact-ops``: its op checked too);
        a point with only some of the step's rows (``subsets``) against those rows of the golden. The engine's own
        findings about a point this step (its adapter's ``point_notes``: a pipeline hand-off that arrived changed)
        come first in its row's note (a note fails the row); under ``--pp`` each row names the stage that reported
        its point (the adapter's ``stages``, and its ``point_stage`` where it reports a point elsewhere)."""
        rows = self._rows(step, points, gold, batch, order, eng_teacher, subsets)
        notes = self.ctx.engine.point_notes
        stages = self.ctx.engine.stages  # --pp: each stage's [start, end) layers
        owner = self.ctx.engine.point_stage  # vLLM: a stage's last output on the next
        for row in rows:
            if stages:
                row.stage = owner(row.point, stages)
            found = (notes or {}).get(row.point)
            if found:
                row.note = found + (f"; {row.note}" if row.note else "")
        return rows

    def _rows(self, step, points, gold, batch: StepBatch, order: list[int], eng_teacher, subsets) -> list[Row]:
        row_lens, kv_lens, starts = batch.row_lens, batch.kv_lens, batch.starts
        held: dict[str, torch.Tensor] = {}  # --exact-ops: the engine tensors the checked ops read
        layer_input = (lambda i, t=eng_teacher: t[i]) if eng_teacher is not None else \
            (lambda i, h=held: h["embed" if i == 0 else f"layers.{i - 1}.out"])
        rows: list[Row] = []
        units = []
        for name, (placement, per_rank) in points.items():
            parts = unshard(name, placement, per_rank)
            check_known({u.name for u in parts}, self.canonical)
            units += [(u, subsets.get(name)) for u in parts]
        if self.ctx.sparse:
            units = self._routes(units, gold)
        engine_of = {u.name: u.tensor for u, sub in units if sub is None}  # the op inputs own_input reads
        replicas_of = {u.name: u.replicas for u, sub in units if sub is None and u.replicas}  # rank r's, where differ
        # the KV cache as the run's own keys and values wrote it (each rank's, where they differ): the op of the
        # cache read back, and where the engine did not read it back (a dump) the context's keys and values (never
        # compared as points)
        engine_of, replicas_of = self.kv_history.step(batch, engine_of, replicas_of)
        self._ahead = Ahead()  # each whole point's statistics, started now in worker threads (_row takes them)
        self._scales = {u.name: self._row_scale(u.name, gold, engine_of, eng_teacher) for u, subset in units
                        if subset is None and u.name in gold}  # each whole point's per-row scale allowance
        for u, subset in units:
            g = gold.get(u.name)
            if g is not None and subset is None and self._selected(u.name) and kind_of(u.name).judged != "set" \
                    and not self.routes.excluded(u.name, self.isolated) and u.tensor.shape == g.shape:
                self._ahead.submit(u.name, measure, u.tensor, g, list(u.replicas.values()), self.isolated,
                                   self._scales.get(u.name), elements=g.numel())
        for u, subset in units:
            if u.name not in gold or not self._selected(u.name):
                continue
            if kind_of(u.name).judged == "set":
                rows.append(self._route_row(u, gold[u.name], step, row_lens, starts, order))
                self.reported.add(u.name)
                continue
            excluded = self.routes.excluded(u.name, self.isolated)
            if excluded:  # a token whose route legitimately differs: its rows are left out, and counted
                if self.ctx.exact_ops and split_point(u.name)[1] in exact_ops.INPUT_KINDS:
                    held[u.name] = u.tensor
                keep = [r for r in range(gold[u.name].shape[0]) if r not in set(excluded)]
                u = replace(u, tensor=u.tensor[keep], replicas={r: v[keep] for r, v in u.replicas.items()})
                rows.append(self._row(u, gold[u.name][keep], step, row_lens, starts, None, order, keep,
                                      rows_excluded=len(excluded)))
                self.reported.add(u.name)
                continue
            self.reported.add(u.name)
            want = None
            if self.ctx.exact_ops and subset is None:
                if split_point(u.name)[1] in exact_ops.INPUT_KINDS:
                    held[u.name] = u.tensor
                want = exact_ops.expected(self.ctx.ref.model, u.name, held.__getitem__, layer_input)
            g = gold[u.name]
            if subset is not None:
                self.rows_not_produced[u.name] = self.rows_not_produced.get(u.name, 0) + g.shape[0] - len(subset)
                g = g[subset]
            k = kind_of(u.name)
            where = (kv_lens, [0] * len(kv_lens)) if k.rows == "cache" else (row_lens, starts)
            rows.append(self._row(u, g, step, *where, want, order, subset))
            # a point of some rows (vLLM's logits: the sampled rows) too, where its op is row by row: the same op on
            # those rows of its inputs (attention's ops read other rows: their layout is the whole step's). A
            # routed point with a token's route flipped is left out above: its rows are not the op's
            if subset is None or k.name not in own_attention.KINDS:
                self._own(rows[-1], u, g, engine_of, replicas_of, eng_teacher,
                          own_attention.RowLayout(row_lens, starts, kv_lens), subset)
        return rows

    def _own(self, row: Row, u, golden: torch.Tensor, engine_of: dict, replicas_of: dict, eng_teacher,
             layout: own_attention.RowLayout, subset: list[int] | None = None) -> None:
        """``row.own_err`` and ``row.own_gain`` (``tpcheck.measure.own_input``) where the point exceeds half its
        threshold (the smaller of the default and the run's tolerances') or its gain half a lower bound of its gain
        threshold (``_gain_near``): its op recomputed on the engine's own inputs of this step (the teacher as the
        layer input when isolated); ``row.replica_own_err`` the same of each replica that differs, on its own rank's
        inputs (an input's replica of that rank where it differs). ``subset``: the rows the point holds (of a
        row-by-row op), taken of each input too."""
        dt = str(self.ctx.dtype).removeprefix("torch.")
        layer, kind = split_point(row.point)
        tols = (Tolerances(),) if self.ctx.tolerances is None else (Tolerances(), self.ctx.tolerances)
        worst = max(row.rel_err, row.replica_rel_err) if u.replicas else row.rel_err
        if not worst > 0.5 * min(t.threshold(kind, dt, row.ref_rel_err) for t in tols) and not _gain_near(row):
            return
        model = self.ctx.ref.model
        inputs = own_input.input_points(row.point, self.ctx.num_layers, own_input.is_sandwich(model),
                                        moe=own_moe.layer_kind(model, layer)) or []
        teacher_at = (self.ctx.num_layers if kind == "final_norm" else layer) \
            if eng_teacher is not None and own_input.reads_layer_input(kind) else None
        red = self.ctx.reductions
        rd = None if getattr(red, "dtype", None) is None else getattr(torch, red.dtype)

        def get_of(rank: int | None) -> Callable[[str], torch.Tensor]:
            def get(p: str) -> torch.Tensor:
                if teacher_at is not None and p == inputs[0]:
                    x = eng_teacher[teacher_at]
                else:
                    x = engine_of[p] if rank is None else replicas_of.get(p, {}).get(rank, engine_of[p])
                return x if subset is None else x[subset]
            return get

        # a point split by columns whose inputs' replicas differ (vLLM's rank-ordered all-reduce at tp >= 3, KV
        # heads replicated): each group's columns were computed from its own rank's inputs, and are redone so
        by_rank = bool(u.columns) and any(p in replicas_of for p in inputs)

        def own(tensor: torch.Tensor, rank: int | None) -> own_input.Own:
            parts = [(slice(a, b), get_of(rank if rank in ranks else ranks[0])) for ranks, a, b in u.columns] \
                if by_rank else None
            return own_input.own_check(model, row.point, tensor, golden, get_of(rank),
                                       getattr(red, "tp", 1), rd, layout, parts)
        row.own_err, own_gain = own(u.tensor, None)
        row.own_gain = own_gain if self.isolated else math.nan  # the gain is judged in the local pass alone
        if u.replicas:
            errs = [own(t, r).err for r, t in u.replicas.items()]
            row.replica_own_err = math.nan if any(math.isnan(e) for e in errs) else max(errs)

    def _routes(self, units: list, gold: dict) -> list:
        """MoE: the engine's top-k put in the one order, each replica by its own ids (``routes.sort_unit_routes``),
        and each layer's route checked against the golden's (before any routed point of the step is measured: they
        leave its flips out)."""
        self.routes.begin_step()
        sorted_ = sort_unit_routes({u.name: u for u, _ in units if kind_of(u.name).route in ("ids", "weights")})
        units = [(sorted_.get(u.name, u), sub) for u, sub in units]
        for u, _ in units:
            layer = split_point(u.name)[0]
            if kind_of(u.name).route == "ids" and u.name in gold and f"layers.{layer}.moe.router" in gold:
                if u.tensor.shape == gold[u.name].shape:
                    self.routes.check(layer, u.tensor, gold)
        return units

    def _route_row(self, u, gold: torch.Tensor, step: int, row_lens: list[int], starts: list[int], order) -> Row:
        """``moe.topk_ids``: the expert sets compared per token (``tpcheck.judge.routing``): ``route_flips`` tokens
        differ, ``near_ties`` of them legitimately; any other is a finding in the note (the row fails)."""
        layer = split_point(u.name)[0]
        rc = self.routes.checks.get(layer)
        n = u.tensor.shape[0]
        if rc is None:  # a shape that differs from the golden's
            return self._row(u, gold, step, row_lens, starts, None, order)
        where = lambda r: "(batch, token) " + str(list(_row_index(r, row_lens, starts, order)))  # noqa: E731
        bad = len(rc.illegitimate)
        note = rc.note(where) or (u.rank_mismatch or "")
        return Row(point=u.name, layer=layer, step=step, mode=self.mode, kind=kind_of(u.name).name,
                   rel_err=bad / n if n else 0.0, ref_rel_err=0.0, route_flips=float(len(rc.flipped)),
                   near_ties=float(rc.near_ties), nan=0, inf=0, note=note, order=point_order(u.name),
                   max_abs=max(rc.margins) if rc.margins else 0.0, **u.rank_fields())

    def _row(self, u, gold: torch.Tensor, step: int, row_lens: list[int], starts: list[int], want=None,
             order: list[int] | None = None, subset: list[int] | None = None, rows_excluded: int = 0) -> Row:
        layer, kind = split_point(u.name)
        whole = subset is None and not rows_excluded  # the golden's point as _rows gave it to measure ahead
        note, op_mismatch = "", float("nan")
        if u.tensor.shape != gold.shape:
            stats = {"rel_err": float("inf"), "cosine": float("nan"), "max_abs": float("inf"), "max_abs_index": [],
                     "mean_abs": float("inf"), "p99_abs": float("inf"), "ref_norm": float(gold.double().norm()),
                     "nan": 0, "inf": 0}
            note = f"shape {shape_text(u.tensor.shape)} != golden {shape_text(gold.shape)}"
        else:  # computed ahead for a whole point (rows), here for the rows of a subset or with some left out
            stats, replica_errs, gains = self._ahead.take(u.name) if whole and u.name in self._ahead else \
                measure(u.tensor, gold, list(u.replicas.values()), self.isolated,
                        self._scales.get(u.name) if whole else None)
            stats["rel_err"] = self.floor.engine_rel_err(u.name, stats["rel_err"], stats["ref_norm"], gold.shape[0])
            if u.replicas:  # every replica judged against the golden (tpcheck.judge.verdict)
                errs = [self.floor.engine_rel_err(u.name, e, stats["ref_norm"], gold.shape[0]) for e in replica_errs]
                stats["replica_rel_err"] = math.inf if any(math.isnan(e) for e in errs) else max(errs)
            stats.update(gains)
        if stats["max_abs_index"]:
            r, f = stats["max_abs_index"]
            b, t = _row_index(r if subset is None else subset[r], row_lens, starts, order)
            stats["max_abs_index"] = [b, t, f]
        if u.rank_mismatch:
            note = u.rank_mismatch
        if want is not None and not note:
            n_bad, n = mismatch(u.tensor, want)
            op_mismatch = n_bad / n if n else 0.0
            if n_bad:
                note = (f"exact-ops: {n_bad} of {n} elements differ from HF's op on the engine's input "
                        f"(max |diff| {float((u.tensor.double() - want.double()).abs().max()):.3g})")
        # threshold, excess and passed are the judge's (tpcheck.judge): a row holds measurements and, in its
        # note, structural findings
        stats.setdefault("rel_floor", ulp_floor(gold, self.ctx.dtype) if u.tensor.shape == gold.shape else NAN)
        return Row(point=u.name, layer=layer, step=step, mode=self.mode, kind=kind, **stats,
                   **self.floor.row_fields(u.name), **u.rank_fields(), op_mismatch=op_mismatch, note=note,
                   rows_excluded=float(rows_excluded) if rows_excluded else NAN, order=point_order(u.name))

    def _row_scale(self, name: str, gold: dict, engine_of: dict, eng_teacher) -> RowScale | None:
        """The per-row scale allowance of a whole point in the local pass (``tpcheck.measure.gain.gain_fields``): from
        the norm input it descends from, its golden rows at the run's dtype and the engine's own rows of it (the
        teacher where that is the layer's input); None where there is none."""
        if not self.isolated:
            return None
        src = scale_source(name, self.ctx.num_layers, own_input.is_sandwich(self.ctx.ref.model))
        g = None if src is None else gold.get(src[0])
        if g is None or g.dim() < 2 or g.shape[0] != gold[name].shape[0]:
            return None
        layer, kind = split_point(name)
        prev = src[0] == "embed" or (src[0].endswith(".out") and split_point(src[0])[0] != layer)
        at = (self.ctx.num_layers if layer is None else layer) if prev else None
        e = eng_teacher[at] if eng_teacher is not None and at is not None and at in eng_teacher \
            else engine_of.get(src[0])
        return RowScale(row_scale_allowance(g, self.ctx.dtype, e), src[1], src[2])

    def _selected(self, name: str) -> bool:
        return self.ctx.select is None or self.ctx.select.fullmatch(name) is not None


def _gain_near(row: Row) -> bool:
    """Whether a row's gain exceeds half a lower bound of its gain threshold (``tpcheck.judge.verdict``: the
    largest of the gain floor, ``k`` times the references' gain and ``z`` standard errors, with ``k, z >= 2``)."""
    bound = max((v for v in (row.gain_floor, 2 * abs(row.ref_gain), 2 * row.gain_se) if math.isfinite(v)),
                default=math.nan)
    return math.isfinite(row.gain) and math.isfinite(bound) and abs(row.gain) > 0.5 * bound


def measure(x: torch.Tensor, golden: torch.Tensor, replicas: list[torch.Tensor], gains: bool,
            scale: RowScale | None = None) -> tuple[dict, list, dict]:
    """An engine point's statistics against the golden, pure (``tpcheck.measure.ahead`` runs them in worker
    threads): ``compare``'s, each replica's ``rel_err`` and (``gains``: the local pass) ``gain_fields`` (``scale``:
    its per-row scale allowance)."""
    return compare(x, golden), [rel_err(t, golden) for t in replicas], gain_fields(x, golden, scale) if gains else {}


def _row_index(flat_row: int, row_lens: list[int], starts: list[int], order: list[int] | None = None) -> tuple[int, int]:
    """(prompt, position) of a row of the prompts' rows concatenated (``order``: the prompt of each group)."""
    for b, n in enumerate(row_lens):
        if flat_row < n:
            return (b if order is None else order[b]), starts[b] + flat_row
        flat_row -= n
    return -1, -1


def subset_rows(name: str, subsets: dict[str, list[int]]) -> list[int] | None:
    """The rows an engine point holds of golden point ``name`` (a fused point's parts share its rows)."""
    for point, rows in subsets.items():
        if name == point or (point.endswith(".") and name.startswith(point)):
            return rows
    return None
