"""The fault matrix's depth axis: every per-layer fault injected into one decoder layer at a time, the first, the
middle and the last, so a table shows whether a bug deep in the model is found as clearly as one in layer 0.

    tpcheck faults matrix --depth                                   # each fault's smallest configuration
    tpcheck faults matrix --depth --preset deep-sink --tp 2,4 --dtype bfloat16,float16

With ``--preset`` (and ``--tp`` / ``--dtype``) every per-layer fault runs on each configuration of those where it
can show (``Fault.applies``), in the prefill or decode layout the fault needs; without, on its smallest
configuration (``fault_matrix.smallest_config``). The expected origin is the fault's point in the injected layer;
``excess`` is the origin's, so a row at the last layer reads beside the one at layer 0."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tpcheck.progress import bar

if TYPE_CHECKING:  # the matrix, impl and pandas load with the run, not with the parser (add_arguments)
    import pandas as pd

logger = logging.getLogger(__name__)


def add_arguments(p) -> None:
    """``tpcheck faults matrix``'s depth flags."""
    split = lambda cast: lambda s: [cast(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--depth", action="store_true", help="the depth axis instead: each per-layer fault injected into "
                   "the first, the middle and the last decoder layer (tpcheck.cli.fault_depth)")
    p.add_argument("--preset", type=split(str), default=None,
                   help="with --depth: run on these presets (default: each fault's smallest configuration)")
    p.add_argument("--tp", type=split(int), default=None, help="with --depth --preset: TP sizes (default 1,2,4)")
    p.add_argument("--dtype", type=split(str), default=None,
                   help="with --depth --preset: dtypes (default float32,bfloat16)")


def depth_layers(num_layers: int, eligible=None) -> list[int]:
    """The first, the middle and the last decoder layer (fewer where they coincide) of those ``eligible(layer)``
    admits (a MoE fault: the sparse layers; None: every layer)."""
    layers = [i for i in range(num_layers) if eligible is None or eligible(i)]
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]}) if layers else []


def depth_configs(name: str, ckpt, presets=None, tps=None, dtypes=None) -> list[dict]:
    """The configurations fault ``name`` runs on: its smallest (no ``presets``), or every (preset, tp, dtype)
    of those given where it shows."""
    from impl.config import load_config
    from tpcheck.cli import fault_matrix as fm
    from tpcheck.engines.impl.faults import get_fault
    fault = get_fault(name)
    if not presets:
        return [fm.smallest_config(fault, ckpt)]
    layout = fm.DECODE if fault.decode_only else fm.PREFILL
    out = []
    for preset in presets:
        cfg = load_config(ckpt(preset))
        for tp in tps or fm.TP_ORDER:
            for dtype in dtypes or fm.DTYPE_ORDER:
                if fault.applies(cfg, tp, dtype):
                    out.append(dict(preset=preset, tp=tp, dtype=dtype, **layout))
    return out


def depth_row(name: str, config: dict, layer: int, pool, ckpt) -> dict:
    """``name`` injected into decoder ``layer`` only, on ``config``: found, where, and by how much."""
    from tpcheck.cli import fault_matrix as fm
    from tpcheck.engines.impl.faults import get_fault
    fault = get_fault(name)
    t0 = time.monotonic()
    r = fm._diff(pool, ckpt, config, [name], inject_layer=layer)
    fd = r.first_divergence
    exp_point, exp_step = fault.origin(layer), fm.expected_step(fault, config)
    detected = not r.passed
    if detected:
        origin_ok = (fd["point"], fd["step"]) == (exp_point, exp_step)
        excess, note = fd["excess"], fd["note"] or ""
        if fd.get("mode") == "isolated":
            note = ("local pass" + (f"; {note}" if note else ""))
    else:
        t = r.table[r.table["point"] == exp_point]
        origin_ok, excess = False, float(t["excess"].max()) if len(t) else float("nan")
        note = f"undetected: {exp_point} reached {excess:.3g}x its threshold"
    prop = r.table[(r.table["mode"] == "propagated") & (r.table["point"] == exp_point) &
                   (r.table["step"] == exp_step)]["excess"]
    if len(prop):  # the propagated pass alone at the expected origin: the verdict before the local pass
        note = (note + "; " if note else "") + f"propagated pass there: {float(prop.max()):.3g}x"
    config = dict(config, inject_layer=layer)
    return fm._row(name, config, "diff", detected=detected, origin=fm._at(fd and fd["point"], fd and fd["step"]),
                   expected_origin=fm._at(exp_point, exp_step), origin_ok=origin_ok, ok=detected and origin_ok,
                   by=fm.flagged_by(fd), excess=excess, note=note, origin_point=fd and fd["point"],
                   origin_step=fd and fd["step"], expected_point=exp_point, expected_step=exp_step,
                   inject_layer=layer, seconds=time.monotonic() - t0)


def run_depth(faults: list[str] | None = None, pool=None, ckpt=None, presets=None, tps=None,
              dtypes=None) -> pd.DataFrame:
    """One row per (per-layer fault, configuration, layer in ``depth_layers``). Columns: ``fault_matrix.COLUMNS``."""
    import pandas as pd
    from impl import CacheConfig
    from impl.config import load_config
    from tpcheck.cli import fault_matrix as fm
    from tpcheck.engines.impl.faults import FAULTS, get_fault
    from tpcheck.engines.pool import EnginePool
    names = [n for n in (list(FAULTS) if faults is None else [get_fault(n).name for n in faults])
             if get_fault(n).per_layer and get_fault(n).check == "diff"]
    ckpt = fm._resolver(ckpt)
    runs = [(n, c, layer) for n in names for c in depth_configs(n, ckpt, presets, tps, dtypes)
            for cfg in [load_config(ckpt(c["preset"]))]
            for layer in depth_layers(cfg.num_layers, lambda i, f=get_fault(n), m=cfg: f.shows_in_layer(m, i))]
    own = pool is None
    pool = pool or EnginePool(cache=CacheConfig(max_num_seqs=16))
    rows = []
    progress = bar(len(runs), "fault matrix (depth)", "run")
    try:
        for n, c, layer in runs:
            progress.set_description(f"depth: {n} layer {layer}")
            logger.info(f"fault-matrix depth: {n} at layer {layer} on {fm.describe_config(c)} ...")
            rows.append(depth_row(n, c, layer, pool, ckpt))
            progress.update(1)
    finally:
        progress.close()
        if own:
            pool.close()
    return pd.DataFrame(rows, columns=fm.COLUMNS)
