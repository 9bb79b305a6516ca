"""The fault registry: ``Fault`` (everything known about one TP bug, its patch included), the ``fault``
decorator that declares one beside its patch, and ``FAULTS`` / ``get_fault`` / ``applicable``.

Whether a fault can show is written once per fault as ``shows(cfg, plan, dtype)``, where ``plan`` is
``impl.shard_plan.shard_plan(cfg, tp)``: the sharding rules are impl's, never re-derived here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from impl.config import ConfigError, ModelConfig
from impl.shard_plan import ShardPlan, shard_plan

# ``shows(cfg, plan, dtype)``: whether the fault can show with this model, split and dtype
Shows = Callable[[ModelConfig, ShardPlan, str], bool]
# ``patch(runner, layer index, decoder layer)``: apply the fault inside one rank (both None when the fault
# is not per layer)
Patch = Callable[..., None]
# ``reach(cfg)``: the fault changes nothing until some sequence is longer than this many tokens (a sliding
# window); None: no such bound for this model
Reach = Callable[[ModelConfig], "int | None"]

ORIGIN_STEPS = ("prefill", "decode", "block_boundary")
CHECKS = ("diff", "memory", "invariance")


# (module-level functions, not lambdas, so that a Fault pickles: it may travel to a worker)


@dataclass(frozen=True)
class Needs:
    """What a fault's patch acts on in the checkpoint (``what``, e.g. a W8A8 scheme's weight scales) and the test
    of a config for it (``test(cfg)``, a module-level function). Without it the patch has nothing to act on: a rank
    stops on a missing parameter (exit 3), or other numbers change than the fault means; so ``tpcheck diff``
    refuses the run before any engine starts (exit 2, ``Fault.refused_because``) rather than announce it silent."""

    what: str
    test: Callable[[ModelConfig], bool]


def always(cfg: ModelConfig, plan: ShardPlan, dtype: str) -> bool:
    return True


def tp_gt_1(cfg: ModelConfig, plan: ShardPlan, dtype: str) -> bool:
    return plan.tp > 1


def block_boundary_step(prompt_lens, decode_steps: int, block_size: int) -> int | None:
    """The first decode step (1-based) that writes a token position ``p > 0`` with ``p % block_size == 0``
    (the first slot of a new KV block) for some prompt; None if none does. Decode step ``s`` of a prompt
    of ``n`` tokens writes position ``n + s - 1``."""
    for s in range(1, decode_steps + 1):
        if any((n + s - 1) % block_size == 0 for n in prompt_lens):
            return s
    return None


def _positions_written(prompt_lens, decode_steps: int) -> str:
    spans = sorted({(n, n + decode_steps - 1) for n in prompt_lens})
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans)


@dataclass(frozen=True)
class Fault:
    """A named TP bug and its patch. ``applies(cfg, tp, dtype)``: whether it can show in that configuration;
    ``silent_because(...)``: why a given run cannot fail on it; ``origin(layer)``: where a layer-by-layer
    diff must place its origin."""

    name: str
    description: str        # one line
    shows_when: str         # human text: "tp > 1", "always", ...
    expected_origin: str    # canonical point, a template with {layer} for per-layer faults
    # the catalogue number: the order of ``tpcheck faults list`` and of the matrix rows (a new fault takes
    # the next one)
    number: int = 0
    patch: Patch | None = field(default=None, repr=False, compare=False)
    shows: Shows = field(default=always, repr=False, compare=False)
    decode_only: bool = False
    # which check catches it: "diff" (the layer-by-layer numerics) or "memory" (per-rank memory figures;
    # the numerics are unchanged, so ``tpcheck diff`` passes and ``expected_origin`` is "memory") or "invariance"
    # (``tpcheck invariance``: a request's bits change with its batch, within float noise, so the diff passes)
    check: str = "diff"
    # an invariance fault: the ``tpcheck invariance`` schedule that exercises it ("batch": the probe batched)
    schedule: str = ""
    # the step of the expected origin: "prefill" (step 0), "decode" (the first decode step, 1) or
    # "block_boundary" (the first decode step whose position is a multiple of the KV block size)
    origin_step: str = "prefill"
    # as accurate as HF at the dtype: only ``tpcheck diff --exact-ops`` sees it
    needs_exact_ops: bool = False
    # shows only once a sequence (prompt + decode steps) is longer than ``longer_than(cfg)`` tokens
    longer_than: Reach | None = field(default=None, repr=False, compare=False)
    # acts on mixture-of-experts layers only: a dense layer of a MoE model (Qwen2-MoE's ``mlp_only_layers``)
    # cannot show it
    sparse_only: bool = False
    # pipeline stages the fault needs (``impl.pipeline``; 1: any run); a pipeline fault's ``expected_origin`` may
    # name ``{stage1}``, the first layer of stage 1 in the run's partition, or ``{boundary}``, the last of stage 0
    # (the layer whose ``handoff`` point is what crosses that boundary)
    pp: int = 1
    # the decoder layers that can show it (None: every layer): a RoPE-base fault cannot show on a Gemma 3 sliding
    # layer, whose own base is the default it would set
    in_layer: Callable[[ModelConfig, int], bool] | None = field(default=None, repr=False, compare=False)
    # what the patch acts on in the checkpoint (a quantization scheme's tensors); None: any checkpoint
    needs: Needs | None = field(default=None, repr=False, compare=False)

    def refused_because(self, cfg: ModelConfig) -> str | None:
        """Why this fault cannot be injected into a run of ``cfg`` at all (None: it can): the checkpoint lacks
        what its patch acts on (``needs``)."""
        if self.needs is None or self.needs.test(cfg):
            return None
        quant = getattr(cfg, "quant", None)
        has = "a float checkpoint (no quantization_config)" if quant is None else f"a {quant.name} checkpoint"
        return f"acts on {self.needs.what}, and --model is {has}"

    def shows_in_layer(self, cfg: ModelConfig, layer: int) -> bool:
        """Whether decoder ``layer`` of ``cfg`` can show this per-layer fault (a MoE fault: a sparse layer)."""
        if self.in_layer is not None and not self.in_layer(cfg, layer):
            return False
        return not self.sparse_only or (getattr(cfg, "moe", None) is not None and cfg.is_sparse(layer))

    @property
    def per_layer(self) -> bool:
        """Whether the fault acts on decoder layers (and ``apply``'s ``layer`` selects one)."""
        return "{layer}" in self.expected_origin

    def origin(self, layer: int | None = None, stage1: int | None = None) -> str:
        """The expected origin for a fault applied to ``layer`` (None: all layers, so the first, 0); ``stage1``:
        the first layer of pipeline stage 1 (a pipeline fault's origin needs it)."""
        if ("{stage1}" in self.expected_origin or "{boundary}" in self.expected_origin) and stage1 is None:
            raise ValueError(f"fault {self.name}: its origin is at the first layer of pipeline stage 1; give stage1")
        return self.expected_origin.format(layer=0 if layer is None else layer, stage1=stage1,
                                           boundary=None if stage1 is None else stage1 - 1)

    def applies(self, cfg: ModelConfig, tp: int, dtype: str = "float32") -> bool:
        """Whether the fault can show at all with this model, TP size and dtype (False where the TP size
        cannot split the model: ``cfg.check_tp``)."""
        try:
            plan = shard_plan(cfg, tp)
        except ConfigError:
            return False
        if cfg.num_layers < self.pp:  # too few layers for the stages it needs
            return False
        return bool(self.shows(cfg, plan, dtype))

    def expected_step(self, prompt_lens, decode_steps: int, block_size: int) -> int | None:
        """The step of the expected origin in a run of these prompt lengths, decode steps and KV block size
        (None: a block-boundary fault in a run that writes no block boundary)."""
        if self.origin_step == "prefill":
            return 0
        if self.origin_step == "decode":
            return 1
        return block_boundary_step(prompt_lens, decode_steps, block_size)

    def silent_because(self, cfg: ModelConfig, tp: int, dtype: str, decode_steps: int, exact_ops: bool, *,
                       prompt_lens=None, block_size: int = 16, layer: int | None = None, pp: int = 1) -> str | None:
        """Why a ``tpcheck diff`` of this configuration cannot fail on this fault (None: it should fail).
        ``prompt_lens`` (None: not known) and ``block_size`` describe the run's KV layout; ``layer`` the one
        decoder layer it is injected into (None: every layer); ``pp`` the run's pipeline stages."""
        if pp < self.pp:
            return f"acts between pipeline stages: shows only with --pp >= {self.pp}, and --pp is {pp}"
        if not self.applies(cfg, tp, dtype):
            return f"cannot show at tp {tp} in {dtype} with this model (shows: {self.shows_when})"
        if layer is not None and self.per_layer and not self.shows_in_layer(cfg, layer):
            return (f"acts on mixture-of-experts layers only, and layer {layer} of this model is dense"
                    if self.in_layer is None else f"cannot show in layer {layer} of this model ({self.shows_when})")
        if self.decode_only and decode_steps == 0:
            return "shows only while decoding, and --decode-steps is 0"
        if self.check == "memory":
            return "changes memory, not numbers (`tpcheck faults matrix` runs its memory check)"
        if self.check == "invariance":
            return (f"changes a request's bits only under the {self.schedule!r} schedule, within float noise "
                    "(`tpcheck invariance` finds it)")
        if self.needs_exact_ops and not exact_ops:
            return "is as accurate as HF at the dtype: only --exact-ops sees it"
        reach = None if self.longer_than is None else self.longer_than(cfg)
        if reach is not None and prompt_lens and max(prompt_lens) + decode_steps <= reach:
            return (f"shows only once a sequence is longer than {reach} tokens, and the longest here has "
                    f"{max(prompt_lens) + decode_steps} (prompt + decode steps)")
        if (self.origin_step == "block_boundary" and prompt_lens
                and block_boundary_step(prompt_lens, decode_steps, block_size) is None):
            return (f"shows only when a decode step writes the first slot of a KV block, and none does here "
                    f"(block size {block_size}; decode steps write positions "
                    f"{_positions_written(prompt_lens, decode_steps)})")
        return None


FAULTS: dict[str, Fault] = {}  # by catalogue number


def register(f: Fault) -> Fault:
    """Add ``f`` to ``FAULTS``, kept in catalogue-number order; names and numbers are unique."""
    if f.name in FAULTS:
        raise ValueError(f"duplicate fault name {f.name!r}")
    clash = next((g.name for g in FAULTS.values() if g.number == f.number), None)
    if clash:
        raise ValueError(f"faults {clash!r} and {f.name!r} share the number {f.number}")
    if f.check not in CHECKS or f.origin_step not in ORIGIN_STEPS or f.patch is None:
        raise ValueError(f"fault {f.name!r}: check {f.check!r}, origin_step {f.origin_step!r}, patch {f.patch!r}")
    ordered = sorted([*FAULTS.values(), f], key=lambda g: g.number)
    FAULTS.clear()
    FAULTS.update((g.name, g) for g in ordered)
    return f


def fault(number: int, name: str, description: str, *, shows_when: str, expected_origin: str, **options):
    """Declare a fault beside its patch::

        @fault(3, "rope_skipped", "RoPE not applied: ...", shows_when="always (any position > 0)",
               expected_origin="layers.{layer}.attn.q_rope")
        def rope_skipped(runner, i, layer): ...

    ``options``: the other ``Fault`` fields (``shows``, ``decode_only``, ``check``, ``origin_step``,
    ``needs_exact_ops``, ``longer_than``). The patch function itself is returned unchanged (so that it pickles
    by name)."""

    def declare(patch: Patch) -> Patch:
        register(Fault(name, description, shows_when, expected_origin, number=number, patch=patch, **options))
        return patch

    return declare


def fault_names() -> list[str]:
    return list(FAULTS)


def get_fault(name: str) -> Fault:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known faults: {', '.join(FAULTS)}")
    return FAULTS[name]


def applicable(cfg: ModelConfig, tp: int, dtype: str = "float32") -> list[str]:
    """Names of the faults that can show in this configuration."""
    return [n for n, f in FAULTS.items() if f.applies(cfg, tp, dtype)]
