"""Saved goldens: ``tpcheck diff --save-golden DIR`` keeps the float64 golden's points of a run, ``--golden DIR``
replays them instead of recomputing them, so a large model's golden is computed once and every engine change
is checked against it.

Layout: ``DIR/step{s}.safetensors`` (every golden point of step s, float64, ``[rows, features]``) and
``DIR/golden.json``: ``{"format", "model", "fingerprint", "prompts", "decode_steps", "tokens", "starts",
"with_kv", "num_layers"}``. ``fingerprint`` identifies the checkpoint: ``config.json`` and, per weight file,
its name, size and 16 sampled 64 KiB blocks (not a hash of every byte: a 70B checkpoint would take minutes to
read; weights changed in place at the same size and outside the samples go unseen, so keep one directory per
checkpoint). A replay refuses, naming the field, a golden of another checkpoint, other prompts or fewer
decode steps than the run needs. Safetensors and JSON only: nothing is unpickled."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = 1
_SAMPLES, _BLOCK = 16, 64 * 1024


class GoldenError(ValueError):
    """A saved golden that is unreadable or does not belong to this run (names the file and the field)."""


def fingerprint(model_dir: str | Path) -> str:
    """A sampled content fingerprint of a checkpoint directory (see the module docstring)."""
    root = Path(model_dir)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for i in range(_SAMPLES):
                fh.seek(max(0, (size - _BLOCK) * i // max(1, _SAMPLES - 1)))
                h.update(fh.read(_BLOCK))
    return h.hexdigest()


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
                     "with_kv": with_kv, "num_layers": num_layers}

    def write(self, step: int, tokens: list[list[int]], starts: list[int], points: dict[str, torch.Tensor]) -> None:
        if step < len(self.meta["tokens"]):  # the isolated pass recomputes the same golden: kept once
            return
        save_file({n: t.contiguous() for n, t in points.items()}, str(self.root / f"step{step}.safetensors"))
        self.meta["tokens"].append([list(t) for t in tokens])
        self.meta["starts"].append(list(starts))
        (self.root / "golden.json").write_text(json.dumps(self.meta))  # after each step: a partial run is usable


class SavedGolden:
    """A saved golden in place of the golden capture (``HFCapture.step``'s signature; no model, no cache):
    step s returns what was saved for it, after checking the tokens are the ones it was computed on."""

    model = None

    def __init__(self, root: str | Path, model_dir: str, prompts: list[list[int]], decode_steps: int,
                 with_kv: bool):
        self.root = Path(root)
        path = self.root / "golden.json"
        try:
            self.meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GoldenError(f"--golden {self.root}: no readable golden.json ({e})") from None
        m = self.meta
        if m.get("format", 0) > FORMAT:
            raise GoldenError(f"{path}: golden format {m.get('format')} is newer than this tpcheck reads ({FORMAT})")
        if m.get("fingerprint") != fingerprint(model_dir):
            raise GoldenError(f"{path}: saved for checkpoint {m.get('model')!r}, whose fingerprint differs from "
                              f"{model_dir!r} (another checkpoint, or its weights changed)")
        saved = m.get("prompts") or []
        if saved != prompts:
            i = next((i for i, (a, b) in enumerate(zip(saved, prompts)) if a != b), min(len(saved), len(prompts)))
            raise GoldenError(f"{path}: saved for other prompts ({len(saved)} saved, {len(prompts)} in this run; "
                              f"prompt {i} differs): rerun with the saved prompts (golden.json 'prompts')")
        if len(m.get("tokens", [])) < decode_steps + 1:
            raise GoldenError(f"{path}: holds {len(m.get('tokens', []))} step(s), this run needs {decode_steps + 1} "
                              f"(prefill + {decode_steps} decode)")
        if with_kv and not m.get("with_kv"):
            raise GoldenError(f"{path}: saved without the KV-cache points (a run with no decode steps); "
                              "this run decodes: save the golden of a decoding run")

    def step(self, tokens, caches, starts, teacher=None, with_kv=False, reductions=None) -> dict:
        if teacher is not None or reductions is not None:
            raise GoldenError("a saved golden replays the golden run only (no teacher, no TP emulation)")
        steps = self.meta["starts"]
        s = next((i for i, st in enumerate(steps) if st == list(starts)), None)
        if s is None or self.meta["tokens"][s] != [list(t) for t in tokens]:
            raise GoldenError(f"{self.root}: no saved step consumed tokens {tokens} at positions {starts}")
        path = self.root / f"step{s}.safetensors"
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise GoldenError(f"{path}: not a readable safetensors file ({e})") from None
