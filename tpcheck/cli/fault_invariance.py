"""The fault matrix's check of an invariance fault (``Fault.check == "invariance"``): ``tpcheck invariance`` in
impl's batch-invariant mode under the schedule that exercises the fault (``SCHEDULES``: "batch", the probe alone
vs batched beside seven companions; "slot", the probe at slot 3 of them; "chunk", its prompt fed 5 tokens a step),
where it must break first at its expected origin, and under schedules that do not, where the probe must stay
bitwise identical; the diff itself must pass (the fault is within float noise)."""
from __future__ import annotations

from tpcheck.engines.impl.faults import Fault

BATCH = 8  # the batched schedule: the probe beside seven companions of other lengths
# per schedule: (the run that exercises it, what it is called, the runs that do not, what they are called)
SCHEDULES = {
    "batch": (dict(batches=(1, BATCH)), f"batch {BATCH}",
              dict(batches=(1,), prefix_cache=True, chunks=(5,)), "prefix hit, chunked prefill"),
    "slot": (dict(batches=(1, BATCH), slot=3), f"slot 3 of batch {BATCH}",
             dict(batches=(1, BATCH), slot=0, prefix_cache=True, chunks=(5,)),
             f"slot 0 of batch {BATCH}, prefix hit, chunked prefill"),
    "chunk": (dict(batches=(1,), chunks=(5,)), "chunked prefill (5 tokens a step)", dict(batches=(1, BATCH)),
              f"batch {BATCH}"),
}


def invariance_fields(fault: Fault, config: dict, model_dir: str, pool, diff_passed: bool) -> dict:
    """The fault matrix row's fields (``detected``, ``origin``, ``ok``, ...) of invariance fault ``fault`` on
    ``config``'s preset, TP size and dtype."""
    from tpcheck.options import DiffOptions
    from tpcheck.pipeline.invariance import InvarianceOptions, run
    engine = DiffOptions(model=model_dir, dtype=config["dtype"], inject=(fault.name,))
    common = dict(tps=(config["tp"],), batch_invariant=True, ulps=0)
    if fault.schedule not in SCHEDULES:
        raise ValueError(f"{fault.name}: the fault matrix runs invariance faults of the schedules {list(SCHEDULES)}, "
                         f"not {fault.schedule!r}")
    exercise, exercised, rest, others = SCHEDULES[fault.schedule]
    hit = run(InvarianceOptions(engine, **exercise, **common), pool=pool)
    quiet = run(InvarianceOptions(engine, **rest, **common), pool=pool)
    first = hit.first_break(hit.schedules[1])
    expected, exp_step = fault.origin(None), 0
    origin_ok = first is not None and (first.point, first.step) == (expected, exp_step)
    stray = [f"{s} at {r.where()}" for s in quiet.schedules[1:] if (r := quiet.first_break(s))]
    notes = [f"{exercised}: {'first differs at ' + first.where() if first else 'bitwise identical'}",
             f"{others}: " + ("; ".join(stray) if stray else "bitwise identical"),
             "diff passes (float noise)" if diff_passed else "diff FAILS: the fault is more than float noise"]
    return dict(detected=first is not None, origin="-" if first is None else f"{first.point} @ step {first.step}",
                expected_origin=f"{expected} @ step {exp_step}", origin_ok=origin_ok,
                ok=origin_ok and not stray and diff_passed, by="invariance" if first else "-",
                excess=None if first is None else first.max_ulps, note="; ".join(notes),
                origin_point=None if first is None else first.point, origin_step=None if first is None else first.step,
                expected_point=expected, expected_step=exp_step)
