"""``tpcheck`` command line. Exit codes: 0 every check passed, 1 a check failed, 2 bad usage or input.

With no arguments it runs ``tpcheck diff --layer-by-layer`` on the embedded ``small`` synthetic checkpoint at tp 2."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tpcheck import checkpoints


def int_list(text: str, minimum: int | None = None) -> list[int]:
    """argparse type for ``1,2,4``: a non-empty list of integers (each >= ``minimum`` when given)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or (minimum is not None and any(v < minimum for v in values)):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers{f' >= {minimum}' if minimum is not None else ''}, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    return int_list(text, 1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tpcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")

    mk = sub.add_parser("make-checkpoint", help="write a synthetic Hugging Face Qwen2 checkpoint")
    mk.add_argument("--preset", required=True, choices=checkpoints.preset_names())
    mk.add_argument("--out", required=True, type=Path)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="float32", choices=sorted(checkpoints.DTYPES))
    mk.add_argument("--shards", type=int, default=1, help="number of safetensors files (>1 writes an index)")

    sub.add_parser("presets", help="list the synthetic checkpoint presets")
    fl = sub.add_parser("faults", help="the injectable TP faults (tpcheck diff --inject NAME)")
    fsub = fl.add_subparsers(dest="action", required=True)
    fsub.add_parser("list", help="each fault: description, where it shows, expected origin")
    from tpcheck import fault_matrix
    fault_matrix.register(fsub)

    ck = sub.add_parser("check", help="impl logits vs an fp64 HF golden run, gated by HF's own noise at the dtype")
    src = ck.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a Hugging Face Qwen2 checkpoint directory")
    src.add_argument("--preset", default="tiny", choices=checkpoints.preset_names(),
                     help="synthetic checkpoint used when --model is not given (default: tiny)")
    ck.add_argument("--tp", type=int_list, default=None, help="TP sizes, e.g. 1,2,4 (default: all the model allows of 1,2,4)")
    ck.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ck.add_argument("--prompt-ids", type=int_list, action="append", help="a prompt as token ids (repeatable)")
    ck.add_argument("--seq-len", type=int, default=64)
    ck.add_argument("--batch", type=int, default=2)
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--json", type=Path, help="write the table as JSON")
    df = sub.add_parser("diff", help="layer-by-layer differential run: where the engine leaves the noise floor")
    df.add_argument("--layer-by-layer", action="store_true", help="(the only mode; accepted for clarity)")
    src = df.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a Hugging Face Qwen2 checkpoint directory")
    src.add_argument("--preset", default="small", choices=checkpoints.preset_names(),
                     help="synthetic checkpoint used when --model is not given (default: small)")
    df.add_argument("--tp", type=int, default=2)
    df.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    inp = df.add_mutually_exclusive_group()
    inp.add_argument("--prompt-ids", type=int_list, action="append", help="a prompt as token ids (repeatable)")
    inp.add_argument("--prompt", action="append", help="prompt text (needs a tokenizer in --model; repeatable)")
    df.add_argument("--seq-len", type=int, default=32, help="random prompts: tokens each (default 32)")
    df.add_argument("--batch", type=int, default=2, help="random prompts: how many (default 2)")
    df.add_argument("--seed", type=int, default=0, help="random prompts: seed")
    df.add_argument("--decode-steps", type=int, default=0)
    df.add_argument("--isolate", action="store_true", help="also run teacher-forced: each layer's local error")
    df.add_argument("--exact-ops", action="store_true",
                    help="also fail any RMSNorm or residual add whose output is not bit-identical to HF's module "
                         "applied to the engine's own input (catches arithmetic that departs from HF's yet is as "
                         "accurate, e.g. rmsnorm_weight_before_cast; see tpcheck.exact_ops)")
    df.add_argument("--inject", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="faults to inject into impl (tpcheck faults list)")
    df.add_argument("--inject-layer", type=int, default=None, help="only this decoder layer gets the faults")
    df.add_argument("--block-size", type=int, default=16)
    df.add_argument("--json", type=Path, help="write the verdict, origin and every row as JSON")
    df.add_argument("--csv", type=Path, help="write every row as CSV")
    df.add_argument("--all-rows", action="store_true", help="print every row, not the worst point per layer")
    df.add_argument("--parquet", type=Path, help="write every row as Parquet (needs pyarrow)")
    df.add_argument("--html", type=Path, help="write the self-contained HTML report")
    df.add_argument("--tolerances", type=Path, metavar="FILE.toml",
                    help="gate tolerances (default: [tool.tpcheck] in ./pyproject.toml, else the built-in ones)")
    from tpcheck import gate, sweep
    gate.register(sub)
    sweep.register(sub)
    return ap


def _fmt(df) -> str:
    return df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}")


