"""``tpcheck.diff`` (defined here, exported by the package): the engine against a float64 golden run, point by point, step by step.

Per step: HF float64 (golden) runs and its points are kept for that step only; HF at the test dtype (the
noise floor) and the engine run next and each of their points is compared as it is unsharded, then
dropped. Decode tokens are the golden run's greedy choices, so all three models see the same inputs.
``isolate`` adds a teacher-forced pass: every layer of the engine and of the noise-floor model gets the
golden input of that layer, so each row shows the layer's local error apart from what it inherited.
``exact_ops`` also holds the RMSNorms and residual adds to bit-identity with HF's own modules applied to the
engine's own inputs (``tpcheck.measure.exact_ops``)."""
from __future__ import annotations

import logging
import math
import re
import shlex
import time

import torch

from impl.config import load_config, parse_dtype
from tpcheck.measure import exact_ops
from tpcheck.reference.hf import HFCapture, load_hf_model, new_cache
from tpcheck.judge.coverage import DEFAULT_REQUIRE, Coverage, check_known
from tpcheck.capture.dump import DumpingAdapter
from tpcheck.measure.metrics import compare, mismatch, row_rel_errs
from tpcheck.progress import bar
from tpcheck.capture.points import all_point_names, model_point_names, split_point
from tpcheck.reference.reductions import Reductions
from tpcheck.judge.verdict import judge
from tpcheck.result.table import DiffResult
from tpcheck.judge.tolerances import Tolerances
from tpcheck.measure.unshard import unshard

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr

_HF: dict = {}


def hf_capture(model_dir: str, dtype: str, streamed: bool = False) -> HFCapture:
    """HF model with capture hooks, cached per (checkpoint, dtype, streamed) in this process (at most 4 kept).
    ``streamed``: weights read from the checkpoint as the forward needs them, one matrix resident at a time
    (``tpcheck.reference.streamed``: for checkpoints larger than memory; the same points bit for bit)."""
    key = (str(model_dir), dtype, streamed)
    if key not in _HF:
        while len(_HF) >= 4:
            _HF.pop(next(iter(_HF)))
        if streamed:
            from tpcheck.reference.streamed import streamed_hf_capture
            _HF[key] = streamed_hf_capture(model_dir, dtype)
        else:
            _HF[key] = HFCapture(load_hf_model(model_dir, dtype))
    return _HF[key]


def _row_index(flat_row: int, row_lens: list[int], starts: list[int]) -> tuple[int, int]:
    for b, n in enumerate(row_lens):
        if flat_row < n:
            return b, starts[b] + flat_row
        flat_row -= n
    return -1, -1


