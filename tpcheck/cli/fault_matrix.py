"""The sensitivity table: every fault on the smallest configuration where it shows, plus clean runs.

``run_matrix`` injects each fault of ``tpcheck.engines.impl.faults`` into impl on ``smallest_config(fault)`` and runs
``tpcheck.diff`` with ``exact_ops`` (every decoder layer faulty, so the expected origin is in layer 0); a
memory fault is checked by ``memory_check`` (tensor bytes each rank holds against its share of the
checkpoint) instead. The ``by`` column says which check flagged the origin: the noise floor, exact ops
(``tpcheck.measure.exact_ops``: the only one that sees ``rmsnorm_weight_before_cast``, which is *more* accurate
than HF), a NaN, a shape, ranks disagreeing, or memory.
Each distinct configuration is also run clean, in float32 and bfloat16: a clean run that fails the diff
or the memory check is a false alarm.

    tpcheck faults matrix                          # every fault; exit 0: all found where expected
    tpcheck faults matrix --faults rope_skipped,vocab_ids_not_masked --json m.json
"""
from __future__ import annotations

import logging

import math
import random
import time

import pandas as pd

from impl import CacheConfig
from impl.config import load_config
from tpcheck.engines.impl.faults import FAULTS, Fault, get_fault
from tpcheck.progress import bar
from tpcheck.result.origin import ranks_cause
from tpcheck.inputs.models.checkpoints import QUANTIZED, preset_available

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr

# candidate configurations, smallest first: a fault runs on the first one where it can show. The Qwen2 presets
# come first (every fault that any family shows keeps its Qwen2 configuration); a family fault (``shows``
# needs q/k norms, llama3 RoPE, no q/k/v bias, a sliding window) reaches the first tiny preset of a family
# that has the option (tpcheck.inputs.models.checkpoints: tiny-llama, tiny-mistral, tiny-qwen3)
PRESET_ORDER = ("tiny", "tiny-mqa", "tiny-mha", "tiny-untied", "small",
                "tiny-llama", "tiny-llama-bias", "tiny-mistral", "tiny-qwen3", "tiny-qwen2-moe", "tiny-qwen3-moe",
                "tiny-mixtral", "tiny-gemma3", "small-w8a8", "small-w8a8-tensor", "small-gptq", "small-gptq-act",
                "small-awq", "small-fp8", "small-fp8-tensor", "small-fp8-static", "small-fp8-kv", "small-fp8-kv-head")
TP_ORDER = (1, 2, 4)
DTYPE_ORDER = ("float32", "bfloat16")
CLEAN_DTYPES = ("float32", "bfloat16")
PREFILL = dict(decode_steps=0, prompt_lens=(12, 17), block_size=16)
# decode: both prompts cross a block boundary (positions 8 and 16) at decode step 3
DECODE = dict(decode_steps=3, prompt_lens=(6, 14), block_size=8)

# impl does HF's elementwise arithmetic in HF's order, so it is held to HF's bits there (tpcheck.measure.exact_ops)
EXACT_OPS = True

COLUMNS = ["fault", "config", "check", "detected", "origin", "expected_origin", "origin_ok", "ok", "by", "excess",
           "note", "preset", "tp", "dtype", "decode_steps", "prompt_lens", "block_size", "origin_point",
           "origin_step", "expected_point", "expected_step", "inject_layer", "seconds"]


# ---- configurations -------------------------------------------------------------------------------------

def _resolver(ckpt):
    if ckpt is not None:
        return ckpt
    from tpcheck.inputs.models.checkpoints import cached_checkpoint
    return cached_checkpoint


def smallest_config(fault: Fault | str, ckpt=None) -> dict:
    """The smallest configuration where ``fault`` can show: ``{preset, tp, dtype, decode_steps,
    prompt_lens, block_size}`` (presets, then TP sizes, smallest first; float32 before bfloat16; the
    decode layout for decode-only faults). ``ckpt(preset) -> checkpoint dir`` (default: the cache)."""
    fault = get_fault(fault) if isinstance(fault, str) else fault
    ckpt = _resolver(ckpt)
    for dtype in DTYPE_ORDER:
        for preset in (p for p in PRESET_ORDER if preset_available(p)):  # a family this transformers lacks: skipped
            cfg = load_config(ckpt(preset))
            for tp in TP_ORDER:
                if fault.applies(cfg, tp, dtype):
                    layout = DECODE if fault.decode_only else PREFILL
                    stages = {"pp": fault.pp} if fault.pp > 1 else {}  # a pipeline fault: its stages, vLLM's split
                    return dict(preset=preset, tp=tp, dtype=dtype, **layout, **stages)
    raise ValueError(f"{fault.name}: shows in none of the candidate configurations")


