"""The impl side of the adapter, run inside each TP rank through ``LLM.call(capture_impl.step, ...)``.

The hooks are ``tpcheck.capture`` with ``IMPL_MAP`` (see ``tpcheck/capture/maps.py`` for which module gives
which point and placement; a fused output such as ``layers.0.attn.`` comes whole with its ``Fused``
placement and the harness splits it). This module adds what only a live engine offers: the teacher inputs
of ``--isolate`` and the KV cache read back from its paged blocks. Tensors are ``[rows, features]`` on CPU,
in the engine's dtype."""
from __future__ import annotations

import re

import torch

from impl.placements import Shard
from tpcheck.capture.copies import as_rows
from tpcheck.capture.core import install
from tpcheck.capture.stages import HandoffHooks
from tpcheck.capture.maps import IMPL_MAP
from tpcheck.capture.teacher import Teacher
from impl.distributed import get_tp_rank, get_tp_size
from tpcheck.capture.dump import DumpWriter
from impl.layers.attention import block_slots
from impl.quant_kv import dequantize_kv

_STATE = "_tpcheck"


def setup(runner, num_blocks: int | None, block_size: int, dump: dict | None = None,
          points: str | None = None, serving: bool = False) -> None:
    """Allocate a KV cache of the given layout (``num_blocks`` None: the engine's own cache serves, blocks of
    ``block_size``) and install the capture hooks (once per loaded model): the
    points of ``tpcheck.capture.IMPL_MAP`` (the same hooks an engine installs for dumps), plus the teacher
    pre-hooks that ``--isolate`` uses. ``dump``: ``tpcheck.capture.dump.DumpWriter`` keywords (``root``, ``dtype``,
    ``points``, ``budget_bytes``): this rank also writes every propagated step's points there itself.
    ``points``: a regex of the points to capture (``--points`` / ``--layers``): hooks only where they come from,
    and only the selected layers' KV cache read back. The hooks capture inside ``step`` only, or with ``serving``
    every forward until ``serving_end`` (impl's own scheduler dumping): a plain forward of the same engine after a
    diff or a dump copies nothing and keeps nothing (each one's every point was kept until the next diff: ~30 MiB
    a rank over 200 tokens of ``small``, and its time)."""
    if num_blocks is not None:
        runner.allocate_kv_cache(num_blocks, block_size)
    elif runner.block_size != block_size:
        raise ValueError(f"the engine's KV cache has blocks of {runner.block_size} tokens, not {block_size}")
    st = getattr(runner.model, _STATE, None)
    if st is None:
        m = runner.model.model  # impl's decoder layers take (positions, hidden states)
        st = {"capture": install(runner.model, IMPL_MAP, points=points), "points": points,
              "teacher": Teacher(m.layers, m.norm, like=runner, arg=1), "handoff": Handoffs(runner, points)}
        setattr(runner.model, _STATE, st)
    elif st["points"] != points:  # another selection: the hooks of this one
        st["capture"].remove()
        st["handoff"].remove()
        st["capture"], st["points"] = install(runner.model, IMPL_MAP, points=points), points
        st["handoff"] = Handoffs(runner, points)
    if st.get("writer") is not None:  # a serving dump not ended (its generate failed): its queued steps written
        st["writer"].close()
    st["writer"], st["step"] = None, 0
    st["capture"].clear()
    st["capture"].armed = st["handoff"].armed = serving
    if dump is not None:
        st["writer"] = DumpWriter(rank=get_tp_rank(), tp=get_tp_size(), engine="impl", **dump)


def step(runner, batch, teacher: dict | None = None, kv_lens: list[int] | None = None) -> dict:
    """Run one step (``ModelRunner.step`` with every token's logits) and return its points
    ``{name: (placement, tensor)}``; with ``kv_lens``, also each layer's cache contents for every prompt."""
    st = getattr(runner.model, _STATE)
    cap, hand = st["capture"], st["handoff"]
    cap.clear()
    st["teacher"].inputs = teacher
    armed, cap.armed, hand.armed = cap.armed, True, True
    try:
        runner.step(batch, all_logits=True)
        points = cap.step_done()
        points.update(hand.take())
    finally:
        st["teacher"].inputs = None
        cap.armed = hand.armed = armed
        cap.clear()
        hand.take()
    if kv_lens is not None:
        keep = None if st["points"] is None else re.compile(st["points"])
        kv = read_kv(runner, [table for _, _, table in batch], kv_lens)
        points.update({n: v for n, v in kv.items() if keep is None or keep.fullmatch(n)})
    if st.get("writer") is not None and teacher is None:  # a dump records the propagated run
        st["writer"].write(st["step"], [list(t) for t, _, _ in batch], [s for _, s, _ in batch], points)
        st["step"] += 1
    return points


