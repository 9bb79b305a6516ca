"""Synthetic ``DiffResult`` s shaped like ``tpcheck.diff``'s, for tests and report previews (no model run).

``sample_result(num_layers=24, decode_steps=8, isolate=True)`` has 7,398 rows, like the ``qwen2.5-0.5b``
preset with 8 decode steps and ``--isolate``. With ``fail_at="layers.2.attn.q_rope"`` that point leaves the
noise floor at every step and everything after it (propagated) inherits the error."""
from __future__ import annotations

import math
import random

from tpcheck.measure.metrics import FLOOR, K_FACTOR
from tpcheck.capture.points import point_names, split_point
from tpcheck.result.table import DiffResult


def sample_result(num_layers: int = 4, decode_steps: int = 2, isolate: bool = True, fail_at: str | None = None,
                  dtype: str = "float32", seed: int = 0, meta: dict | None = None) -> DiffResult:
    rng = random.Random(seed)
    names = point_names(num_layers, with_kv=decode_steps > 0)
    if fail_at is not None and fail_at not in names:
        raise ValueError(f"{fail_at!r} is not a point of a {num_layers}-layer model")
    k, floor = K_FACTOR[dtype], FLOOR[dtype]
    base = 1e-7 if dtype in ("float32", "float64") else 3e-3
    rows = []
    for mode in ["propagated"] + (["isolated"] if isolate else []):
        for step in range(decode_steps + 1):
            bad = False
            for order, p in enumerate(names):
                layer, kind = split_point(p)
                ref = 0.0 if p == "embed" else base * (1 + 0.15 * (layer if layer is not None else num_layers)) \
                    * math.exp(rng.gauss(0, 0.3))
                bad = bad or p == fail_at
                if bad and (mode == "propagated" or layer == split_point(fail_at)[0]):
                    rel = min(1.5, 0.2 * (1 + order / len(names)) * math.exp(rng.gauss(0, 0.1)))
                else:
                    rel = ref * (1 + rng.uniform(-0.2, 0.4))
                thr = k * ref + floor
                norm = 40.0 + order * 0.5
                rows.append({"point": p, "layer": layer, "step": step, "mode": mode, "kind": kind, "rel_err": rel,
                             "ref_rel_err": ref, "ref_rel_err_hf": ref, "threshold": thr, "excess": rel / thr,
                             "cosine": 1 - rel * rel / 2,
                             "max_abs": rel * norm / 3, "max_abs_index": [rng.randrange(2), rng.randrange(32),
                                                                           rng.randrange(896)],
                             "mean_abs": rel * norm / 40, "p99_abs": rel * norm / 8, "ref_norm": norm, "nan": 0,
                             "inf": 0, "passed": rel <= thr, "rank_spread_by": "", "note": "", "order": order})
    m = {"model": "/checkpoints/sample", "dtype": dtype, "decode_steps": decode_steps, "isolate": isolate,
         "num_layers": num_layers, "prompt_lens": [32, 32], "tp": 2, "inject": [], "inject_layer": None,
         "command": f"tpcheck diff --layer-by-layer --model /checkpoints/sample --tp 2 --dtype {dtype}"
                    f" --decode-steps {decode_steps}" + (" --isolate" if isolate else "")}
    return DiffResult.from_rows(rows, {**m, **(meta or {})})