def _has_config(name: str, ckpt) -> bool:
    try:
        smallest_config(name, ckpt)
        return True
    except ValueError:
        logger.warning(f"fault-matrix: {name} shows on no preset this transformers reads: left out")
        return False


def expected_step(fault: Fault, config: dict) -> int:
    """The step of the fault's expected origin in ``config``."""
    step = fault.expected_step(config["prompt_lens"], config["decode_steps"], config["block_size"])
    if step is not None:
        return step
    raise ValueError(f"{fault.name}: no prompt crosses a block boundary in {describe_config(config)}")


def describe_config(c: dict) -> str:
    """``tiny tp=2 float32 prefill 12+17`` / ``tiny tp=1 float32 decode 3 bs8 6+14`` (prompt lengths last)."""
    lens = "+".join(map(str, c["prompt_lens"]))
    steps = f"decode {c['decode_steps']} bs{c['block_size']}" if c["decode_steps"] else "prefill"
    layer = "" if c.get("inject_layer") is None else f" layer {c['inject_layer']}"
    pp = f" pp={c['pp']}" if c.get("pp", 1) > 1 else ""
    return f"{c['preset']} tp={c['tp']}{pp} {c['dtype']} {steps} {lens}{layer}"


def prompts_for(config: dict, vocab_size: int) -> list[list[int]]:
    rng = random.Random(f"fault-matrix-{config['preset']}-{config['prompt_lens']}")
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in config["prompt_lens"]]


def _layout_key(c: dict) -> tuple:
    return (c["preset"], c["tp"], c.get("pp", 1), c["decode_steps"], tuple(c["prompt_lens"]), c["block_size"])


# ---- the memory check: tpcheck.cli.fault_memory (rank_memory runs in the ranks by this module's path too) --------

from tpcheck.cli.fault_memory import (  # noqa: E402,F401
    MEM_FACTOR, MEM_SLACK, _memory_note, _tensors_reachable, expected_share, memory_check, rank_memory,
)


# ---- the matrix -------------------------------------------------------------------------------------------

def _diff(pool, ckpt, config: dict, inject: list[str], inject_layer: int | None = None):
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.diff import run
    d = ckpt(config["preset"])
    prompts = prompts_for(config, load_config(d).vocab_size)
    return run(DiffOptions(model=str(d), tp=config["tp"], dtype=config["dtype"], prompts=prompts,
                           decode_steps=config["decode_steps"], inject=tuple(inject), block_size=config["block_size"],
                           exact_ops=EXACT_OPS, inject_layer=inject_layer, pp=config.get("pp", 1),
                           **({"local_rows": config["local_rows"]} if "local_rows" in config else {})), pool=pool)


def _stage1(ckpt, config: dict) -> int | None:
    """The first layer of pipeline stage 1 in ``config`` (vLLM's split); None without stages."""
    from impl.pipeline import layer_partition
    pp = config.get("pp", 1)
    return None if pp == 1 else layer_partition(load_config(ckpt(config["preset"])).num_layers, pp)[0]


def _row(name: str, config: dict, check: str, **kw) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(fault=name, config=describe_config(config), check=check, preset=config["preset"], tp=config["tp"],
               dtype=config["dtype"], decode_steps=config["decode_steps"],
               prompt_lens=",".join(map(str, config["prompt_lens"])), block_size=config["block_size"], note="")
    row.update(kw)
    return row


def _at(point, step) -> str:
    return "-" if point is None else f"{point} @ step {step}"


