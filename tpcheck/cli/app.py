"""``tpcheck`` command line: the parser, the diff / check / compare commands, errors turned into exit codes
(``tpcheck.cli.exit_codes``)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import traceback
from pathlib import Path

from tpcheck.cli import compare_two, exit_codes
from tpcheck.cli.exit_codes import Exit, result_exit_code, verdict
from tpcheck.inputs.arg_types import add_device_argument, int_list, regex
from tpcheck.inputs.models.presets import describe_preset, preset_names
from tpcheck.cli.lazy import Lazy, version as _version
from tpcheck.cli.paths import check_dump_dir, check_output_paths
from tpcheck.cli.suggest import PlainParser, check_argv, refuse, unknown_flag
from tpcheck.result.columns import help_epilog

options = Lazy("tpcheck.options")  # these import torch: ``tpcheck --version`` must not wait for it
checkpoints = Lazy("tpcheck.inputs.models.checkpoints")
coverage = Lazy("tpcheck.judge.coverage")

DESCRIPTION = f"""``tpcheck`` command line.

{exit_codes.__doc__}
One line on stderr for 2 and 3; the traceback only with --debug (or TPCHECK_DEBUG=1).

With no arguments it runs ``tpcheck diff --layer-by-layer`` on the embedded ``small`` synthetic checkpoint at tp 2;
diff's flags without a command mean diff (``tpcheck --tp 4 --no-isolate``)."""


def _add_outputs(p: argparse.ArgumentParser) -> None:
    """The verdict's outputs, and the legend of the tables' columns after the flags, shared by diff and compare."""
    p.epilog, p.formatter_class = help_epilog(), argparse.RawDescriptionHelpFormatter
    p.add_argument("--json", type=Path, help="write the verdict, origin and every row as JSON")
    p.add_argument("--csv", type=Path, help="write every row as CSV")
    p.add_argument("--all-rows", action="store_true", help="print every row, not the worst point per layer")
    p.add_argument("--parquet", type=Path, help="write every row as Parquet (needs pyarrow)")
    p.add_argument("--html", type=Path, help="write the self-contained HTML report")


def _parser() -> argparse.ArgumentParser:
    ap = PlainParser(prog="tpcheck", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="print the traceback of an error (also TPCHECK_DEBUG=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr (warnings and errors only)")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="cmd")
    from tpcheck.cli import compare_results, completion, gate, invariance, sweep
    for add in (_add_checkpoint_commands, _add_check, _add_diff, _add_compare, gate.register, invariance.register,
                compare_results.register, sweep.register, completion.register):
        add(sub)
    sub.choices["completion"].set_defaults(handler=_completion)  # it prints this parser: its handler lives here
    return ap


def _add_checkpoint_commands(sub) -> None:
    """make-checkpoint, presets, schema, faults."""
    from tpcheck.cli import fault_matrix_command, make_checkpoint
    make_checkpoint.register(sub)
    sub.add_parser("presets", help="list the synthetic checkpoint presets").set_defaults(handler=_presets)
    sub.add_parser("schema", help="print the JSON Schema (draft 2020-12) of the --json documents").set_defaults(
        handler=_schema)
    fl = sub.add_parser("faults", help="the injectable TP faults (tpcheck diff --inject NAME)")
    fsub = fl.add_subparsers(dest="action", required=True)
    fsub.add_parser("list", help="each fault: description, where it shows, expected origin").set_defaults(
        handler=_faults_list)
    fault_matrix_command.register(fsub)


def _add_check(sub) -> None:
    ck = sub.add_parser("check", help="impl logits vs an fp64 HF golden run, gated by HF's own noise at the dtype")
    src = ck.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (Qwen2 / Qwen2.5, Llama 2 / 3, Mistral, Qwen3 or Gemma 3)")
    src.add_argument("--preset", default="tiny", choices=preset_names(),
                     help="synthetic checkpoint used when --model is not given (default: tiny)")
    ck.add_argument("--tp", type=int_list, default=None, help="TP sizes, e.g. 1,2,4 (default: all the model allows of 1,2,4)")
    ck.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_device_argument(ck, "impl, the golden and the reference")
    ck.add_argument("--prompt-ids", type=int_list, action="append", help="a prompt as token ids (repeatable)")
    ck.add_argument("--seq-len", type=int, default=64)
    ck.add_argument("--batch", type=int, default=2)
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--logprobs-topk", type=int, metavar="K", default=None,
                    help="also require vLLM's check_logprobs_close rule: where the top tokens differ, each is in "
                         "the other side's top K (reported per prompt either way, with K=5 when not given)")
    ck.add_argument("--json", type=Path, help="write the table as JSON")
    ck.set_defaults(handler=_cmd_check)


