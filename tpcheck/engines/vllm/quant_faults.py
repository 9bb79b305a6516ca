"""Quantization faults seeded inside one vLLM rank (``VLLM_FAULTS``'s ``"param"`` kind): a live scale of a
quantized linear layer is changed in place after vLLM's ``process_weights_after_loading``, on one tensor-parallel
rank, and put back at ``tpcheck_unfault``. Each is a loader bug of a public report class (README "Quantized
checkpoints"): a scale slice from the wrong rank, a misaligned row-parallel scale, a fused scale in the wrong slot.

What they rely on in vLLM 0.32 (``vllm/model_executor/layers/quantization/compressed_tensors/schemes``,
``vllm/model_executor/kernels/linear/scaled_mm``):

* compressed-tensors INT8 W8A8 (``CompressedTensorsW8A8Int8`` -> ``CPUInt8ScaledMMLinearKernel``, the oneDNN path
  on a CPU without AMX) and FP8 W8A8 per channel (``CompressedTensorsW8A8Fp8`` -> a torch ``_scaled_mm`` kernel)
  leave ``layer.weight_scale`` as a float32 ``[N, 1]`` parameter, one row per output channel of the rank's shard,
  the fused partitions in order (``layer.logical_widths``: q, k, v or gate, up); a per-tensor INT8 scale of a fused
  layer is expanded to those channels (``convert_to_channelwise``). The torch kernels read it at every call; the
  oneDNN handler (``create_onednn_scaled_mm``) keeps a pointer to its storage, so it is changed in place
  (``copy_``), never replaced;
* a row-parallel layer (``o_proj``, ``down_proj``) holds the whole channel scale (its output is not split);
* ``layer.prefix`` is the module's name in the checkpoint (``model.layers.0.self_attn.qkv_proj``), and the
  worker's ``model_config.model`` the checkpoint directory (rank 0's rows are read from its safetensors).

Each fault function takes ``(module, worker)``, changes the scale and returns the function that undoes it."""
from __future__ import annotations

import os

import torch
from safetensors import safe_open


def _channel_scale(mod, what: str) -> torch.Tensor:
    """The layer's live per-channel weight scale ``[N, 1]`` (float32), or a ValueError naming the layer."""
    s = getattr(mod, "weight_scale", None)
    n = sum(getattr(mod, "logical_widths", None) or [0])
    if s is None or s.dtype != torch.float32 or s.dim() != 2 or s.shape[1] != 1 or (n and s.shape[0] != n):
        shape = None if s is None else (tuple(s.shape), s.dtype)
        raise ValueError(f"tpcheck: vLLM fault {what}: {getattr(mod, 'prefix', mod)} has no per-channel weight_scale "
                         f"[N, 1] float32 (got {shape}): not an INT8 / FP8 W8A8 layer vLLM's CPU kernels scale per "
                         "channel")
    return s


def _replace(scale: torch.Tensor, new: torch.Tensor):
    """Write ``new`` into ``scale``'s storage (kernels may hold a pointer to it); the undo writes the old back."""
    old = scale.detach().clone()
    with torch.no_grad():
        scale.copy_(new)

    def undo() -> None:
        with torch.no_grad():
            scale.copy_(old)
    return undo


def _slots(mod) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the fused partitions' rows in the rank's shard."""
    out, a = [], 0
    for w in mod.logical_widths:
        out.append((a, a + w))
        a += w
    return out


def qkv_scale_rank0_rows(mod, worker):
    """Class A / F: the rank's q, k and v channel scales are rank 0's rows (``[0, w)`` of each projection's
    ``weight_scale`` in the checkpoint, ``w`` the rank's width of it), as a loader that ignores ``tp_rank`` for
    scales while it shards the weights. Shows at ``attn.q``. Per-channel scales only (per tensor, every rank's
    scale is the same number)."""
    scale = _channel_scale(mod, "qkv-scale-rank0-rows")
    if mod.tp_rank == 0:
        raise ValueError("tpcheck: vLLM fault qkv-scale-rank0-rows on rank 0 changes nothing (its own rows): "
                         "seed it on rank 1 or later")
    base = mod.prefix.rsplit(".", 1)[0]
    names = [f"{base}.{p}_proj.weight_scale" for p in ("q", "k", "v")]
    ckpt = worker.model_runner.model_config.model
    found = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt, f), framework="pt") as st:
                found.update({n: st.get_tensor(n) for n in names if n in st.keys()})
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"tpcheck: vLLM fault qkv-scale-rank0-rows: the checkpoint {ckpt} lacks {missing}")
    rows = []
    for n, w in zip(names, mod.logical_widths):
        t = found[n].reshape(-1, 1).to(torch.float32)
        if t.shape[0] == 1:
            raise ValueError(f"tpcheck: vLLM fault qkv-scale-rank0-rows: {n} is per tensor: rank 0's rows are "
                             "every rank's")
        rows.append(t[:w])
    return _replace(scale, torch.cat(rows))


def o_proj_scale_rolled(mod, worker):
    """Class A: a row-parallel layer's channel scale misaligned on the rank: rolled by ``N / tp`` rows, as a
    loader that offsets the (unsplit) output scale by the rank's input offset. Shows at ``attn.out``."""
    scale = _channel_scale(mod, "o-proj-scale-rolled")
    tp = mod.tp_size
    return _replace(scale, torch.roll(scale.detach(), scale.shape[0] // max(tp, 2), dims=0))


def qkv_scale_k_v_swapped(mod, worker):
    """Class B: the fused qkv layer's k and v slots' scales swapped (per tensor: the two numbers; per channel:
    the rows). Shows at ``attn.k``."""
    scale = _channel_scale(mod, "qkv-scale-k-v-swapped")
    (_, _), (k0, k1), (v0, v1) = _slots(mod)
    new = scale.detach().clone()
    new[k0:k1], new[v0:v1] = scale[v0:v1], scale[k0:k1]
    return _replace(scale, new)


def gate_up_scale_slot0(mod, worker):
    """Class B: the fused gate_up layer's up slot takes slot 0's (gate's) scales, as a loader that writes every
    partition's scale into slot 0's place and reads slot 0 for all. Shows at ``mlp.up``."""
    scale = _channel_scale(mod, "gate-up-scale-slot0")
    (g0, g1), (u0, u1) = _slots(mod)
    if g1 - g0 != u1 - u0:
        raise ValueError(f"tpcheck: vLLM fault gate-up-scale-slot0: {mod.prefix}'s slots differ in width "
                         f"{mod.logical_widths}")
    new = scale.detach().clone()
    new[u0:u1] = scale[g0:g1]
    return _replace(scale, new)


# name -> (submodule of decoder layer, "param", the fault): merged into vllm.worker.VLLM_FAULTS
QUANT_FAULTS = {
    "qkv-scale-rank0-rows": ("self_attn.qkv_proj", "param", qkv_scale_rank0_rows),    # attn.q
    "o-proj-scale-rolled": ("self_attn.o_proj", "param", o_proj_scale_rolled),        # attn.out
    "qkv-scale-k-v-swapped": ("self_attn.qkv_proj", "param", qkv_scale_k_v_swapped),  # attn.k
    "gate-up-scale-slot0": ("mlp.gate_up_proj", "param", gate_up_scale_slot0),        # mlp.up
}
