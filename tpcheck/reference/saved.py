"""Saved goldens: ``tpcheck diff --save-golden DIR`` keeps the float64 golden's points of a run, ``--golden DIR``
replays them instead of recomputing them, so a large model's golden is computed once and every engine change
is checked against it.

Layout: ``DIR/step{s}.safetensors`` (every golden point of step s, float64, ``[rows, features]``) and
``DIR/golden.json``: ``{"format", "model", "fingerprint", "prompts", "decode_steps", "tokens", "starts",
"with_kv", "num_layers", "tensors"}``. ``fingerprint`` identifies the checkpoint: ``config.json`` and, per weight file,
its name, size and 16 sampled 64 KiB blocks (not a hash of every byte: a 70B checkpoint would take minutes to
read; weights changed in place at the same size and outside the samples go unseen, so keep one directory per
checkpoint; ``tpcheck.inputs.files.fingerprint``). A replay refuses, naming the field, a golden of another checkpoint, other prompts or fewer
decode steps than the run needs. Safetensors and JSON only: nothing is unpickled.

Integrity (format 2): ``tensors[s]`` records per point of step s its dtype, shape and sha256; a replay checks
golden.json's every field (types, bounds: ``tpcheck.inputs.files.validate``) and every tensor it loads against its
record, and refuses (GoldenError, exit 2, naming the file and the point) a mismatch, a step without ``logits``
or a record without its tensor. A hash proves the file is what was written, not that what was written is right:
``check_reference`` also holds the replayed golden to the live HF-at-dtype reference, point by point (see
``reference_bound``), so a golden that is wrong but re-hashed cannot silently raise the noise floor."""
from __future__ import annotations

from pathlib import Path

import torch

from tpcheck.inputs.files.fingerprint import fingerprint  # noqa: F401  (a saved golden records it)
from tpcheck.inputs.files.step_store import load_step, save_step, write_json_atomic
from tpcheck.inputs.files.validate import MAX_LAYERS, field, int_in, read_json, token_lists, verify_tensor

FORMAT = 2
# a correct golden is HF in float64; HF at the run's dtype differs from it by rounding only. Measured worst
# relative error of any point (tiny, small, tiny-llama, tiny-qwen3; 2 x 32 tokens): float32 8.4e-7 (14 u),
# bfloat16 0.015 (3.8 u), float16 1.9e-3 (3.8 u). The bound is 2**12 u, the worst-case (not typical) rounding of
# one length-4096 dot product, capped at 0.25: 2.4e-4 in float32 (~290x the measured worst), 0.25 in
# bfloat16 / float16 (a quarter of the tensor's norm is far beyond rounding at any depth measured).
_BOUND_ULPS, _BOUND_CAP = 2**12, 0.25


class GoldenError(ValueError):
    """A saved golden that is unreadable or does not belong to this run (names the file and the field)."""


def reference_bound(dtype: torch.dtype) -> float:
    """The largest relative error HF at ``dtype`` may have against a correct float64 golden (see above)."""
    return min(_BOUND_CAP, _BOUND_ULPS * torch.finfo(dtype).eps / 2)


class GoldenWriter:
    """Writes the golden points of each step of one run (``--save-golden``) into a new or empty directory."""

    def __init__(self, root: str | Path, model_dir: str, prompts: list[list[int]], decode_steps: int,
                 with_kv: bool, num_layers: int):
        self.root = Path(root)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise GoldenError(f"--save-golden {self.root}: exists and is not an empty directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self.meta = {"format": FORMAT, "model": str(model_dir), "fingerprint": fingerprint(model_dir),
                     "prompts": prompts, "decode_steps": decode_steps, "tokens": [], "starts": [],
                     "with_kv": with_kv, "num_layers": num_layers, "tensors": []}

    def write(self, step: int, tokens: list[list[int]], starts: list[int], points: dict[str, torch.Tensor]) -> None:
        if step < len(self.meta["tokens"]):  # the isolated pass recomputes the same golden: kept once
            return
        records = save_step(self.root / f"step{step}.safetensors", {n: t.contiguous() for n, t in points.items()})
        self.meta["tokens"].append([list(t) for t in tokens])
        self.meta["starts"].append(list(starts))
        self.meta["tensors"].append(records)
        write_json_atomic(self.root / "golden.json", self.meta)  # after each step: a partial run is usable