def _add_diff(sub) -> None:
    """diff: its run options are ``tpcheck.options.DiffOptions``' fields (one flag each)."""
    from tpcheck.engines.registry import ENGINES
    df = sub.add_parser("diff", help="layer-by-layer differential run: where the engine leaves the noise floor")
    df.add_argument("--layer-by-layer", action="store_true", help="(the only mode; accepted for clarity)")
    prompt = options.add_arguments(df, choices={"preset": preset_names(), "engine": list(ENGINES)},
                                   defaults={"tp": 2})
    prompt.add_argument("--prompt", action="append", help="prompt text (needs a tokenizer in --model; repeatable)")
    _add_outputs(df)
    df.set_defaults(handler=_cmd_diff)


def _add_compare(sub) -> None:
    cp = sub.add_parser("compare", help="judge a dump (tpcheck diff --dump, tpcheck.capture in any engine) "
                                        "against the golden, like tpcheck diff")
    cp.add_argument("dump_dir", type=Path, metavar="DUMP_DIR")
    cp.add_argument("--model", type=Path, help="the Hugging Face checkpoint the engine ran (Qwen2 / Qwen2.5, Llama 2 / 3, Mistral, Qwen3 or Gemma 3); required but for two dumps")
    cp.add_argument("--reduce-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the dtype of the engine's all-reduces (default: the dump's dtype)")
    cp.add_argument("--exact-ops", action="store_true", help="as tpcheck diff --exact-ops, on the dumped inputs")
    cp.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="the local pass: the golden and the noise-floor references run each layer on the engine's "
                         "recorded input of it (every layer's out); default: on where the dump records them; "
                         "--no-isolate: the propagated pass alone")
    cp.add_argument("--rounding", choices=["nearest", "truncate"], help="as tpcheck diff --rounding: overrides the "
                    "rounding the dump declares (a vLLM bfloat16 dump: by the flags of the CPU it ran on)")
    cp.add_argument("--require-points", type=regex, default=coverage.DEFAULT_REQUIRE, metavar="REGEX",
                    help="canonical points the engine must report, else exit 3 (default: %(default)s)")
    cp.add_argument("--tolerances", type=Path, metavar="FILE.toml",
                    help="gate tolerances (default: [tool.tpcheck] in ./pyproject.toml, else the built-in ones)")
    compare_two.add_args(cp)  # a second dump, and the formats of other tools' dumps
    _add_outputs(cp)
    cp.set_defaults(handler=_compare)


def _fmt(df) -> str:
    return df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}")


def _cmd_diff(a, argv: list[str]) -> int:
    check_output_paths(a.json, a.csv, a.parquet, a.html)
    if a.dump is not None:
        check_dump_dir(a.dump)
    if a.save_golden is not None:
        if a.golden is not None:
            raise ValueError("--save-golden and --golden: give one (a replayed golden is already saved)")
        check_dump_dir(a.save_golden, "--save-golden")
    from tpcheck.pipeline.diff import run
    from tpcheck.judge.tolerances import load_tolerances
    tol = load_tolerances(a.tolerances)  # before the run: a bad file fails fast (ToleranceError -> exit 2)
    resolved = {}
    if a.prompt:
        from impl.llm import load_tokenizer
        if a.model is None:
            raise ValueError("--prompt needs --model with a tokenizer (synthetic presets have none)")
        tok = load_tokenizer(a.model)
        resolved["prompts"] = [tok.encode(t) for t in a.prompt]
    opts = options.from_args(a, **resolved)
    shown = opts if opts.model else opts.replace(model=str(checkpoints.cached_checkpoint(opts.preset)))
    print(shown.describe(tol.source if a.tolerances else None) + "\n")  # what ran: a log of the run says it
    # the command line as typed repeats the run (a --prompt text is tokenized the same way again)
    r = run(opts, tol, command=shlex.join(["tpcheck", *argv]))
    if a.save_golden:
        print(f"saved the golden to {a.save_golden} (replay it: the same command with --golden {a.save_golden})")
    if a.dump:
        print(f"dumped to {a.dump} (judge it offline: {shlex.join(['tpcheck', 'compare', str(a.dump), '--model', r.meta['model']])})")
    return _show(r, a)


def _compare(a, argv: list[str]) -> int:
    """One dump against the golden, or two dumps against each other (``tpcheck.cli.compare_two``)."""
    check_output_paths(a.json, a.csv, a.parquet, a.html)
    return _cmd_compare(a, argv) if a.target is None else compare_two.run(a, argv, _cmd_compare)