def _cmd_diff(a, argv: list[str]) -> int:
    import shlex
    import tpcheck
    from tpcheck.report.html import write_html
    from tpcheck.tolerances import load_tolerances, rejudge
    tol = load_tolerances(a.tolerances)  # before the run: a bad file fails fast (ToleranceError -> exit 2)
    prompts = a.prompt_ids
    if a.prompt:
        from impl.llm import load_tokenizer
        if a.model is None:
            raise ValueError("--prompt needs --model with a tokenizer (synthetic presets have none)")
        tok = load_tokenizer(a.model)
        prompts = [tok.encode(t) for t in a.prompt]
    r = tpcheck.diff(model=a.model, preset=a.preset, tp=a.tp, dtype=a.dtype, prompts=prompts,
                     decode_steps=a.decode_steps, isolate=a.isolate, inject=a.inject, inject_layer=a.inject_layer,
                     block_size=a.block_size, seq_len=a.seq_len, batch=a.batch, seed=a.seed, exact_ops=a.exact_ops,
                     command=shlex.join(["tpcheck", *argv]), tolerances=tol)
    r = rejudge(r, tol)  # the abs_max bounds; thresholds are already tol's
    for mode in ["propagated"] + (["isolated"] if a.isolate else []):
        t = r.table[r.table["mode"] == mode]
        shown = t.drop(columns=["order", "mode", "kind"]) if a.all_rows else r.layer_table(mode)
        print(f"\n{mode}: {'every row' if a.all_rows else 'worst point per layer and step'}")
        print(_fmt(shown))
    print()
    print(r.summary())
    parquet = lambda p: r.table.drop(columns=["order"]).to_parquet(p, index=False)  # noqa: E731
    for path, write in ((a.json, r.to_json), (a.csv, r.to_csv), (a.parquet, parquet),
                        (a.html, lambda p: write_html(r, p))):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
            print(f"wrote {path}")
    return 0 if r.passed else 1


def _cmd_check(a) -> int:
    from impl.config import ConfigError, load_config
    from tpcheck.check import check_logits, random_prompts
    model = a.model
    if model is None:
        model = checkpoints.cached_checkpoint(a.preset, seed=0, dtype="float32",
                                              root=Path(tempfile.gettempdir()) / "tpcheck-checkpoints")
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
    df = check_logits(model, tps, a.dtype, prompts)
    print(f"model: {model}\n")
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    ok = bool(df["passed"].all())
    worst = df.loc[(df["rel_err"] / df["ref_rel_err"].clip(lower=1e-30)).idxmax()]
    print(f"\n{'PASS' if ok else 'FAIL'}: worst tp={worst.tp} prompt {worst.prompt}: rel_err {worst.rel_err:.3g} vs "
          f"HF {a.dtype} {worst.ref_rel_err:.3g}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"passed": ok, "model": str(model), "rows": df.to_dict("records")}, indent=1))
    return 0 if ok else 1


def _tp_ok(cfg, tp: int) -> bool:
    try:
        cfg.check_tp(tp)
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = argv or ["diff", "--layer-by-layer"]  # the main job, on the embedded synthetic default
    a = _parser().parse_args(argv)
    from impl.config import ConfigError
    from impl.loader import LoadError
    try:
        if a.cmd == "make-checkpoint":
            print(checkpoints.make_checkpoint(a.preset, a.out, seed=a.seed, dtype=a.dtype, shards=a.shards))
            return 0
        if a.cmd == "presets":
            for name in checkpoints.preset_names():
                c = checkpoints.PRESETS[name]
                print(f"{name:14s} hidden {c['hidden_size']:4d}  heads {c['num_attention_heads']:2d}/"
                      f"{c['num_key_value_heads']} kv  layers {c['num_hidden_layers']:2d}  vocab {c['vocab_size']:6d}  "
                      f"{'tied' if c.get('tie_word_embeddings') else 'untied'}")
            return 0
        if a.cmd == "faults":
            if a.action == "matrix":
                from tpcheck import fault_matrix
                return fault_matrix.run(a)
            from tpcheck.faults import FAULTS
            for f in FAULTS.values():
                print(f"{f.name:42s} {f.description}\n{'':42s} shows: {f.shows_when}; origin: {f.expected_origin}")
            return 0
        if a.cmd == "check":
            return _cmd_check(a)
        if a.cmd == "diff":
            return _cmd_diff(a, argv)
        if a.cmd == "sweep":
            from tpcheck import sweep
            return sweep.run(a)
        if a.cmd in ("gate", "report"):
            from tpcheck import gate
            return gate.run(a)
    except (ConfigError, LoadError, FileExistsError, ValueError) as e:
        print(f"tpcheck: error: {e}", file=sys.stderr)
        return 2
    _parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