class _Run:
    """One mode (propagated or isolated) over prefill + decode steps."""

    def __init__(self, golden: HFCapture, ref: HFCapture, engine, prompts, decode_steps, num_layers, dtype,
                 isolated: bool, exact_ops: bool = False, reductions: Reductions = Reductions(),
                 select: re.Pattern | None = None, stop_when=None, save_golden=None, progress=None):
        self.golden, self.ref, self.engine, self.prompts, self.exact_ops = golden, ref, engine, prompts, exact_ops
        # --points / --layers: only these points are compared (the forward passes still run whole);
        # --fail-fast: ``stop_when(rows of a step)`` says the step failed; --save-golden: a GoldenWriter
        self.select, self.stop_when, self.save_golden = select, stop_when, save_golden
        self.progress = progress  # a tpcheck.progress bar of steps, or None
        self.stopped_at: int | None = None
        # the noise floor's references: HF at the dtype, and (tp > 1) HF at the dtype rounding like the engine
        self.refs = [("hf", None)] + ([("hf-tp", reductions)] if reductions.emulated else [])
        self.steps, self.L, self.dtype, self.isolated = decode_steps, num_layers, dtype, isolated
        self.with_kv = decode_steps > 0
        # every family's points (Qwen3's attn.q_norm / k_norm included), in execution order
        self.order = {n: i for i, n in enumerate(all_point_names(num_layers))}
        self.canonical = set(all_point_names(num_layers))
        self.reported: set[str] = set()  # the canonical points the engine reported (coverage)

    def run(self) -> list[dict]:
        rows: list[dict] = []
        mode = "isolated" if self.isolated else "propagated"
        # a saved golden (--golden) has no model and needs no cache
        g_caches = [None if self.golden.model is None else new_cache(self.golden.model) for _ in self.prompts]
        r_caches = {name: [new_cache(self.ref.model) for _ in self.prompts] for name, _ in self.refs}
        self.engine.begin(self.prompts, self.steps)
        tokens, starts = [list(p) for p in self.prompts], [0] * len(self.prompts)
        # A few rows make a reference's error a noisy sample: where a few outlier elements dominate a row's
        # norm, the reference can round luckily where a correct engine lands an ulp the other way, and the
        # MLP's outlier units amplify that. Every row (token) of a point is computed by the same ops, so each
        # reference row is a sample of the per-row error a correct engine may make, and an error over several
        # rows (an RMS of its rows) is at most its worst row. The floor of step s is therefore the worst
        # reference row at that point over steps 0..s (``row_level``: point -> (rel_err, reference, step)),
        # or the references' whole-tensor error at s where that is larger.
        row_level: dict[str, tuple[float, str, int]] = {}
        for step in range(self.steps + 1):
            t0 = time.monotonic()
            gold = self.golden.step(tokens, g_caches, starts, None, self.with_kv)
            if self.save_golden is not None:
                self.save_golden.write(step, tokens, starts, gold)
            if self.select is not None:  # hold only what is compared, plus the logits and teacher inputs it needs
                gold = {n: t for n, t in gold.items() if self._selected(n) or n == "logits" or
                        (self.isolated and (n == "embed" or split_point(n)[1] == "out"))}
            step_rows = len(rows)
            teacher = None
            if self.isolated:
                teacher = {i: gold["embed" if i == 0 else f"layers.{i - 1}.out"] for i in range(self.L)}
                teacher[self.L] = gold[f"layers.{self.L - 1}.out"]
            ref_now: dict[str, dict[str, float]] = {}  # point -> reference -> its rel_err at this step
            level: dict[str, tuple[float, str, int]] = {}  # this step's floor
            for ref_name, red in self.refs:
                ref = self.ref.step(tokens, r_caches[ref_name], starts, teacher, self.with_kv, red)
                for n, t in ref.items():
                    if n in gold and t.shape == gold[n].shape and self._selected(n):
                        e, worst = row_rel_errs(t, gold[n])
                        ref_now.setdefault(n, {})[ref_name] = e
                        if math.isfinite(e) and e > level.get(n, (-1.0,))[0]:
                            level[n] = (e, ref_name, step)
                        if math.isfinite(worst) and worst > row_level.get(n, (-1.0,))[0]:
                            row_level[n] = (worst, ref_name, step)
                del ref
            for n, worst in row_level.items():
                if worst[0] > level.get(n, (-1.0,))[0]:
                    level[n] = worst
            eng_teacher = None if teacher is None else {i: t.to(self.dtype) for i, t in teacher.items()}
            points = self.engine.step(tokens, eng_teacher, self.with_kv)
            row_lens = [len(t) for t in tokens]
            kv_lens = [s + len(t) for s, t in zip(starts, tokens)]
            held: dict[str, torch.Tensor] = {}  # --exact-ops: the engine tensors the checked ops read
            layer_input = (lambda i, t=eng_teacher: t[i]) if eng_teacher is not None else \
                (lambda i, h=held: h["embed" if i == 0 else f"layers.{i - 1}.out"])
            for name, (placement, per_rank) in points.items():
                parts = unshard(name, placement, per_rank)
                check_known({u.name for u in parts}, self.canonical)
                for u in parts:
                    if u.name not in gold or not self._selected(u.name):
                        continue
                    self.reported.add(u.name)
                    want = None
                    if self.exact_ops:
                        if split_point(u.name)[1] in exact_ops.INPUT_KINDS:
                            held[u.name] = u.tensor
                        want = exact_ops.expected(self.ref.model, u.name, held.__getitem__, layer_input)
                    is_kv = ".kv." in u.name
                    rows.append(self._row(u, gold[u.name], ref_now.get(u.name, {}), level.get(u.name), step, mode,
                                          kv_lens if is_kv else row_lens, [0] * len(tokens) if is_kv else starts,
                                          want))
            # the next inputs: golden greedy tokens at each prompt's last row, or what a recorded run consumed
            last = torch.tensor(row_lens).cumsum(0) - 1
            nxt = gold["logits"][last].argmax(-1).tolist()
            starts = kv_lens
            recorded = getattr(self.engine, "recorded_tokens", None)  # tpcheck.capture.dump.DumpAdapter
            tokens = recorded(step + 1) if recorded is not None and step < self.steps else [[t] for t in nxt]
            del gold, points
            what = "prefill" if step == 0 else f"decode {step}/{self.steps}"
            logger.info(f"  [{mode}] {what}: {time.monotonic() - t0:.1f}s")
            if self.progress is not None:
                self.progress.update(1)
            if self.stop_when is not None and self.stop_when(rows[step_rows:]):
                self.stopped_at = step
                logger.info(f"  [{mode}] --fail-fast: a point failed at step {step}; the remaining steps are not run")
                break
        self.engine.close()
        return rows

    def _row(self, u, gold, ref_now: dict, level: tuple | None, step, mode, row_lens, starts, want=None) -> dict:
        layer, kind = split_point(u.name)
        row = {"point": u.name, "layer": layer, "kind": kind, "step": step, "mode": mode,
               "order": self.order.get(u.name, 10**6), "note": "", "op_mismatch": float("nan")}
        if u.tensor.shape != gold.shape:
            stats = {"rel_err": float("inf"), "cosine": float("nan"), "max_abs": float("inf"), "max_abs_index": [],
                     "mean_abs": float("inf"), "p99_abs": float("inf"), "ref_norm": float(gold.double().norm()),
                     "nan": 0, "inf": 0}
            row["note"] = f"shape {list(u.tensor.shape)} != golden {list(gold.shape)}"
        else:
            stats = compare(u.tensor, gold)
        if stats["max_abs_index"]:
            r, f = stats["max_abs_index"]
            b, t = _row_index(r, row_lens, starts)
            stats["max_abs_index"] = [b, t, f]
        # the worst legitimate reference sets the floor ("hf-tp@0": the TP reference's worst row at step 0)
        ref_err, ref_name, ref_step = level or (float("nan"), "", step)
        if u.rank_mismatch:
            row["note"] = u.rank_mismatch
        if want is not None and not row["note"]:
            n_bad, n = mismatch(u.tensor, want)
            row["op_mismatch"] = n_bad / n if n else 0.0
            if n_bad:
                row["note"] = (f"exact-ops: {n_bad} of {n} elements differ from HF's op on the engine's input "
                               f"(max |diff| {float((u.tensor.double() - want.double()).abs().max()):.3g})")
        # threshold, excess and passed are the judge's (tpcheck.judge): this row holds measurements and,
        # in its note, structural findings
        return {**row, **stats, "ref_rel_err": ref_err, "ref_rel_err_hf": ref_now.get("hf", float("nan")),
                "ref_rel_err_tp": ref_now.get("hf-tp", float("nan")),
                "ref_by": f"{ref_name}@{ref_step}" if ref_name else "",
                "threshold": float("nan"), "excess": float("nan"), "passed": False}

    def _selected(self, name: str) -> bool:
        return self.select is None or self.select.fullmatch(name) is not None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def diff(model: str | None = None, tp: int = 1, dtype: str = "float32", prompts: list[list[int]] | None = None,
         decode_steps: int = 0, isolate: bool = False, *, preset: str = "small", inject: list[str] = (),
         inject_layer: int | None = None, tolerances: Tolerances | None = None, pool=None, block_size: int = 16,
         seq_len: int = 32, batch: int = 2, seed: int = 0, exact_ops: bool = False,
         command: str | None = None, require_points: str = DEFAULT_REQUIRE, dump: str | None = None,
         dump_points: str | None = None, dump_budget_mb: float | None = None, engine: str = "impl",
         streamed: bool = False, points: str | None = None, layers: list[int] | None = None,
         fail_fast: bool = False, golden: str | None = None, save_golden: str | None = None) -> DiffResult:
    """Compare an engine (``"impl"``, or ``"hf-tp"``: transformers' own tp_plan, ``tpcheck.engines.hf_tp``) at
    ``tp``/``dtype`` with Hugging Face, every point, every step (``exact_ops``: ``tpcheck.measure.exact_ops``).

    ``model`` is a checkpoint directory (default: the synthetic ``preset``); ``prompts`` token ids
    (default: ``batch`` random prompts of ``seq_len`` tokens from ``seed``). ``dump``: also write the engine's
    points per rank and step there (``tpcheck.capture.dump``; ``dump_points`` a regex, ``dump_budget_mb`` a bound).
    ``streamed``: the HF references read their weights from the checkpoint as the forward needs them
    (``tpcheck.reference.streamed``), for checkpoints larger than memory. ``points`` (a regex) / ``layers``: compare
    only those points (``selection``); ``fail_fast``: stop at the first failing step; ``golden`` /
    ``save_golden``: replay / save the float64 golden (``tpcheck.reference.saved``)."""
    from tpcheck.engines.adapter import ENGINES, ImplAdapter
    from tpcheck.pipeline.check import random_prompts
    from tpcheck.inputs.checkpoints import cached_checkpoint
    from tpcheck.inputs.faults import get_fault
    from tpcheck.engines.pool import EnginePool
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {list(ENGINES)}")
    if inject and engine != "impl":
        raise ValueError(f"--inject applies to impl only (faults patch impl's modules), not --engine {engine}")
    model_dir = str(model or cached_checkpoint(preset))
    cfg = load_config(model_dir)
    cfg.check_tp(tp)
    if engine == "hf-tp":
        from tpcheck.engines.hf_tp import check_layout
        check_layout(cfg, tp)
    if decode_steps < 0:
        raise ValueError(f"decode_steps must be >= 0, got {decode_steps}")
    prompts = prompts or random_prompts(cfg.vocab_size, batch, seq_len, seed)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocab [0, {cfg.vocab_size})")
        if len(p) + decode_steps > cfg.max_position:
            raise ValueError(f"prompt {i}: {len(p)} tokens + {decode_steps} decode steps exceed "
                             f"max_position_embeddings={cfg.max_position}")
    logger.info(f"tpcheck diff: {model_dir} tp={tp} {dtype}, {len(prompts)} prompt(s), {decode_steps} decode step(s)"
          f"{', isolate' if isolate else ''}{', exact-ops' if exact_ops else ''}{', inject ' + ','.join(inject) if inject else ''}")
    silent = {}
    for name in inject:
        why = get_fault(name).silent_because(cfg, tp, dtype, decode_steps, exact_ops,
                                             prompt_lens=[len(p) for p in prompts], block_size=block_size)
        if why:
            silent[name] = why
            logger.warning(f"tpcheck diff: note: {name} {why}; expect this run to pass")
    own = pool is None
    pool = pool or EnginePool()
    try:
        # --dump: each rank writes its own points of every propagated step to DIR (tpcheck compare reads it)
        budget = None if dump_budget_mb is None else int(dump_budget_mb * 2**20)  # the whole dump's bound
        select = selection(points, layers)
        if engine == "impl":  # --exact-ops reads the inputs of the checked ops: then every point is captured
            dump_kw = None if dump is None else {"root": str(dump), "dtype": dtype, "points": dump_points,
                                                 "budget_bytes": None if budget is None else budget // tp}
            adapter = ImplAdapter(pool.get(model_dir, tp, dtype), inject, inject_layer, block_size, dump_kw,
                                  None if exact_ops else select)
        else:
            adapter = pool.get_hf_tp(model_dir, tp, dtype)
            if dump is not None:  # written from the driver (DumpingAdapter splits the budget over the ranks)
                adapter = DumpingAdapter(adapter, dump, dtype, "hf-tp", dump_points, budget)
        meta = {"tp": tp, "engine": engine, "inject": list(inject), "inject_layer": inject_layer, "inject_silent": silent,
                "command": command or diff_command(["--model", model_dir], tp, dtype, prompts, decode_steps, block_size,
                                                   isolate, exact_ops, inject, inject_layer)}
        return compare_engine(adapter, model_dir, prompts, dtype, decode_steps, isolate, tolerances, meta,
                              exact_ops, require_points, streamed=streamed, select=select,
                              fail_fast=fail_fast, golden=golden, save_golden=save_golden)
    finally:
        if own:
            pool.close()


def compare_engine(engine, model_dir: str, prompts: list[list[int]], dtype: str, decode_steps: int = 0,
                   isolate: bool = False, tolerances: Tolerances | None = None,
                   meta: dict | None = None, exact_ops: bool = False,
                   require_points: str = DEFAULT_REQUIRE, *, streamed: bool = False, select: str | None = None,
                   fail_fast: bool = False, golden: str | None = None, save_golden: str | None = None) -> DiffResult:
    """Run any ``tpcheck.engines.adapter.EngineAdapter`` against HF float64 (golden) and HF at ``dtype`` (noise
    floor: on one device, and with the engine's declared ``reductions`` emulated when its tp > 1) on the
    checkpoint ``model_dir``; the engine must already be loaded with that checkpoint.
    ``exact_ops``: also hold the elementwise ops to HF's bits (``tpcheck.measure.exact_ops``). ``require_points``: the
    canonical points (a regex) the engine must report (``tpcheck.judge.coverage``); ``meta["coverage"]`` says what
    it did not. ``select``: a regex (``selection``) of the points to compare, the others neither compared nor
    required. ``fail_fast``: stop after the first step with a failing point (no isolated pass then).
    ``golden``: a saved golden directory replayed instead of the float64 run; ``save_golden``: save this run's
    golden there (``tpcheck.reference.saved``)."""
    from tpcheck.reference.saved import GoldenWriter, SavedGolden
    cfg = load_config(model_dir)
    keep = re.compile(select) if select else None
    expected = [n for n in model_point_names(cfg, decode_steps > 0) if keep is None or keep.fullmatch(n)]
    if not expected:
        raise ValueError(f"--points/--layers select no point of this {cfg.num_layers}-layer model ({select!r})")
    coverage = Coverage(expected, require=require_points)
    reductions = getattr(engine, "reductions", None)
    if reductions is None:
        reductions = Reductions()
        logger.warning("tpcheck diff: note: the engine adapter declares no `reductions` (tpcheck.reference.reductions.Reductions): "
              "the noise floor is HF on one device only and does not admit the rounding of TP all-reduces")
    # streamed: both references (float64 and the dtype) stream their weights (tpcheck.reference.streamed)
    ref = hf_capture(model_dir, dtype, streamed)
    golden_src = SavedGolden(golden, model_dir, prompts, decode_steps, decode_steps > 0) if golden else \
        hf_capture(model_dir, "float64", streamed)
    writer = GoldenWriter(save_golden, model_dir, prompts, decode_steps, decode_steps > 0, cfg.num_layers) \
        if save_golden else None
    stop_when = None
    if fail_fast:
        step_meta = {"dtype": dtype}
        stop_when = lambda step_rows: bool(step_rows) and not judge(  # noqa: E731
            DiffResult.from_rows(step_rows, step_meta, stamp=False), tolerances).table["passed"].all()
    rows: list[dict] = []
    stopped = None
    modes = [False] + ([True] if isolate else [])
    progress = bar(len(modes) * (decode_steps + 1), "diff", "step")
    try:
        for isolated in modes:
            run = _Run(golden_src, ref, engine, prompts, decode_steps, cfg.num_layers, parse_dtype(dtype), isolated,
                       exact_ops, reductions, keep, stop_when, writer, progress)
            try:
                rows += run.run()
            except BaseException:
                try:
                    engine.close()
                except Exception:  # the engine may be gone (a dead rank); the first error is the one to report
                    pass
                raise
            coverage.reported |= run.reported
            stopped = run.stopped_at
            if stopped is not None:
                break
    finally:
        progress.close()
    coverage.comparisons = len(rows)
    meta = {"model": str(model_dir), "dtype": dtype, "coverage": coverage.as_meta(), "decode_steps": decode_steps, "isolate": isolate, "exact_ops": exact_ops,
            "select": select, "stopped_at_step": stopped, "golden": str(golden) if golden else None,
            "reductions": {"tp": reductions.tp, "dtype": reductions.dtype or dtype},
            "num_layers": cfg.num_layers, "prompt_lens": [len(p) for p in prompts], **(meta or {})}
    return judge(DiffResult.from_rows(rows, meta), tolerances)


def selection(points: str | None = None, layers: list[int] | None = None) -> str | None:
    """One regex of the points to compare: those ``points`` (a regex) fullmatches, within decoder ``layers``
    when given (the embedding, final norm and logits are then left out); None: every point."""
    if layers is not None and not layers:
        raise ValueError("--layers selects no layer")
    in_layers = None if layers is None else r"layers\.(?:%s)\..+" % "|".join(str(i) for i in sorted(set(layers)))
    if points is not None:
        try:
            re.compile(points)
        except re.error as e:
            raise ValueError(f"--points {points!r} is not a regular expression: {e}") from None
    if in_layers and points:
        return f"(?={in_layers}$)(?:{points})"
    return in_layers or points


def diff_command(source: list[str], tp: int, dtype: str, prompts: list[list[int]], decode_steps: int = 0,
                 block_size: int = 16, isolate: bool = False, exact_ops: bool = False, inject=(),
                 inject_layer: int | None = None) -> str:
    """The ``tpcheck diff`` command line that repeats a run; ``source``: ``["--model", DIR]`` or
    ``["--preset", NAME]``."""
    parts = ["tpcheck", "diff", "--layer-by-layer", *map(str, source), "--tp", str(tp), "--dtype", dtype]
    for p in prompts:
        parts += ["--prompt-ids", ",".join(map(str, p))]
    if decode_steps:
        parts += ["--decode-steps", str(decode_steps)]
    if block_size != 16:
        parts += ["--block-size", str(block_size)]
    if isolate:
        parts.append("--isolate")
    if exact_ops:
        parts.append("--exact-ops")
    if inject:
        parts += ["--inject", ",".join(inject)]
    if inject_layer is not None:
        parts += ["--inject-layer", str(inject_layer)]
    return shlex.join(parts)