def _cmd_compare(a, argv: list[str]) -> int:
    if a.model is None:
        raise ValueError("compare DUMP_DIR needs --model (the checkpoint the dump's engine ran)")
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import compare
    from tpcheck.result.meta import RunOrigin
    from tpcheck.reference.reductions import Reductions
    from tpcheck.judge.tolerances import load_tolerances
    from tpcheck.engines.dump.stages import stage_options
    from tpcheck.engines.sglang_dump.reader import open_any
    tol = load_tolerances(a.tolerances)
    dump, engine, stages = open_any(a.dump_dir, a.format, str(a.model), lambda tp: Reductions(tp, a.reduce_dtype),
                                    a.name_rules, a.allow_unmapped)  # stages: a pipelined engine's
    dump.check_model(str(a.model))  # another checkpoint's dump, or token ids outside its vocab: exit 2
    print(f"engine:     {dump.engine} tp={dump.tp}{f' pp={len(stages)}' if stages else ''} {dump.dtype}, replayed "
          f"from the dump {a.dump_dir}\ngolden:     HF float64, computed live on {a.model}\ntolerances: {tol.source}\n")
    opts = DiffOptions(model=str(a.model), dtype=dump.dtype, prompts=engine.prompts,
                       decode_steps=engine.decode_steps, exact_ops=a.exact_ops, require_points=a.require_points,
                       isolate=a.isolate, rounding=a.rounding, **stage_options(engine, stages, str(a.model)))
    origin = RunOrigin(tp=dump.tp, stages=stages, engine=dump.engine, dump=str(a.dump_dir), command=shlex.join(
        ["tpcheck", *argv]))
    return _show(compare(engine, opts, tol, origin), a)


def _show(r, a) -> int:
    """Print the tables and the verdict, write the requested outputs, return the exit code."""
    from tpcheck.result.documents import write_atomic
    from tpcheck.measure.precision import precision_of
    from tpcheck.result.report.html import write_html
    if r.first_divergence is not None:  # the verdict, the origin and the isolate summary first: no table may push them out of sight
        print(r.summary())
    for mode in ["propagated"] + (["isolated"] if r.meta.get("isolate") else []):
        t = r.table[r.table["mode"] == mode]
        shown = t.drop(columns=["order", "mode", "kind"]) if a.all_rows else r.layer_table(mode)
        what = "every row" if a.all_rows else "worst point per layer and step" + \
            (", and the origin" if "origin" in shown else "")
        print(f"\n{mode}: {what}")
        print(_fmt(shown))
    print("\n" + r.summary(brief=True))  # the verdict again, last (a failing run's: with its origin alone)
    print(precision_of(r.table, r.meta))  # the engine's effective precision, after the verdict
    parquet = lambda p: write_atomic(p, lambda t: r.table.drop(columns=["order"]).to_parquet(t, index=False))  # noqa: E731
    for path, write in ((a.json, r.to_json), (a.csv, r.to_csv), (a.parquet, parquet),
                        (a.html, lambda p: write_html(r, p))):
        if path:
            write(path)
            print(f"wrote {path}")
    return result_exit_code(r)


