"""The references' HF models, kept per (checkpoint, dtype, streamed) in this process: a run's golden and noise-floor
model, built once and reused by every later run (the fault matrix, sweeps and the pytest plugin run many)."""
from __future__ import annotations

from tpcheck.reference.hf import HFCapture, load_hf_model
from tpcheck.reference.streamed import streamed_hf_capture

_HF: dict = {}


def hf_capture(model_dir: str, dtype: str, streamed: bool = False, device: str = "cpu") -> HFCapture:
    """HF model with capture hooks on ``device`` (a resolved one: ``tpcheck.inputs.devices``; its points are
    computed and left there), cached per (checkpoint, dtype, streamed, device) in this process (at most 4 kept).
    ``streamed``: weights read from the checkpoint as the forward needs them, one matrix resident at a time
    (``tpcheck.reference.streamed``: for checkpoints larger than memory; the same points bit for bit; the host
    only, a ``ValueError`` elsewhere)."""
    key = (str(model_dir), dtype, streamed, device)
    if key not in _HF:
        if streamed and device != "cpu":
            raise ValueError(f"--golden-streamed runs on the host, not on {device}")
        while len(_HF) >= 4:
            _HF.pop(next(iter(_HF)))
        if streamed:
            _HF[key] = streamed_hf_capture(model_dir, dtype)
        else:
            _HF[key] = HFCapture(load_hf_model(model_dir, dtype).to(device))
    return _HF[key]
