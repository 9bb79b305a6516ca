"""How a hook copies a tensor off the engine (``tpcheck.capture.core``): as ``[rows, features]`` (``row_view``), a
CPU copy at once (``as_rows``), or on a CUDA device a copy queued on the stream that a step waits for once
(``queued_host_copy``)."""
from __future__ import annotations

import torch


def row_view(t: torch.Tensor, token_dims: int = 1) -> torch.Tensor:
    """``t`` detached as ``[rows, features]`` (a view where the layout allows): its first ``token_dims`` dims are
    the rows."""
    rows = 1
    for d in t.shape[:token_dims]:
        rows *= d
    return t.detach().reshape(rows, -1)


def as_rows(t: torch.Tensor, token_dims: int = 1) -> torch.Tensor:
    """A CPU copy of ``t`` as ``[rows, features]``: its first ``token_dims`` dims are the rows."""
    return row_view(t, token_dims).to("cpu", copy=True)


def queued_host_copy(t: torch.Tensor, devices: set) -> torch.Tensor:
    """A host copy of ``t`` that a CUDA tensor gets without waiting for it: the copy is queued on the current
    stream into pinned memory (``non_blocking``) and ``t``'s device is added to ``devices``; the copy holds ``t`` as
    it is at this point of the stream's order (a kernel queued later that writes ``t`` in place, vLLM's fused add +
    RMSNorm on the residual, runs after it), and is read only after each of ``devices`` is synchronized
    (``Capture.step_done``: every stream of the device, so a copy queued on a side stream is complete too). Why: a
    plain ``.cpu()`` waits for the GPU to finish everything queued before it, so a hook's copy made the host wait
    ~15 times a layer and the GPU idle while the host queued the next kernels; a decode step is bound by that
    queueing. The device, not the stream, is what is recorded: ``torch.cuda.current_stream()`` took 12-15 us a hook
    on an H200 (18,624 hooks over impl's 64-step dump of qwen2.5-0.5b: 0.23-0.28 s), ``get_device`` ~1 us. A CPU
    tensor (or another device's) is copied at once, as ``as_rows``."""
    if t.device.type != "cuda":
        return t.to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # torch records the stream's use of the pinned block: freed early, not reused
    devices.add(t.get_device())
    return host
