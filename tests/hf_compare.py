"""Comparing impl with Hugging Face in impl's tests: logits (``hf_logits``, ``max_diff``, ``check_logits``), greedy
continuations (``hf_greedy``) and edited copies of a checkpoint (``edit_config``, ``edit_tensors``)."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def max_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all()
    return (got.double() - ref.double()).abs().max().item()


def check_logits(llm, hf, ids: list[int], atol: float, what: str) -> float:
    """impl's logits of ``ids`` within ``atol`` of HF's, and the same argmax wherever HF's top-2 gap exceeds
    ``atol``; returns the max |diff|."""
    ref = hf_logits(hf, ids)
    got = llm.logits(ids)
    diff = max_diff(got, ref)
    assert diff <= atol, f"{what} length {len(ids)}: max |diff| {diff:.3g} > {atol}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > atol
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    return diff


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation (never stopping at EOS) and, per new token, its top-2 logit gap."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def edit_config(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` with ``edit(raw config dict)`` applied."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def edit_tensors(d, edit):
    """Checkpoint directory ``d`` with ``edit(tensors)`` applied to its safetensors file in place (``edit``
    changes the dict, or returns the dict to write instead)."""
    tensors = load_file(str(d / "model.safetensors"))
    out = edit(tensors)
    save_file(tensors if out is None else out, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d
