"""``tpcheck sweep``: the layer-by-layer diff over a matrix of configurations, inputs drawn by Hypothesis.

One configuration = (model, tp, pp, dtype, decode steps) (``--pp``: pipeline stages of tp ranks each, impl's
``impl.pipeline``; a pp beyond a preset's layers is skipped, naming both); the model is a named preset or, with
``--random-configs``, a fresh model drawn per example (``tpcheck.properties.strategies.config_and_tp`` at that tp, so
both KV partition and replication appear). Each configuration runs ``--examples`` drawn inputs (prompts of
ragged lengths near block boundaries, block sizes) through ``tpcheck.diff`` on one pool of engines (one per
TP size, reloaded per checkpoint). A failing configuration is shrunk to its smallest failing example and
printed with a one-line ``tpcheck diff`` reproduction.

Output: one row per configuration (pass / fail, the worst point over all its examples and its excess over
the noise-floor threshold: ``rel_err / (k * ref_rel_err + floor)``, or the gain's over its own where larger, above
1 fails); progress on stderr;
``--json`` writes the rows. Exit codes as for ``diff`` (``tpcheck.cli``): 0 every configuration passed, 1 one
diverged, 2 bad input, 3 configurations crashed and none diverged."""
from __future__ import annotations

import logging

import argparse
import dataclasses
import hashlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpcheck.inputs.arg_types import add_device_argument, int_list, name_list
from tpcheck.cli.exit_codes import Exit
from tpcheck.cli.paths import check_output_paths
from tpcheck.progress import bar

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr

# the default matrix: the tiny presets of every family (Qwen2's four, then Llama 3 RoPE, Llama biases,
# Mistral's sliding window, Qwen3's q/k norms)
TINY_PRESETS = ("tiny", "tiny-untied", "tiny-mha", "tiny-mqa", "tiny-llama", "tiny-llama-bias", "tiny-mistral",
                "tiny-qwen3", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "tiny-moe-ties")