def _cmd_check(a, argv: list[str]) -> int:
    check_output_paths(a.json)
    from impl.config import ConfigError, load_config
    from tpcheck.pipeline.check import check_logits, random_prompts
    model = a.model
    if model is None:
        model = checkpoints.cached_checkpoint(a.preset, seed=0, dtype="float32")
    cfg = load_config(model)
    if a.tp is None:
        tps = [t for t in (1, 2, 4) if _tp_ok(cfg, t)]
    else:
        tps = a.tp
        for t in tps:
            cfg.check_tp(t)
    prompts = a.prompt_ids or random_prompts(cfg.vocab_size, a.batch, a.seq_len, a.seed)
    for i, p in enumerate(prompts):
        if not p or not all(0 <= t < cfg.vocab_size for t in p):
            raise ConfigError(f"prompt {i}: empty or a token id outside the vocab [0, {cfg.vocab_size})")
    if a.logprobs_topk is not None and a.logprobs_topk < 1:
        raise ValueError(f"--logprobs-topk must be >= 1, got {a.logprobs_topk}")
    df = check_logits(model, tps, a.dtype, prompts, logprobs_topk=a.logprobs_topk, device=a.device)
    print(f"model: {model}\n")
    print(df.drop(columns=["argmax_agree"]).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print("argmax_flips: positions whose top token is not the golden's although the golden's top-2 gap there is wider "
          "than twice the noise floor's logit error; near_tie_flips: flips within it (informational, not the verdict)")
    ok = bool(df["passed"].all())
    worst = df.loc[(df["rel_err"] / df["ref_rel_err"].clip(lower=1e-30)).idxmax()]
    print(f"\n{'PASS' if ok else 'FAIL'}: worst tp={worst.tp} prompt {worst.prompt}: rel_err {worst.rel_err:.3g} vs "
          f"HF {a.dtype} {worst.ref_rel_err:.3g}")
    if a.json:
        from tpcheck.result.documents import write_json
        write_json(a.json, "check", {"passed": ok, "model": str(model), "rows": df.to_dict("records")},
                   meta={"dtype": a.dtype, "tp": tps}, command=shlex.join(["tpcheck", *argv]))
    return verdict(ok)


def _tp_ok(cfg, tp: int) -> bool:
    try:
        cfg.check_tp(tp)
        return True
    except ValueError:
        return False


def _exit_code(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an error that ended a command."""
    from impl.config import ConfigError
    from impl.executor import RankError
    from impl.loader import LoadError
    from tpcheck.capture.dump import DumpError
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, (ConfigError, LoadError, DumpError)):  # a checkpoint / dump at fault, even found in a rank
        return Exit.BAD_INPUT, first
    if isinstance(e, RankError) or getattr(e, "rank", None) is not None:
        what = first if first.startswith(("TP rank", "rank")) else f"rank {e.rank}: {type(e).__name__}: {first}"
        return Exit.FAILED, f"the engine failed: {what}"
    if isinstance(e, coverage.CoverageError):
        return Exit.FAILED, f"coverage: {first}"
    if isinstance(e, (ValueError, FileExistsError, FileNotFoundError)):
        return Exit.BAD_INPUT, first
    if isinstance(e, OSError):
        where = f" on {e.filename}" if e.filename else ""
        return Exit.FAILED, f"I/O error{where}: {e.strerror or e}"
    return Exit.FAILED, f"internal error: {type(e).__name__}: {first}"


def default_command(argv: list[str]) -> list[str]:
    """``argv`` with ``diff`` in front where it names no command: nothing (``diff --layer-by-layer``, the main job
    on the embedded synthetic default) or diff's flags alone (``--tp 4``); ``-h`` stays the command line's help."""
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        return ["diff", *argv]
    return argv or ["diff", "--layer-by-layer"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("TPCHECK_DEBUG", "") not in ("", "0")
    quiet = "--quiet" in argv
    argv = [x for x in argv if x not in ("--debug", "--quiet")]  # accepted anywhere on the line
    if argv[:1] == ["--version"]:  # answered before the parser, whose choices import torch (3 s)
        print(_version())
        return 0
    argv = default_command(argv)
    if (bad := check_argv(argv) or unknown_flag(ap := _parser(), argv)) is not None:  # a name, path or flag that
        return refuse(bad)  # cannot be right: exit 2 before any usage (with the closest known names)
    a = ap.parse_args(argv)
    from tpcheck.progress import LogHandler
    progress = LogHandler(sys.stderr)  # the library logs progress at INFO to "tpcheck" (above any progress bar)
    progress.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("tpcheck")
    logger.addHandler(progress)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        return _run(a, argv)
    except KeyboardInterrupt:
        print("tpcheck: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error ends in one line and a documented exit code
        code, message = _exit_code(e)
        if debug:
            traceback.print_exc()
            if getattr(e, "rank_traceback", None):
                print(f"traceback on rank {e.rank}:\n{e.rank_traceback}", file=sys.stderr)
        print(f"tpcheck: error: {message}" + ("" if debug else " (--debug for the traceback)"
                                               if code == Exit.FAILED else ""), file=sys.stderr)
        return code
    finally:
        logger.removeHandler(progress)


def _run(a, argv: list[str]) -> int:
    """The command's handler (each parser sets its own: ``set_defaults(handler=...)`` beside its flags), once the
    outputs are known not to clash (``tpcheck.cli.paths.check_outputs``: exit 2 before any work)."""
    from tpcheck.cli.paths import check_outputs
    check_outputs(a)
    if getattr(a, "handler", None) is None:  # argparse sets no default for a bare parser: no command given
        _parser().print_help()
        return Exit.BAD_INPUT
    return a.handler(a, argv)


def _presets(a, argv: list[str]) -> int:
    for name in preset_names():
        print(describe_preset(name))
    return 0


def _schema(a, argv: list[str]) -> int:
    from tpcheck.result.documents import load_schema
    print(json.dumps(load_schema(), indent=2))
    return 0


def _faults_list(a, argv: list[str]) -> int:
    from tpcheck.engines.impl.faults import FAULTS
    for f in FAULTS.values():
        print(f"{f.name:42s} {f.description}\n{'':42s} shows: {f.shows_when}; origin: {f.expected_origin}")
    return 0


def _completion(a, argv: list[str]) -> int:
    from tpcheck.cli.completion import bash_script
    if a.shell == "zsh":
        print("autoload -U +X bashcompinit && bashcompinit")
    print(bash_script(_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