def flagged_by(fd: dict | None) -> str:
    """Which check failed the origin row ``fd`` (``DiffResult.first_divergence``): "gain" where only the gain
    statistic (``tpcheck.judge.verdict``) did."""
    if fd is None:
        return "-"
    note = fd["note"] or ""
    for prefix, by in (("exact-ops", "exact ops"), ("shape", "shape"), ("ranks", "ranks disagree")):
        if note.startswith(prefix):
            return by
    if ranks_cause(fd):  # another rank's replica errs where the first one does not
        return "ranks disagree"
    if math.isnan(fd["rel_err"]):
        return "NaN"
    gain, thr = fd.get("gain", math.nan), fd.get("gain_threshold", math.nan)
    return "gain" if abs(gain) > thr and fd["rel_err"] <= fd["threshold"] else "noise floor"


def fault_row(name: str, pool, ckpt=None) -> dict:
    """Inject one fault on its smallest configuration and report what the checks found."""
    ckpt = _resolver(ckpt)
    fault = get_fault(name)
    config = smallest_config(fault, ckpt)
    t0 = time.monotonic()
    r = _diff(pool, ckpt, config, [name])
    fd = r.first_divergence
    if fault.check == "memory":
        llm = pool.get(ckpt(config["preset"]), config["tp"], config["dtype"])
        m = memory_check(llm, [name])
        note = _memory_note(m) + ("; diff passes: numerics unchanged" if r.passed else
                                  f"; diff FAILS at {_at(fd['point'], fd['step'])}: numerics changed")
        ok = m["flagged"] and r.passed
        return _row(name, config, "memory", detected=m["flagged"], origin="memory" if m["flagged"] else "-",
                    expected_origin="memory", origin_ok=m["flagged"], ok=ok, by="memory" if m["flagged"] else "-",
                    excess=m["excess"], note=note,
                    origin_point="memory" if m["flagged"] else None, expected_point="memory",
                    seconds=time.monotonic() - t0)
    if fault.check == "invariance":  # its bits change with the batch: tpcheck invariance (excess: ulps)
        from tpcheck.cli.fault_invariance import invariance_fields
        fields = invariance_fields(fault, config, str(ckpt(config["preset"])), pool, r.passed)
        return _row(name, config, "invariance", **fields, seconds=time.monotonic() - t0)
    exp_point, exp_step = fault.origin(None, stage1=_stage1(ckpt, config)), expected_step(fault, config)
    detected = not r.passed
    if detected:
        origin_ok = (fd["point"], fd["step"]) == (exp_point, exp_step)
        excess, note = fd["excess"], fd["note"] or ""
    else:  # how close it came: the largest excess at the expected point
        t = r.table[r.table["point"] == exp_point]
        origin_ok, excess = False, float(t["excess"].max()) if len(t) else float("nan")
        note = f"undetected: {exp_point} reached {excess:.3g}x its threshold"
    return _row(name, config, "diff", detected=detected, origin=_at(fd and fd["point"], fd and fd["step"]),
                expected_origin=_at(exp_point, exp_step), origin_ok=origin_ok, ok=detected and origin_ok,
                by=flagged_by(fd), excess=excess, note=note, origin_point=fd and fd["point"], origin_step=fd and fd["step"],
                expected_point=exp_point, expected_step=exp_step, seconds=time.monotonic() - t0)


def clean_row(config: dict, pool, ckpt=None) -> dict:
    """A clean run of ``config``: the diff and the memory check must both stay quiet."""
    ckpt = _resolver(ckpt)
    t0 = time.monotonic()
    r = _diff(pool, ckpt, config, [])
    m = memory_check(pool.get(ckpt(config["preset"]), config["tp"], config["dtype"], pp=config.get("pp", 1)))
    fd = r.first_divergence
    alarms = []
    if not r.passed:
        alarms.append(f"diff fails at {_at(fd['point'], fd['step'])}")
    if m["flagged"]:
        alarms.append("memory: " + _memory_note(m))
    worst = r.worst()
    note = "; ".join(alarms) or (f"closest: {worst.point} @ step {worst.step} at {worst.excess:.2f}x; memory "
                                 f"{m['excess']:.2f}x its limit")
    return _row("(clean)", config, "diff+memory", detected=bool(alarms),
                origin=_at(fd and fd["point"], fd and fd["step"]), expected_origin="-", origin_ok=None,
                ok=not alarms, by=", ".join(filter(None, [flagged_by(fd) if fd else "", "memory" if m["flagged"] else ""]))
                or "-", excess=float(worst.excess), note=note,
                origin_point=fd and fd["point"], origin_step=fd and fd["step"], seconds=time.monotonic() - t0)