@dataclass
class SweepOptions:
    """What a sweep runs (the ``tpcheck sweep`` flags, same names and defaults)."""

    tp: list[int] = field(default_factory=lambda: [1, 2, 4])
    pp: list[int] = field(default_factory=lambda: [1])
    dtype: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    decode_steps: list[int] = field(default_factory=lambda: [0, 8])
    examples: int = 5
    preset: list[str] | None = None  # default TINY_PRESETS (unless random_configs)
    random_configs: bool = False
    outliers: list[float] = field(default_factory=lambda: [0.0])
    block_size: int | None = None
    max_len: int = 64
    max_batch: int = 4
    inject: list[str] = field(default_factory=list)
    exact_ops: bool = False
    device: str = "auto"  # the engines' and the goldens' (tpcheck.inputs.devices; a pool given to sweep(): its own)
    seed: int = 0
    no_shrink: bool = False
    no_pool: bool = False
    checkpoints: Path | None = None
    json: Path | None = None
    html: Path | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "SweepOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``sweep`` sub-command to a ``tpcheck`` argparse ``subparsers``."""
    sw = subparsers.add_parser(
        "sweep", help="the layer-by-layer diff over tp x dtype x decode steps, inputs drawn by Hypothesis",
        description="Run the layer-by-layer diff over every (model, tp, dtype, decode steps) configuration, "
                    "--examples inputs drawn by Hypothesis each (tpcheck.properties.strategies), on pooled engines. "
                    "Prints one row per configuration: pass/fail, the worst point over its examples and its "
                    "excess over the noise-floor threshold (rel_err / (k * ref_rel_err + floor), or the gain's "
                    "over its own; above 1 fails). A failing configuration is shrunk to its smallest failing "
                    "example, printed with a one-line `tpcheck diff` reproduction. Exit 0 all passed, 1 one failed, 2 bad input.")
    sw.add_argument("--tp", type=int_list, default=[1, 2, 4], help="TP sizes (default 1,2,4)")
    sw.add_argument("--pp", type=int_list, default=[1],
                    help="pipeline stages of --tp ranks each (impl; default 1); a pp beyond a model's layers is "
                         "skipped for that model")
    sw.add_argument("--dtype", type=name_list, default=["float32", "bfloat16"],
                    help="dtypes: float32, bfloat16, float16 (default float32,bfloat16)")
    sw.add_argument("--decode-steps", type=int_list, default=[0, 8], help="decode lengths (default 0,8)")
    sw.add_argument("--examples", type=int, default=5, help="drawn examples per configuration (default 5)")
    src = sw.add_mutually_exclusive_group()
    src.add_argument("--preset", type=name_list, action="extend", default=None,
                     help=f"synthetic presets, comma-separated or repeated (default: {','.join(TINY_PRESETS)})")
    src.add_argument("--random-configs", action="store_true",
                     help="a fresh random model (tpcheck.properties.strategies) per example instead of presets")
    sw.add_argument("--outliers", type=lambda s: [float(x) for x in name_list(s)], default=[0.0],
                    help="with --random-configs: strengths of the massive-activation recipe to draw from, "
                         "comma-separated (0: off; 1: small-outliers' strength; default 0)")
    sw.add_argument("--block-size", type=int, default=None, help="fix the KV block size (default: drawn)")
    sw.add_argument("--max-len", type=int, default=64, help="longest drawn prompt (default 64; up to 300)")
    sw.add_argument("--max-batch", type=int, default=4, help="largest drawn batch (default 4, at most 8)")
    sw.add_argument("--inject", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="faults to inject into impl in every example (tpcheck faults list)")
    sw.add_argument("--exact-ops", action="store_true",
                    help="also hold RMSNorm and the residual adds to HF's bits (tpcheck diff --exact-ops)")
    add_device_argument(sw, "the engines, goldens and references")
    sw.add_argument("--seed", type=int, default=0, help="Hypothesis seed (the same seed draws the same inputs)")
    sw.add_argument("--no-shrink", action="store_true", help="report the first failing example, unshrunk")
    sw.add_argument("--no-pool", action="store_true",
                    help="start a fresh engine (TP worker processes) for every example: what the pool saves")
    sw.add_argument("--checkpoints", type=Path, default=None,
                    help="where drawn checkpoints go (default: a temp dir)")
    sw.add_argument("--json", type=Path, help="write the rows as JSON")
    sw.add_argument("--html", type=Path, metavar="DIR",
                    help="write DIR/index.html (every configuration) and, linked from it, the HTML report of each "
                         "failing configuration's shrunk example")
    sw.set_defaults(handler=lambda a, argv: check_output_paths(a.json, a.html / "index.html" if a.html else None)
                    or run(a))
    return sw