class Handoffs(HandoffHooks):
    """impl's pipeline stage's side of its boundaries (``impl.pipeline``; ``HandoffHooks`` on its decoder stack,
    called with ``intermediate``): the ``IntermediateTensors`` a stage before the last returns to send, those a stage
    after the first is called with. No hooks without stages."""

    def __init__(self, runner, points: str | None = None):
        st = runner.stage
        super().__init__(runner.model.model, None if st.is_first else st.start - 1, None if st.is_last else st.end - 1,
                         "intermediate", points)


def sequence_slots(tables: list[list[int]], lens: list[int], block_size: int) -> torch.Tensor:
    """The cache slots of positions ``0..lens[b]-1`` of each sequence ``b`` (its blocks ``tables[b]``), in order."""
    return torch.cat([block_slots(torch.tensor([t]), block_size, n)[0] for t, n in zip(tables, lens)])


def read_kv(runner, tables: list[list[int]], lens: list[int]) -> dict:
    """Each layer's cached keys/values of every prompt, read back from the paged blocks."""
    out = {}
    for i, layer in enumerate(runner.model.model.layers):
        if not runner.stage.holds_layer(i):  # another pipeline stage's layer
            continue
        attn = layer.self_attn.attn
        kv = Shard(-1, layer.self_attn.qkv_proj.kv_replicas)
        bs = attn.k_cache.shape[1]
        heads = attn.k_cache.shape[2]  # what the cache actually holds (a faulty cache may hold more heads)
        slots = sequence_slots(tables, lens, bs)
        for name, cache in (("k", attn.k_cache), ("v", attn.v_cache)):
            rows = cache.view(-1, heads, cache.shape[3])[slots.to(cache.device)]
            if getattr(attn, "kv_quant", None) is not None:  # an FP8 cache: the values attention reads from it
                rows = dequantize_kv(rows, attn.kv_scales()["kv".index(name)], runner.dtype)
            out[f"layers.{i}.kv.{name}"] = (kv, as_rows(rows))
    return out


def write_prefix(runner, tables: list[list[int]], lens: list[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
                 ) -> None:
    """Write positions ``0..lens[b]-1`` of each sequence ``b`` (its blocks ``tables[b]``) into every held layer's
    KV cache: ``kv[layer]`` is ``(keys after RoPE, values)``, ``[sum(lens), total_kv_heads * head_dim]`` over all
    sequences in order, in the engine's dtype; this rank keeps its own KV heads (``first_kv_head``, the heads its
    ``qkv_proj`` computes) and writes them where ``Attention.forward`` would (``block_slots``). A later step of
    sequence ``b`` from position ``lens[b]`` then attends over them as over a cached prefix (the local pass on the
    last rows, ``tpcheck.pipeline.local_rows``). An FP8 cache is refused: its rounding is the engine's."""
    slots = sequence_slots(tables, lens, runner.block_size)
    for i, layer in enumerate(runner.model.model.layers):
        if not runner.stage.holds_layer(i):
            continue
        attn = layer.self_attn.attn
        if getattr(attn, "kv_quant", None) is not None:
            raise ValueError(f"layer {i}: an FP8 KV cache cannot be given a prefix (its scales round it)")
        # this rank's KV heads (those its qkv_proj computes); a cache laid out with more heads per slot (a fault
        # that stores them repeated to the query heads) gets them repeated as its attention would store them
        first, own, d = attn.first_kv_head, layer.self_attn.qkv_proj.num_kv_heads, attn.head_dim
        heads = attn.k_cache.shape[2]
        for which, cache in zip(kv[i], (attn.k_cache, attn.v_cache)):
            # ``kv`` arrives on the host (impl.executor.on_host); the cache is on this rank's device
            rows = which.view(which.shape[0], -1, d)[:, first:first + own].to(cache.device)
            if heads != own:
                rows = rows.repeat_interleave(heads // own, dim=1)
            cache.view(-1, heads, d)[slots.to(cache.device)] = rows.to(cache.dtype)


def serving_step(runner, ids: list[str], tokens: list[list[int]], starts: list[int],
                 rows: dict[str, list[int]], prompts: dict[str, list[int]] | None = None) -> None:
    """After one forward of impl's own scheduler (``LLM.generate``): write the points it captured as the next step
    of the dump ``setup`` opened, naming the requests it ran (``ids``, in row order), the tokens each consumed and
    where (``tokens``, ``starts``), the rows of a point that holds only some (``rows``: the sampled rows'
    logits) and the token ids from position 0 of the sequences a prefill step runs (``prompts``: what a
    prefix-cache hit's golden runs first)."""
    st = getattr(runner.model, _STATE)
    points = st["capture"].step_done()
    st["writer"].write(st["step"], tokens, starts, points, ids=ids, rows=rows, prompts=prompts)
    st["step"] += 1


def serving_end(runner) -> None:
    """Close the dump (its writer's queued steps written first: a failed write is raised here); later forwards
    are captured for nobody."""
    st = getattr(runner.model, _STATE)
    writer, st["writer"] = st["writer"], None
    st["capture"].armed = st["handoff"].armed = False
    st["capture"].clear()
    st["handoff"].take()
    if writer is not None:
        writer.close()