class SavedGolden:
    """A saved golden in place of the golden capture (``HFCapture.step``'s signature; no model, no cache):
    step s returns what was saved for it, after checking the tokens are the ones it was computed on and every
    tensor against its record."""

    model = None

    def __init__(self, root: str | Path, model_dir: str, prompts: list[list[int]], decode_steps: int,
                 with_kv: bool):
        self.root = Path(root)
        path = self.root / "golden.json"
        self.meta = m = _read_meta(path)
        if m["fingerprint"] != fingerprint(model_dir):
            raise GoldenError(f"{path}: saved for checkpoint {m.get('model')!r}, whose fingerprint differs from "
                              f"{model_dir!r} (another checkpoint, or its weights changed)")
        saved = m["prompts"]
        if saved != prompts:
            i = next((i for i, (a, b) in enumerate(zip(saved, prompts)) if a != b), min(len(saved), len(prompts)))
            raise GoldenError(f"{path}: saved for other prompts ({len(saved)} saved, {len(prompts)} in this run; "
                              f"prompt {i} differs): rerun with the saved prompts (golden.json 'prompts')")
        if len(m["tokens"]) < decode_steps + 1:
            raise GoldenError(f"{path}: holds {len(m['tokens'])} step(s), this run needs {decode_steps + 1} "
                              f"(prefill + {decode_steps} decode)")
        if with_kv and not m["with_kv"]:
            raise GoldenError(f"{path}: saved without the KV-cache points (a run with no decode steps); "
                              "this run decodes: save the golden of a decoding run")

    def step(self, tokens, caches, starts, teacher=None, with_kv=False, reductions=None, routes=None) -> dict:
        if teacher is not None or reductions is not None:
            raise GoldenError("a saved golden replays the golden run only (no teacher, no TP emulation)")
        steps = self.meta["starts"]
        s = next((i for i, st in enumerate(steps) if st == list(starts)), None)
        if s is None or self.meta["tokens"][s] != [list(t) for t in tokens]:
            raise GoldenError(f"{self.root}: no saved step consumed tokens {tokens} at positions {starts}")
        path = self.root / f"step{s}.safetensors"
        points = load_step(path, GoldenError)
        records = self.meta["tensors"][s]
        extra = sorted(set(points) ^ set(records))
        if extra:
            raise GoldenError(f"{path}: {extra[0]!r} is in {'the file' if extra[0] in points else 'golden.json'} "
                              "only (tensors and their records must match)")
        for n, t in points.items():
            verify_tensor(t, records[n], f"{path}: {n}", GoldenError)
        if "logits" not in points:
            raise GoldenError(f"{path}: no 'logits' (every golden step has them)")
        for layer, want in (routes or {}).items():  # a recorded golden cannot follow another route
            got = points.get(f"layers.{layer}.moe.topk_ids")
            if got is not None and got.shape == want.shape and \
                    bool((got.long().sort(-1).values != want.long().sort(-1).values).any()):
                raise GoldenError(f"{path}: the engine routed a token of layer {layer} to other experts than the "
                                  "saved golden did (a near tie); a saved golden cannot follow it: run without --golden")
        return points

    def check_reference(self, name: str, ref: torch.Tensor, gold: torch.Tensor, dtype: torch.dtype) -> None:
        """Refuse a replayed golden point the live HF-at-dtype reference ``ref`` is far from: a wrong shape, or a
        relative error above ``reference_bound(dtype)`` (a correct golden is within rounding of it)."""
        where = f"{self.root}: {name}"
        if ref.shape != gold.shape:
            raise GoldenError(f"{where}: golden shape {list(gold.shape)}, HF computes {list(ref.shape)}")
        norm = float(gold.double().norm())
        err = float((ref.double() - gold.double()).norm()) / norm if norm else float(ref.double().norm())
        bound = reference_bound(dtype)
        if not err <= bound:
            raise GoldenError(f"{where}: HF at {str(dtype).removeprefix('torch.')} is {err:.3g} (relative) from "
                              f"the replayed golden, above the {bound:.3g} rounding can explain: the golden is "
                              "wrong (changed and re-hashed, or saved by a broken run); save it again")


def _read_meta(path: Path) -> dict:
    """golden.json, every field checked (types, bounds, one record per step)."""
    m = read_json(path, GoldenError, "golden.json")
    where = str(path)
    fmt = field(m, "format", "int", where, GoldenError)
    if fmt > FORMAT:
        raise GoldenError(f"{path}: golden format {fmt} is newer than this tpcheck reads ({FORMAT})")
    if fmt < FORMAT:
        raise GoldenError(f"{path}: golden format {fmt} records no tensor hashes; save the golden again")
    field(m, "fingerprint", "str", where, GoldenError)
    token_lists(field(m, "prompts", "list", where, GoldenError), None, f"{path}: prompts", GoldenError)
    for s, toks in enumerate(field(m, "tokens", "list", where, GoldenError)):
        token_lists(toks, None, f"{path}: tokens[{s}]", GoldenError)
    starts = field(m, "starts", "list", where, GoldenError)
    records = field(m, "tensors", "list", where, GoldenError)
    if not len(starts) == len(records) == len(m["tokens"]):
        raise GoldenError(f"{path}: {len(m['tokens'])} steps of tokens, {len(starts)} of starts, "
                          f"{len(records)} of tensor records")
    for s, st in enumerate(starts):
        if not isinstance(st, list) or len(st) != len(m["tokens"][s]):
            raise GoldenError(f"{path}: starts[{s}] must be one position per prompt")
        for x in st:
            int_in(x, 0, 2**40, f"{path}: starts[{s}]", GoldenError)
        if not isinstance(records[s], dict):
            raise GoldenError(f"{path}: tensors[{s}] must be an object of tensor records")
    field(m, "with_kv", "bool", where, GoldenError)
    int_in(field(m, "num_layers", "int", where, GoldenError), 1, MAX_LAYERS, f"{path}: num_layers", GoldenError)
    return m