def clean_configs(configs: list[dict], dtypes=CLEAN_DTYPES) -> list[dict]:
    """Each distinct layout of ``configs`` (preset, tp, prompts, decode steps, block size) once per dtype; a
    quantized preset's float32 run is float16's (float32 quantized runs are refused: near ties), an FP8 preset's
    is bfloat16's alone (on the e4m3 grid float16 has near ties too: README "FP8 W8A8")."""
    seen, out = set(), []
    for c in configs:
        key = _layout_key(c)
        if key not in seen:
            seen.add(key)
            quantized = c["preset"] in QUANTIZED
            alt = "bfloat16" if quantized and "fp8" in QUANTIZED[c["preset"]][1] else "float16"
            want = [alt if quantized and d == "float32" else d for d in dtypes]
            out += [dict(c, dtype=d) for d in dict.fromkeys(want)]
    return out


def run_matrix(faults: list[str] | None = None, pool=None, ckpt=None, clean: bool = True,
               clean_dtypes=CLEAN_DTYPES) -> pd.DataFrame:
    """One row per fault (on its smallest configuration), then one clean row per distinct configuration
    used and dtype. Columns: ``COLUMNS``; ``ok`` is the verdict of each row (a fault detected at its
    expected origin and step; a clean run without alarm)."""
    from tpcheck.engines.pool import EnginePool
    names = list(FAULTS) if faults is None else [get_fault(n).name for n in faults]
    ckpt = _resolver(ckpt)
    if faults is None:  # every fault: those no preset this transformers reads can show (MoE on 4.x) are left out
        names = [n for n in names if _has_config(n, ckpt)]
    own = pool is None
    pool = pool or EnginePool(cache=CacheConfig(max_num_seqs=16))
    rows = []
    cleans = clean_configs([smallest_config(n, ckpt) for n in names], clean_dtypes) if clean else []
    progress = bar(len(names) + len(cleans), "fault matrix", "run")
    try:
        for n in names:
            progress.set_description(f"fault matrix: {n}")
            logger.info(f"fault-matrix: {n} ...")
            rows.append(fault_row(n, pool, ckpt))
            progress.update(1)
        for c in cleans:
            progress.set_description(f"fault matrix: clean {describe_config(c)}")
            logger.info(f"fault-matrix: clean {describe_config(c)} ...")
            rows.append(clean_row(c, pool, ckpt))
            progress.update(1)
    finally:
        progress.close()
        if own:
            pool.close()
    return pd.DataFrame(rows, columns=COLUMNS)


def _fmt_excess(v, origin) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "NaN" if origin not in (None, "-") else "-"  # the origin point itself is NaN
    return "inf (shape)" if math.isinf(v) else f"{v:.3g}x"


def format_table(df: pd.DataFrame) -> str:
    """The table as ``tpcheck faults matrix`` prints it."""
    t = df[["fault", "config", "detected", "origin", "expected_origin", "ok", "by", "excess"]].copy()
    t["detected"] = t["detected"].map({True: "yes", False: "no"})
    t["ok"] = t["ok"].map({True: "ok", False: "MISS"})
    t.loc[df["fault"] == "(clean)", "ok"] = df.loc[df["fault"] == "(clean)", "ok"].map({True: "quiet", False: "ALARM"})
    t["excess"] = [_fmt_excess(v, o) for v, o in zip(df["excess"], df["origin"])]
    ulps = (df["check"] == "invariance") & df["excess"].notna()  # an invariance fault's excess: its ulps
    t.loc[ulps, "excess"] = [f"{v:.0f} ulps" for v in df.loc[ulps, "excess"]]
    cells = [list(t.columns)] + t.astype(str).values.tolist()
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) if i == len(widths) - 1 else c.ljust(w)
                                for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells)
