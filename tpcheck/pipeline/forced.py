"""The local pass of a replayed dump (``tpcheck compare``): teacher forcing's dual.

A live engine's local pass feeds each of its decoder layers the golden's input of that layer. A dump cannot be
re-run, so the roles swap: the golden (float64) and both noise-floor references run each decoder layer ``i`` on the
engine's own recorded input of that layer, the unsharded ``layers.{i-1}.out`` of the same step at every row (the
residual stream layer ``i`` reads: for vLLM's fused add + RMSNorm, the next norm's updated residual,
``tpcheck.capture.maps.VLLM_MAP``), the final norm on ``layers.{L-1}.out``, and layer 0 on the engine's ``embed``
where the dump has it (a lookup equals the golden's rounded to the dtype; a scaled one, Gemma 3's, rounds its scale
to the dtype first, a systematic gain that is the embedding's error, judged at ``embed``, not layer 0's).
A request's attention history (its KV cache) comes from the same forced runs of its earlier steps, so engine
point minus forced golden is the layer's own error on the input it really had, and the references' rounding of
that layer on that input is the floor: the same local floor and origin rule as a live engine's local pass, whose
margin does not decay with depth.

What it needs: every layer's ``out`` at every row of every step (``lacking``; a dump without them is judged by the
propagated pass alone, with a note naming the missing points). A prefix-cache hit (a request whose first step
starts on positions another request computed) has its cached positions forced with the inputs recorded for the
request that ran them (``RecordedInputs``)."""
from __future__ import annotations

import torch

from tpcheck.measure.unshard import unshard


def layer_outputs(num_layers: int) -> list[str]:
    """The points the dual local pass reads: every decoder layer's ``out``."""
    return [f"layers.{i}.out" for i in range(num_layers)]


def engine_inputs(points: dict, num_layers: int) -> dict[int, torch.Tensor]:
    """``{i: [rows, hidden]}``: decoder layer ``i``'s recorded input (``layers.{i-1}.out``, unsharded) for
    ``i = 1..L`` (``L``: the final norm's), plus ``0`` (the engine's ``embed``) where the step reports it. A
    missing ``out`` is a ValueError naming it (``lacking`` keeps such a dump out of this pass)."""
    out: dict[int, torch.Tensor] = {}
    for i, name in [(0, "embed")] + [(i + 1, n) for i, n in enumerate(layer_outputs(num_layers))]:
        if name not in points:
            if i == 0:
                continue
            raise ValueError(f"{name}: the dump's step lacks it; the local pass forces layer {i} onto it")
        placement, per_rank = points[name]
        out[i] = next(u.tensor for u in unshard(name, placement, per_rank) if u.name == name)
    return out


def forced_step(engine, batch, with_kv: bool, num_layers: int, recorded: "RecordedInputs") -> tuple:
    """One step of a replayed dump's local pass: its recorded points, every layer's recorded input
    (``engine_inputs``: what the engine's own-input checks read), the same inputs, which the golden and the
    references are forced onto (layer 0 too, where the step has the engine's ``embed``), and, per request starting
    on a cached prefix, the inputs of those positions (``RecordedInputs.add``)."""
    points = engine.step(batch.tokens, None, with_kv)
    inputs = engine_inputs(points, num_layers)
    return points, inputs, inputs, recorded.add(batch, inputs)


Key = int | str  # a layer index (the layer inputs); a point's name (``tpcheck.pipeline.kv_history``'s keys, values)


class RecordedInputs:
    """Every request's recorded rows (of each key: a layer's input, or a point) at each position it ran, over the
    steps, so that a prefix-cache hit's cached positions are forced with the inputs the engine computed them from
    (and have the keys and values it wrote): those of another request that ran the same tokens at the same
    positions (or, for a parallel-sampling sibling, in the same step)."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.inputs: dict[str, dict[Key, torch.Tensor]] = {}

    def add(self, batch, teacher: dict[Key, torch.Tensor]) -> dict[str, dict[Key, torch.Tensor]]:
        """Record ``batch``'s rows of ``teacher`` per request (a request run again from an earlier position is cut
        back first); returns, per request that starts past the positions it ran, the recorded inputs of the
        positions it skips (``RequestLog.gaps``'s), taken from a request that ran them. None found: a ValueError
        naming the request."""
        spans, offset = [], 0
        for rid, toks, start in zip(batch.ids, batch.tokens, batch.starts):
            spans.append((rid, toks, start, {i: t[offset:offset + len(toks)] for i, t in teacher.items()}))
            offset += len(toks)
        gaps: dict[str, dict[Key, torch.Tensor]] = {}
        # requests that continue first: a sibling that skips positions may read them in this same step
        for rid, toks, start, rows in sorted(spans, key=lambda s: len(self.tokens.get(s[0], ())) < s[2]):
            have = self.tokens.get(rid, [])
            if start > len(have):
                prefix = batch.prompts.get(rid, [])[:start]
                donor = self._donor(rid, prefix)
                gaps[rid] = {i: t[len(have):start] for i, t in donor.items()}
                kept = {i: torch.cat([self.inputs[rid][i], t]) if have else t for i, t in gaps[rid].items()}
                self.inputs[rid], have = kept, prefix
            old = self.inputs.get(rid, {})
            self.inputs[rid] = {i: torch.cat([old[i][:start], t]) if start else t for i, t in rows.items()}
            self.tokens[rid] = have[:start] + list(toks)
        return gaps

    def _donor(self, rid: str, prefix: list[int]) -> dict[Key, torch.Tensor]:
        """The recorded inputs (positions ``0..len(prefix)-1``) of a request that ran ``prefix``."""
        for other, toks in self.tokens.items():
            if other != rid and len(prefix) and toks[:len(prefix)] == prefix:
                return {i: t[:len(prefix)] for i, t in self.inputs[other].items()}
        raise ValueError(f"request {rid!r} starts on {len(prefix)} cached positions that no request of the dump ran "
                         "before it: the local pass has no recorded input to force them with (--no-isolate judges "
                         "the dump by the propagated pass alone)")
