"""``DiffOptions``: every option of one ``tpcheck diff`` run, in one typed object that the command line and the
Python API both build and that the pipeline takes whole (nano-vllm's one ``Config``).

Each field declares its command-line flag beside its type and default, so the three views of a run cannot drift
apart: ``add_arguments`` builds the ``diff`` subcommand's flags from the fields, ``from_args`` reads parsed flags
back into the object, and ``to_argv`` writes the object as the flags that repeat it (the repro command recorded
in a result's ``meta.command``). ``tests/test_tpcheck/test_options.py`` round-trips every field through
``to_argv`` and the parser."""
from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from tpcheck.inputs.arg_types import device_name, int_list, int_ranges, name_list, regex
from tpcheck.judge.coverage import DEFAULT_REQUIRE

DTYPES = ["float32", "bfloat16", "float16"]


def _opt(default, flag: str, help: str, group: str, **argparse_kw):
    """A field with its flag: ``argparse_kw`` are ``add_argument``'s keywords (type, choices, metavar, action)."""
    return field(default=default, metadata={"flag": flag, "help": help, "group": group, **argparse_kw})


@dataclass(frozen=True)
class DiffOptions:
    """One diff run: the inputs, the engine, the steps, what is compared, the golden, the dump, the faults and
    the tolerances file. Defaults are the Python API's (``tpcheck.diff``); the command line sets ``tp`` 2."""

    # Field order is the flag order of ``to_argv`` (the repro command); each field's group says what it is
    # about: inputs, engine, run, selection, golden, dump, faults (impl only), tolerances.
    model: str | None = _opt(None, "--model", "a Hugging Face checkpoint directory (Qwen2 / Qwen2.5, Llama 2 / 3, "
                             "Mistral or Qwen3)", "inputs", type=Path)
    preset: str = _opt("small", "--preset", "synthetic checkpoint used when --model is not given", "inputs")
    tp: int = _opt(1, "--tp", "tensor-parallel size", "engine", type=int)
    dtype: str = _opt("float32", "--dtype", "the engine's and the noise floor's dtype", "engine", choices=DTYPES)
    prompts: tuple[tuple[int, ...], ...] | None = _opt(None, "--prompt-ids", "a prompt as token ids (repeatable)",
                                                        "inputs", type=int_list, action="append")
    ep: int = _opt(1, "--ep", "expert-parallel size of a mixture-of-experts model (with --tp: tp %% ep == 0; the "
                   "tp ranks form ep groups, each holding E/ep experts split tp/ep ways)", "engine", type=int)
    pp: int = _opt(1, "--pp", "pipeline stages (--engine impl, vllm): pp x tp ranks, each stage a TP group of --tp ranks "
                   "holding a contiguous run of layers (vLLM's split unless --pp-partition)", "engine", type=int)
    pp_partition: str | None = _opt(None, "--pp-partition", "layers per pipeline stage, e.g. 3,3,2 (as many as --pp, "
                                    "summing to the model's layers)", "engine", metavar="LIST")
    decode_steps: int = _opt(0, "--decode-steps", "one-token steps after the prefill", "run", type=int)
    block_size: int = _opt(16, "--block-size", "impl's KV-cache block size (other engines keep their own)", "engine", type=int)
    isolate: bool | None = _opt(None, "--isolate", "the local pass: each layer of the engine and of the noise "
                                "floor's references fed the golden input of that layer, so each layer's own error "
                                "is judged against a floor that does not grow with depth (default: on where the "
                                "engine can be teacher-forced; --no-isolate: the propagated pass alone, about 0.6x "
                                "the time)", "run", action=argparse.BooleanOptionalAction)
    local_rows: int = _opt(32, "--local-rows", "the local pass teacher-forces the last N positions of each prompt's "
                           "prefill (and every decode step); the keys and values of earlier positions are the "
                           "golden's, written into the engine's and the references' caches (0: every position; "
                           "engines that cannot take a cache prefix run every position; tpcheck.pipeline.local_rows)",
                           "run", type=int, metavar="N")
    rounding: str | None = _opt(None, "--rounding", "how the engine rounds its float32 results to the dtype, "
                                "overriding what it declares (tpcheck.capture.rounding: vLLM in bfloat16 on a CPU "
                                "without AVX512-BF16 declares truncate, whose shrink the local pass's gain rule then "
                                "allows; nearest judges it as rounding to nearest)", "run",
                                choices=["nearest", "truncate"])
    exact_ops: bool = _opt(False, "--exact-ops", "also fail any RMSNorm or residual add whose output is not "
                           "bit-identical to HF's module applied to the engine's own input (catches arithmetic that "
                           "departs from HF's yet is as accurate, e.g. rmsnorm_weight_before_cast; see "
                           "tpcheck.measure.exact_ops)", "run")
    inject: tuple[str, ...] = _opt((), "--inject", "faults to inject into impl (tpcheck faults list)", "faults",
                                   type=name_list)
    inject_layer: int | None = _opt(None, "--inject-layer", "only this decoder layer gets the faults", "faults",
                                    type=int)
    engine: str = _opt("impl", "--engine", "the engine under test (tpcheck.engines.registry)", "engine")
    device: str = _opt("auto", "--device", "where the engine runs: auto (CUDA when there is a GPU), cpu, cuda (impl: "
                       "one rank per GPU; ranks past the GPU count share them, over gloo) or cuda:K; a GPU asked for "
                       "and absent is an error (tpcheck.inputs.devices)", "engine", type=device_name, metavar="DEVICE")
    seq_len: int = _opt(32, "--seq-len", "random prompts: tokens each", "inputs", type=int)
    batch: int = _opt(2, "--batch", "random prompts: how many", "inputs", type=int)
    seed: int = _opt(0, "--seed", "random prompts: seed", "inputs", type=int)
    points: str | None = _opt(None, "--points", "compare only the points this regex fullmatches, e.g. "
                              "'layers\\.\\d+\\.(attn\\.out|out)|logits' (the origin is the first failing selected "
                              "point)", "selection", type=regex, metavar="REGEX")
    layers: tuple[int, ...] | None = _opt(None, "--layers", "compare only these decoder layers' points, e.g. "
                                          "0,3,10-12 (with --points: both apply)", "selection", type=int_ranges,
                                          metavar="LIST")
    require_points: str = _opt(DEFAULT_REQUIRE, "--require-points", "canonical points the engine must report, "
                               "else exit 3 (default: %(default)s)", "selection", type=regex, metavar="REGEX")
    fail_fast: bool = _opt(False, "--fail-fast", "stop after the first step with a failing point", "selection")
    golden: str | None = _opt(None, "--golden", "replay a golden saved by --save-golden (same checkpoint and "
                              "prompts) instead of computing it", "golden", type=Path, metavar="DIR")
    save_golden: str | None = _opt(None, "--save-golden", "save the float64 golden's points (safetensors) for "
                                   "--golden to reuse", "golden", type=Path, metavar="DIR")
    streamed: bool = _opt(False, "--golden-streamed", "read the HF references' weights from the checkpoint as the "
                          "forward needs them, one matrix at a time (for checkpoints larger than memory; same "
                          "results, slower; tpcheck.reference.streamed)", "golden")
    golden_device: str | None = _opt(None, "--golden-device", "where the float64 golden and the noise floor's "
                                     "references run and the statistics are computed (default: the engine's "
                                     "--device; only numbers come back to the host)", "golden", type=device_name,
                                     metavar="DEVICE")
    dump: str | None = _opt(None, "--dump", "also write every rank's points per step to DIR (tpcheck compare DIR "
                            "judges it offline)", "dump", type=Path, metavar="DIR")
    dump_points: str | None = _opt(None, "--dump-points", "with --dump: only these points", "dump", type=regex,
                                   metavar="REGEX")
    dump_budget_mb: float | None = _opt(None, "--dump-budget-mb", "with --dump: refuse a step that would take the "
                                        "dump past this size", "dump", type=float, metavar="MB")
    tolerances: str | None = _opt(None, "--tolerances", "gate tolerances (default: [tool.tpcheck] in "
                                  "./pyproject.toml, else the built-in ones)", "tolerances", type=Path,
                                  metavar="FILE.toml")

    def __post_init__(self):
        # lists from argparse or a caller become tuples (the object is frozen and hashable); paths become strings
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Path):
                object.__setattr__(self, f.name, str(v))
            elif isinstance(v, list):
                object.__setattr__(self, f.name, tuple(tuple(x) if isinstance(x, list) else x for x in v))
        if self.prompts is not None:
            object.__setattr__(self, "prompts", tuple(tuple(p) for p in self.prompts))

    @classmethod
    def of(cls, **kwargs) -> "DiffOptions":
        """``DiffOptions(**kwargs)``, with an unknown keyword named (a typo must not be silently dropped)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown diff option(s) {unknown}; the options are {sorted(known)}")
        return cls(**kwargs)

    def validate(self, cfg) -> None:
        """Refuse (ValueError naming the flag: exit 2) a number this model cannot run, before any engine starts:
        counts and sizes >= 1, ``--layers`` / ``--inject-layer`` inside the model's layers, a finite positive dump
        budget, random prompts that fit the model's positions."""
        for name, flag in (("block_size", "--block-size"), ("batch", "--batch"), ("seq_len", "--seq-len")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.block_size > cfg.max_position:
            raise ValueError(f"--block-size {self.block_size} is larger than max_position_embeddings={cfg.max_position}")
        if self.decode_steps < 0:
            raise ValueError(f"--decode-steps must be >= 0, got {self.decode_steps}")
        if isinstance(self.local_rows, bool) or not isinstance(self.local_rows, int) or self.local_rows < 0:
            raise ValueError(f"--local-rows must be an integer >= 0 (0: every position), got {self.local_rows!r}")
        if self.prompts is None and (self.batch > 4096 or self.seq_len + self.decode_steps > cfg.max_position):
            raise ValueError(f"--batch {self.batch} x --seq-len {self.seq_len} (+ {self.decode_steps} decode steps): "
                             f"at most 4096 prompts of max_position_embeddings={cfg.max_position} tokens")
        L = cfg.num_layers
        beyond = sorted(i for i in (self.layers or ()) if not 0 <= i < L)
        if beyond:
            raise ValueError(f"--layers {beyond[0]} is beyond this {L}-layer model (layers 0-{L - 1})")
        if self.inject_layer is not None and not 0 <= self.inject_layer < L:
            raise ValueError(f"--inject-layer {self.inject_layer} is beyond this {L}-layer model (layers 0-{L - 1})")
        self._validate_quantized(cfg)
        b = self.dump_budget_mb
        if b is not None and not (isinstance(b, (int, float)) and math.isfinite(b) and b > 0):
            raise ValueError(f"--dump-budget-mb must be a finite number of MiB > 0, got {b!r}")

    def _validate_quantized(self, cfg) -> None:
        """A quantized checkpoint (``impl.quant``) is judged in bfloat16 / float16 on impl or vLLM, from memory."""
        quant = getattr(cfg, "quant", None)
        if quant is None:
            return
        # W4A16 (GPTQ) quantizes no activation: no rounding boundary to land near, and its dequantized weights are
        # exact in float32 (a float16 scale times a small integer), so float32 is judged as a float model is
        # an FP8 KV cache rounds keys and values: the same near ties as a quantized activation
        rounds = getattr(quant, "quantizes_activations", True) or getattr(quant, "kv_cache", None) is not None
        if self.dtype == "float32" and rounds:
            raise ValueError(f"--dtype float32 on a quantized checkpoint ({quant.name}): in float32 an activation "
                             "(or a key / value the FP8 cache rounds) "
                             "within float noise of a rounding boundary lands one quantization step apart in the "
                             "engine and the golden (a near tie) and tpcheck does not follow those yet; run "
                             "--dtype bfloat16 or float16")
        if self.engine == "hf-tp":
            raise ValueError(f"--engine hf-tp on a quantized checkpoint ({quant.name}): transformers' TP runs "
                             "compressed-tensors / GPTQ through their own packages; check impl or vllm")
        if self.streamed:
            raise ValueError("--golden-streamed on a quantized checkpoint: the streamed golden reads float weights; "
                             "a quantized golden is built in memory")

    def replace(self, **changes) -> "DiffOptions":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_argv(self) -> list[str]:
        """The ``tpcheck diff`` flags that repeat this run: ``tp`` and ``dtype`` always, every other field where
        it differs from its default, in field order."""
        argv = ["diff", "--layer-by-layer"]
        for f in fields(self):
            v, flag = getattr(self, f.name), f.metadata["flag"]
            if f.name == "preset" and self.model is not None:
                continue  # a checkpoint directory names the model; the preset is not used
            if f.name not in ("tp", "dtype", "preset") and v == f.default:
                continue
            if f.metadata.get("action") is argparse.BooleanOptionalAction:
                argv.append(flag if v else "--no-" + flag[2:])
            elif f.metadata.get("type") is None and isinstance(v, bool):
                argv.append(flag)
            elif f.name == "prompts":
                for p in v:
                    argv += [flag, ",".join(map(str, p))]
            elif isinstance(v, tuple):
                argv += [flag, ",".join(map(str, v))]
            else:
                argv += [flag, str(v)]
        return argv

    def command(self) -> str:
        """``to_argv`` as one shell-quoted command line."""
        return shlex.join(["tpcheck", *self.to_argv()])

    def describe(self, tolerances: str | None = None) -> str:
        """What this run does, one line per stage: the engine and model, the golden's source, the dump, the
        selection, the tolerances (``tolerances``: where the loaded ones came from, e.g. ``Tolerances.source``).
        Printed at the top of every ``tpcheck diff``, so that a log says what ran."""
        model = self.model or f"synthetic preset {self.preset}"
        prompts = (f"{len(self.prompts)} prompt(s) given" if self.prompts
                   else f"{self.batch} random prompt(s) of {self.seq_len} tokens (seed {self.seed})")
        extra = [w for w, on in (("isolate", self.isolate), ("exact-ops", self.exact_ops)) if on]
        if self.isolate is False:
            extra.append("no local pass (--no-isolate)")
        if self.local_rows != _default("local_rows"):
            extra.append("local pass on every row (--local-rows 0)" if not self.local_rows else
                         f"local pass on the last {self.local_rows} rows (--local-rows)")
        if self.rounding:
            extra.append(f"rounding declared {self.rounding} (--rounding)")
        if self.inject:
            extra.append("inject " + ",".join(self.inject)
                         + (f" (layer {self.inject_layer})" if self.inject_layer is not None else ""))
        if self.golden:
            golden = f"replayed from {self.golden}"
        elif self.streamed:
            golden = "HF float64, computed live, weights streamed from the checkpoint"
        else:
            golden = "HF float64, computed live in memory"
        if not self.golden:
            golden += f" on device {self.golden_device or self.device}"
        if self.save_golden:
            golden += f"; saved to {self.save_golden}"
        dump = "none" if not self.dump else self.dump + "".join(
            [f" (points {self.dump_points})" if self.dump_points else "",
             f" (budget {self.dump_budget_mb:g} MB)" if self.dump_budget_mb is not None else ""])
        sel = [f"points {self.points}" if self.points else "", "layers " + ",".join(map(str, self.layers))
               if self.layers else ""]
        select = "; ".join(s for s in sel if s) or "every point"
        select += f"; required {self.require_points}" + ("; stop at the first failing step" if self.fail_fast else "")
        return "\n".join([
            f"engine:     {self.engine} tp={self.tp} {self.dtype} "
            f"({f'block size {self.block_size}' if self.engine == 'impl' else 'its own KV cache layout'}) on {model}, "
            f"device {self.device}",
            f"run:        {prompts}, {self.decode_steps} decode step(s)" + "".join(", " + x for x in extra),
            f"golden:     {golden}",
            f"dump:       {dump}",
            f"selection:  {select}",
            f"tolerances: {tolerances or self.tolerances or 'built-in (or [tool.tpcheck] in ./pyproject.toml)'}"])


def add_arguments(parser: argparse.ArgumentParser, choices: dict[str, list[str]] | None = None,
                  defaults: dict | None = None) -> argparse._MutuallyExclusiveGroup:
    """The ``diff`` subcommand's flags, one per ``DiffOptions`` field (returns the group of the prompt flags, for
    a front end's own way to give prompts). ``choices``: a field's allowed values
    known only at parse time (presets, engines); ``defaults``: the command line's own defaults (``tp``: 2)."""
    choices, defaults = choices or {}, defaults or {}
    src = parser.add_mutually_exclusive_group()
    prompt = parser.add_mutually_exclusive_group()
    for f in fields(DiffOptions):
        meta = dict(f.metadata)
        flag, help_text = meta.pop("flag"), meta.pop("help")
        meta.pop("group")
        default = defaults.get(f.name, f.default)
        default = [] if f.name == "inject" else (None if default in ((),) else default)
        kw = {"dest": f.name, "help": help_text, "default": default, **meta}
        if f.name in choices:
            kw["choices"] = choices[f.name]
        if meta.get("type") is None and "choices" not in kw and isinstance(f.default, bool):
            kw = {"dest": f.name, "help": help_text, "action": "store_true"}
        target = src if f.name in ("model", "preset") else prompt if f.name == "prompts" else parser
        target.add_argument(flag, **kw)
    return prompt


def from_args(args: argparse.Namespace, **overrides) -> DiffOptions:
    """The ``DiffOptions`` of parsed ``diff`` flags (``overrides``: fields the front end resolved itself, e.g.
    prompts tokenized from ``--prompt`` text)."""
    values = {f.name: getattr(args, f.name) for f in fields(DiffOptions) if hasattr(args, f.name)}
    values.update(overrides)
    values = {k: v for k, v in values.items() if not (v is None and _default(k) is not None)}
    return DiffOptions(**values)


def _default(name: str):
    f = next(f for f in fields(DiffOptions) if f.name == name)
    return None if f.default is MISSING else f.default