def _validate(opts: SweepOptions) -> list[str]:
    from tpcheck.inputs.models.checkpoints import PRESETS
    from tpcheck.engines.impl.faults import FAULTS
    errors = []
    if not opts.tp or any(t < 1 for t in opts.tp):
        errors.append(f"--tp needs TP sizes >= 1, got {opts.tp}")
    if not opts.pp or any(p < 1 for p in opts.pp):
        errors.append(f"--pp needs pipeline sizes >= 1, got {opts.pp}")
    if opts.pp != [1] and opts.random_configs and max(opts.pp) > 3:
        errors.append(f"--pp {max(opts.pp)} with --random-configs: drawn models have at most 3 layers")
    bad = [d for d in opts.dtype if d not in ("float32", "bfloat16", "float16")]
    if not opts.dtype or bad:
        errors.append(f"--dtype: {bad or 'none given'}; expected float32, bfloat16 or float16")
    if not opts.decode_steps or any(s < 0 for s in opts.decode_steps):
        errors.append(f"--decode-steps needs values >= 0, got {opts.decode_steps}")
    if opts.examples < 1:
        errors.append(f"--examples must be >= 1, got {opts.examples}")
    for name in opts.preset or []:
        if name not in PRESETS:
            errors.append(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    if opts.block_size is not None and opts.block_size < 1:
        errors.append(f"--block-size must be >= 1, got {opts.block_size}")
    if not 1 <= opts.max_len <= 1000:
        errors.append(f"--max-len must be in [1, 1000], got {opts.max_len}")
    if not 1 <= opts.max_batch <= 8:
        errors.append(f"--max-batch must be in [1, 8], got {opts.max_batch}")
    outliers = opts.outliers
    if not outliers or any(not 0 <= x <= 10 for x in outliers):
        errors.append(f"--outliers needs strengths in [0, 10], got {outliers}")
    elif any(outliers) and not opts.random_configs:
        errors.append("--outliers applies to --random-configs (presets carry their own recipe: small-outliers)")
    for f in opts.inject:
        if f not in FAULTS:
            errors.append(f"unknown fault {f!r}; known faults: {', '.join(FAULTS)}")
    return errors


def _row_seed(seed: int, *key) -> int:
    return int(hashlib.sha256(repr((seed, *key)).encode()).hexdigest()[:8], 16)


def _case_strategy(source: str, tp: int, dtype: str, steps: int, opts: SweepOptions, pp: int = 1):
    from hypothesis import strategies as st

    from tpcheck.properties import strategies as tst
    from tpcheck.inputs.models.checkpoints import PRESETS
    bss = (opts.block_size,) if opts.block_size else tst.DEFAULT_BLOCK_SIZES

    @st.composite
    def draw_case(draw):
        outliers = 0.0
        if source == "random":
            config, _ = draw(tst.config_and_tp(tps=(tp,)).filter(lambda c: c[0]["num_hidden_layers"] >= pp))
            preset = None
            outliers = draw(tst.outlier_strengths(opts.outliers))
        else:
            config, preset = dict(PRESETS[source]), source
        bs = draw(st.sampled_from(bss))
        ps = draw(tst.prompts(config["vocab_size"], bs, opts.max_batch, opts.max_len, min(4, opts.max_batch)))
        return tst.Case(config, tp, dtype, ps, steps, bs, preset=preset, exact_ops=opts.exact_ops,
                        outliers=outliers, pp=pp)

    return draw_case()


def run_configuration(source: str, tp: int, dtype: str, steps: int, opts: SweepOptions, pool, root: Path,
                      pp: int = 1) -> dict:
    """Run ``opts.examples`` drawn examples of one configuration; returns its row."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
    from tpcheck.result.table import worst_key

    row = {"config": source, "tp": tp, "pp": pp, "dtype": dtype, "decode_steps": steps, "examples": 0,
           "passed": True, "worst_point": None, "worst_step": None, "excess": 0.0, "worst_example": None,
           "origin": None, "failing_example": None, "repro": None, "error": None}
    state: dict = {"fail": None}

    def track(case, r) -> None:
        t = r.table
        if not len(t):
            return
        w = r.worst()
        if float(worst_key(t).max()) >= row["excess"] or row["worst_point"] is None:
            row.update(worst_point=w.point, worst_step=int(w.step), excess=float(worst_key(t).max()),
                       worst_example=case.describe())

    phases = [Phase.explicit, Phase.generate] + ([] if opts.no_shrink else [Phase.shrink])

    @seed(_row_seed(opts.seed, source, tp, dtype, steps, *((pp,) if pp != 1 else ())))  # pp 1: the same draws as before --pp existed
    @settings(max_examples=opts.examples, deadline=None, database=None, phases=phases, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False)
    @given(_case_strategy(source, tp, dtype, steps, opts, pp))
    def prop(case):
        row["examples"] += 1
        try:
            if opts.no_pool:
                from tpcheck.engines.pool import EnginePool
                fresh = EnginePool(device=opts.device)
                try:
                    r = case.diff(pool=fresh, root=root, inject=opts.inject)
                finally:
                    fresh.close()
            else:
                r = case.diff(pool=pool, root=root, inject=opts.inject)
        except Exception:
            state["crash"] = case  # the last crashing example Hypothesis ran: the shrunk one
            raise
        if r.passed:
            if state["fail"] is None:
                track(case, r)
            return
        state["fail"] = (case, r)
        raise AssertionError("diff failed")

    try:
        prop()
    except AssertionError:
        pass
    except Exception as e:  # noqa: BLE001 - a crash (a dead rank, a flaky failure) fails the configuration too
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        row["passed"] = False
        crash = state.get("crash")
        if crash is not None and state["fail"] is None:
            row.update(failing_example=crash.describe(), repro=crash.repro(root, opts.inject),
                       failing_case=crash.to_dict())
    if state["fail"] is not None:
        case, r = state["fail"]  # the last failure Hypothesis ran: the shrunk example
        fd = r.first_divergence or {}
        w = r.worst()
        row.update(passed=False, worst_point=w.point, worst_step=int(w.step), excess=float(worst_key(r.table).max()),
                   worst_example=case.describe(), origin=fd.get("point"), failing_example=case.describe(),
                   repro=case.repro(root, opts.inject))
        row["failing_case"] = case.to_dict()
        row["_result"] = r  # the shrunk example's DiffResult, for its HTML report (``sweep`` takes it out)
    return row


def _fmt_table(rows: list[dict]) -> str:
    head = ["config", "tp", "pp", "dtype", "decode", "examples", "result", "worst point", "step", "excess"]
    body = []
    for r in rows:
        result = "skip" if r.get("skipped") else ("pass" if r["passed"] else ("ERROR" if r.get("error") else "FAIL"))
        body.append([r["config"], str(r["tp"]), str(r.get("pp", 1)), r["dtype"], str(r["decode_steps"]), str(r["examples"]), result,
                     r["worst_point"] or "-", "-" if r["worst_step"] is None else str(r["worst_step"]),
                     "-" if r["worst_point"] is None else f"{r['excess']:.3g}x"])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i in (1, 2, 4, 5, 8, 9) else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(head)] + [line(b) for b in body])


def sweep(opts: SweepOptions, pool=None, results: dict | None = None) -> list[dict]:
    """Run every configuration of ``opts``; returns the rows. ``pool``: an
    ``EnginePool`` to use (and leave open); default a new one, closed at the end. ``results``: a dict that gets
    each failing configuration's shrunk ``DiffResult`` under its row's index."""
    import torch
    from impl.config import load_config
    from tpcheck.inputs.models.checkpoints import PRESETS, cached_checkpoint
    from tpcheck.engines.pool import EnginePool
    from tpcheck.properties.strategies import tp_compatible

    sources = ["random"] if opts.random_configs else list(opts.preset or TINY_PRESETS)
    root = Path(opts.checkpoints) if opts.checkpoints else Path(tempfile.mkdtemp(prefix="tpcheck-sweep-"))
    plan = [(s, tp, pp, d, n) for s in sources for d in opts.dtype for tp in opts.tp for pp in opts.pp
            for n in opts.decode_steps]
    rows: list[dict] = []
    own = pool is None
    pool = pool or EnginePool(device=opts.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny HF runs and comparisons: one thread, leaving the cores to the ranks
    progress = bar(len(plan), "sweep", "configuration")
    try:
        for i, (source, tp, pp, dtype, steps) in enumerate(plan, 1):
            what = f"{source} tp={tp}{f' pp={pp}' if pp != 1 else ''} {dtype} decode {steps}"
            progress.set_description(f"sweep {what}")
            t0 = time.monotonic()
            if source != "random":
                reason = None
                if not tp_compatible(PRESETS[source], tp):
                    reason = f"tp {tp} cannot split {source}"
                elif pp > PRESETS[source]["num_hidden_layers"]:
                    reason = f"pp {pp} exceeds {source}'s num_hidden_layers={PRESETS[source]['num_hidden_layers']}"
                elif opts.max_len + steps > PRESETS[source]["max_position_embeddings"]:
                    reason = f"--max-len {opts.max_len} + {steps} decode steps exceed the model's positions"
                if reason:
                    rows.append({"config": source, "tp": tp, "pp": pp, "dtype": dtype, "decode_steps": steps,
                                 "examples": 0,
                                 "passed": True, "skipped": reason, "worst_point": None, "worst_step": None,
                                 "excess": 0.0})
                    logger.info(f"[{i}/{len(plan)}] {what}: skipped ({reason})")
                    progress.update(1)
                    continue
                load_config(cached_checkpoint(source, root=root))  # written once, before any example
            row = run_configuration(source, tp, dtype, steps, opts, pool, root, pp)
            failing = row.pop("_result", None)
            if failing is not None and results is not None:
                results[len(rows)] = failing
            rows.append(row)
            verdict = "pass" if row["passed"] else f"FAIL ({row.get('origin') or row.get('error')})"
            if row.get("worst_point"):  # the closest figure as it comes: a sweep cut short still says how close
                verdict += f", worst {row['worst_point']} at {row['excess']:.3g}x"
            logger.info(f"[{i}/{len(plan)}] {what}: {row['examples']} example(s), "
                  f"{verdict} ({time.monotonic() - t0:.1f}s)")
            progress.update(1)
    finally:
        progress.close()
        torch.set_num_threads(threads)
        if own:
            pool.close()
    return rows


def run(a: "SweepOptions | argparse.Namespace", pool=None) -> int:
    """The ``sweep`` sub-command: 0 every configuration passed, 1 one diverged, 2 bad input, 3 a configuration
    crashed (a dead rank, an engine error) and none diverged. ``a``: the options, or the parsed command line."""
    opts = a if isinstance(a, SweepOptions) else SweepOptions.from_namespace(a)
    errors = _validate(opts)
    if errors:
        for e in errors:
            print(f"tpcheck sweep: error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    t0 = time.monotonic()
    results: dict = {}
    rows = sweep(opts, pool=pool, results=results)
    ran = [r for r in rows if not r.get("skipped")]
    if not ran:
        print("tpcheck sweep: error: no configuration can run (every one was skipped)", file=sys.stderr)
        return Exit.BAD_INPUT
    print(_fmt_table(rows))
    failed = [r for r in ran if not r["passed"]]
    for r in failed:
        pp = f" pp={r['pp']}" if r.get("pp", 1) != 1 else ""
        print(f"\nFAIL {r['config']} tp={r['tp']}{pp} {r['dtype']} decode {r['decode_steps']}"
              + (f": origin {r['origin']}" if r.get("origin") else "") + (f": {r['error']}" if r.get("error") else ""))
        if r.get("failing_example"):
            print(f"  shrunk example: {r['failing_example']}")
            print(f"  reproduce: {r['repro']}")
    n, secs = sum(r["examples"] for r in ran), time.monotonic() - t0
    print(f"\n{'PASS' if not failed else 'FAIL'}: {len(ran) - len(failed)}/{len(ran)} configuration(s) passed, "
          f"{n} example(s) in {secs:.0f}s ({60 * n / max(secs, 1e-9):.0f} examples/min"
          f"{', a fresh engine per example' if opts.no_pool else ', pooled engines'})"
          + (f"; {len(rows) - len(ran)} skipped" if len(rows) > len(ran) else ""))
    if opts.json:
        from tpcheck.result.documents import write_json  # strict JSON, schema_version, kind "sweep", run meta
        write_json(opts.json, "sweep", {"passed": not failed, "rows": rows},
                   meta={"args": {k: v for k, v in dataclasses.asdict(opts).items() if k != "json"}})
        print(f"wrote {opts.json}")
    if opts.html:
        write_sweep_html(opts.html, rows, results)
        print(f"wrote {opts.html / 'index.html'} and {len(results)} report(s) of failing configurations")
    if any(r.get("origin") or not r.get("error") for r in failed):
        return Exit.DIVERGED
    return Exit.FAILED if failed else Exit.PASS


def write_sweep_html(out: Path, rows: list[dict], results: dict) -> None:
    """``out``/index.html: every configuration; each failing one linked to its shrunk example's report."""
    from tpcheck.result.report.html import write_html
    from tpcheck.result.report.sweep import render_sweep_html, sweep_index_rows
    out.mkdir(parents=True, exist_ok=True)
    links: list = [None] * len(rows)
    for i, r in results.items():
        row = rows[i]
        pp = f"-pp{row['pp']}" if row.get("pp", 1) > 1 else ""  # unpipelined reports keep their names
        links[i] = f"{i:03d}-{row['config']}-tp{row['tp']}{pp}-{row['dtype']}-decode{row['decode_steps']}.html"
        write_html(r, out / links[i])
    (out / "index.html").write_text(render_sweep_html(sweep_index_rows(rows), links), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m tpcheck.cli.sweep ...``) until the sub-command is wired into the CLI."""
    ap = argparse.ArgumentParser(prog="tpcheck")
    register(ap.add_subparsers(dest="cmd", required=True))
    return run(ap.parse_args(["sweep", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
