"""A golden for checkpoints larger than memory: Hugging Face's causal LM (``Qwen2ForCausalLM``, or the class of
another family ``capture_hf.load_hf_model`` supports) whose weights are read from the checkpoint's safetensors as
the forward reaches them, and dropped when it leaves them.

Why: the golden is HF in float64, twice a float32 checkpoint and four times a bfloat16 one (Qwen2.5-72B: about
580 GB of float64 weights), so ``from_pretrained`` cannot build it on one CPU box. The forward only ever needs
one weight matrix at a time, so only that one needs to be in memory.

How (``streamed_hf_capture``): HF's own model class (``capture_hf.hf_classes``) is built on the meta device (no weight memory) at
the requested dtype and wrapped in the unchanged ``tpcheck.reference.hf.HFCapture``, so its hooks, teacher forcing
and emulated TP reductions work as on the in-memory model. Then:

* each weight matrix of a decoder layer (q/k/v/o, gate/up/down) is read when its ``nn.Linear`` is called (a
  forward pre-hook) and put back on the meta device when the call returns (a forward hook that also runs on an
  error), so at most one matrix is resident;
* vectors (RMSNorm weights, Qwen3's q/k norms, biases) are read once at build time and stay: a hidden-size vector or two per
  layer, and ``tpcheck.measure.exact_ops`` calls the norms of the reference model directly, outside any forward;
* the embedding reads only the rows of the tokens in the forward (times Gemma 3's embedding scale, as HF's);
* the LM head (``lm_head.weight``, or ``model.embed_tokens.weight`` when ``tie_word_embeddings``) is applied in
  vocab chunks of about the largest matrix of a layer, each chunk read, multiplied and dropped in turn;
* the rotary buffers (``inv_freq``, not in the checkpoint) come from HF's own rotary module built on the CPU,
  as ``from_pretrained`` recomputes them;
* the KV cache (``DynamicCache``) and the captured points are activations and stay in memory as before.

Bit identity with the in-memory golden: every op is HF's own, on tensors with the same values (a checkpoint
tensor cast to the dtype by ``copy_``, the cast ``from_pretrained``'s ``tensor.to(dtype)`` does, into a 64-byte
aligned buffer as a fresh allocation is) and, where the checkpoint already has the dtype, at the same addresses
modulo the page: ``from_pretrained`` then keeps the file's zero-copy views, and float32 BLAS kernels round
differently at another alignment (measured: decode steps differ in the last bit), so the streamed model takes
the same views. The one op whose shape changes is the LM head's matmul: ``F.linear(x, W[a:b])`` instead of ``F.linear(x, W)[..., a:b]``.
A BLAS computes each output column from the same dot product either way, but MKL (torch's CPU BLAS here)
handles the columns past the last full column block of a matrix with a different kernel, which rounds
differently: chunks of 16384 rows give 4-12 differing logits per chunk in float64, chunks whose row count is a
multiple of its column block (12 in float64 with AVX-512) give none. Chunks are therefore a multiple of
``HEAD_ROW_ALIGN`` (3072, a multiple of every block size seen: 4, 8, 12, 16, 24, 32, 48, 64), so they start
where the full matrix's blocks start and the last chunk ends with the full matrix's own remainder; measured
bit-identical on an AVX-512 CPU without AMX for float64/float32/bfloat16/float16, 1-129 tokens, 1-8 threads,
vocab 250-151936. A BLAS that blocks columns differently (another CPU or library) may differ, and one does: on a
CPU with AMX and AVX512-FP16, MKL picks the kernel of a GEMM of a few rows by the matrix's width, so a chunk's
logits differ from the whole matmul's in the last bits (measured with random data, 5-8 rows: ~90% of them, up to
4.6e-7 of the largest in float32 and 1.2e-15 in float64; 1 row: 3-4 of 12,500). The logits are then equal within
a few ulps, not bit for bit; every other point still is. ``tests/test_tpcheck/reference/test_golden_streamed.py`` (a 4-chunk
head: bit for bit, or within 8 ulps where it measures this BLAS to differ) and ``benchmarks/golden_memory.py``
(qwen2.5-0.5b, a 50-chunk head) check it where they run, and ``head_chunk_rows >= vocab`` reads the head whole
(the full matmul, exactly HF's, at the cost of holding the whole head).

Cost: every forward reads every matrix it uses from the checkpoint (from the page cache when it fits there),
and ``HFCapture.step`` runs each prompt as its own forward, so a step of B prompts reads the checkpoint B times.
A cast read goes through one short-lived mapping per block of at most ``READ_BLOCK_BYTES`` (``impl.loader``'s
lesson: the pages of an open safetensors mapping that a read touches count in RSS until it closes); a
zero-copy view keeps its mapping exactly as long as the weight lives. ``model.tpcheck_device_anchor`` is a
zero-size CPU parameter so that ``model.device`` (the first parameter's) is the CPU, not the meta device."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from impl.config import parse_dtype
from impl.loader import IGNORED_SUFFIXES, LoadError, checkpoint_files, open_safetensors
from tpcheck.reference.build import meta_model
from tpcheck.reference.hf import HFCapture, hf_classes

#: LM-head chunks are a multiple of this many vocab rows (see the module docstring: BLAS column blocks)
HEAD_ROW_ALIGN = 3072
#: at most this many bytes of a tensor are read through one safetensors mapping
READ_BLOCK_BYTES = 64 << 20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointReader:
    """Where each tensor of a safetensors checkpoint is (a single file, several, or an index), and reads of
    whole tensors, row ranges and single rows, cast to a dtype, each through a short-lived mapping."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.file: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, torch.dtype] = {}
        self.itemsize: dict[str, int] = {}
        for fname, names in checkpoint_files(model_dir).items():
            with open_safetensors(fname) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise LoadError(f"{self.model_dir / 'model.safetensors.index.json'} puts tensor {name!r} in "
                                        f"{Path(fname).name}, which does not hold it")
                    if name in self.file:
                        raise LoadError(f"tensor {name!r} is in both {Path(self.file[name]).name} and "
                                        f"{Path(fname).name}")
                    sl = f.get_slice(name)
                    if sl.get_dtype() not in _DTYPES:
                        raise LoadError(f"tensor {name!r} in {Path(fname).name} is {sl.get_dtype()}, not a float "
                                        f"type the golden reads ({', '.join(_DTYPES)})")
                    self.file[name], self.shape[name] = fname, tuple(sl.get_shape())
                    self.dtype[name] = _DTYPES[sl.get_dtype()]
                    self.itemsize[name] = self.dtype[name].itemsize
        self.bytes_read = 0  # checkpoint bytes read since construction (benchmarks/golden_memory.py)

    def _slice(self, f, name: str):
        try:
            return f.get_slice(name)
        except SafetensorError as e:
            raise LoadError(f"{Path(self.file[name]).name}: cannot read tensor {name!r} ({e})") from None

    def read(self, name: str, dtype: torch.dtype, start: int = 0, stop: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of tensor ``name`` in ``dtype``, as ``from_pretrained`` makes it with
        ``tensor.to(dtype)``: where the checkpoint already has ``dtype`` that is the file's own zero-copy view
        (its mapping lives as long as the tensor), at the file's address alignment, which the rounding of BLAS
        kernels can depend on (measured: float32 decode steps differ in the last bit from a copy at another
        alignment); otherwise a new tensor (or ``out``, of the slice's shape), filled block by block."""
        shape = self.shape[name]
        stop = shape[0] if stop is None else stop
        row_bytes = math.prod(shape[1:]) * self.itemsize[name]
        self.bytes_read += (stop - start) * row_bytes
        if self.dtype[name] == dtype:
            with open_safetensors(self.file[name]) as f:
                return self._slice(f, name)[start:stop]
        if out is None:
            out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        step = max(1, READ_BLOCK_BYTES // max(1, row_bytes))
        for a in range(start, stop, step):
            b = min(stop, a + step)
            with open_safetensors(self.file[name]) as f:
                out[a - start:b - start].copy_(self._slice(f, name)[a:b])
        return out

    def rows(self, name: str, dtype: torch.dtype, index: list[int]) -> torch.Tensor:
        """Rows ``index`` of a 2-D tensor (an embedding's token rows), in that order, as one ``dtype`` tensor."""
        shape = self.shape[name]
        out = torch.empty((len(index), *shape[1:]), dtype=dtype)
        with open_safetensors(self.file[name]) as f:
            sl = self._slice(f, name)
            for j, t in enumerate(index):
                out[j].copy_(sl[t:t + 1][0])
        self.bytes_read += len(index) * math.prod(shape[1:]) * self.itemsize[name]
        return out


def _meta_like(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


class Streamer:
    """The weight traffic of one streamed model: which module reads which tensor, the resident-byte count
    (``resident_bytes``, its maximum ``peak_bytes``: weights only, vectors excluded) and the reads.

    Cast weights are read into one buffer (``arena_bytes``: the largest module's matrices or one LM-head chunk)
    reused by every module in turn, since only one is ever resident: a fresh allocation per read made the
    allocator return and refault memory (measured on qwen2.5-0.5b: 1.2M page faults and 2x the time per
    decode step). Same-dtype weights are zero-copy views of the file and need no buffer."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, dtype: torch.dtype, head_chunk_rows: int | None):
        self.reader, self.dtype = reader, dtype
        cfg = model.config
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_name = "model.embed_tokens.weight"
        self.head_name = self.embed_name if self.tied else "lm_head.weight"
        self.vocab, self.hidden = cfg.vocab_size, cfg.hidden_size
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.resident_bytes = self.peak_bytes = self.loads = 0
        self._check(model)
        self.streamed: dict[nn.Module, list[tuple[str, str]]] = {}  # module -> [(param, checkpoint tensor)]
        self.vector_bytes = 0
        for mname, mod in model.named_modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                full = f"{mname}.{pname}" if mname else pname
                if full in ("lm_head.weight", self.embed_name):
                    continue  # the head and the embedding have their own forwards below
                if p.dim() <= 1:  # norm weights and biases: tiny, resident for good (exact_ops calls the norms)
                    # a copy: a zero-copy view would keep a mapping of its file open for good (elementwise ops
                    # and the bias of addmm do not round by address)
                    vec = reader.read(full, dtype).clone()
                    mod._parameters[pname] = nn.Parameter(vec, requires_grad=False)
                    self.vector_bytes += p.numel() * self.itemsize
                elif mname.startswith("model.layers."):
                    self.streamed.setdefault(mod, []).append((pname, full))
                else:
                    raise LoadError(f"streamed golden: parameter {full!r} is neither in a decoder layer nor the "
                                    "embedding or LM head; it does not know when to read it")
        for mod in self.streamed:
            mod.register_forward_pre_hook(lambda m, args: self._load(m))
            mod.register_forward_hook(lambda m, args, out: self._free(m), always_call=True)
        if head_chunk_rows is None:  # about the largest matrix of a layer, a multiple of HEAD_ROW_ALIGN
            largest = max((math.prod(reader.shape[n]) for ps in self.streamed.values() for _, n in ps), default=0)
            head_chunk_rows = max(1, largest // self.hidden // HEAD_ROW_ALIGN) * HEAD_ROW_ALIGN
        if head_chunk_rows < 1:
            raise ValueError(f"head_chunk_rows must be >= 1, got {head_chunk_rows}")
        self.head_chunk_rows = head_chunk_rows
        # the buffer: each module's matrices one after another, each starting on a 64-byte boundary (as a fresh
        # allocation would: the bits of cast weights were measured equal to from_pretrained's at that alignment)
        self._align = max(1, 64 // self.itemsize)
        need = [sum(self._padded(math.prod(reader.shape[n])) for _, n in ps) for ps in self.streamed.values()]
        self.arena_numel = max(need + [min(head_chunk_rows, self.vocab) * self.hidden])
        self._arena: torch.Tensor | None = None  # allocated at the first cast read
        self._resident: nn.Module | None = None  # the module whose weights are loaded now
        # Gemma 3's scaled embedding (HF: ``F.embedding(...) * embed_scale.to(weight dtype)``, the scale a float32
        # tensor of ``scalar_embed_scale``): its non-persistent buffer sits on the meta device, so it is rebuilt here
        scale = getattr(model.model.embed_tokens, "scalar_embed_scale", None)
        self._embed_scale = None if scale is None else torch.tensor(scale).to(self.dtype)
        model.model.embed_tokens.forward = self._embed
        model.lm_head.forward = self._head

    def _check(self, model: nn.Module) -> None:
        """Every tensor the model needs is in the checkpoint with its shape, and the checkpoint has no other."""
        want = {n: tuple(p.shape) for n, p in model.named_parameters() if n != "lm_head.weight"}
        want[self.head_name] = (self.vocab, self.hidden)
        r = self.reader
        for name in r.file:
            if name.endswith(IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight"):
                continue  # recomputed buffers; a tied checkpoint's (identical) head: HF uses the embedding
            if name not in want:
                raise LoadError(f"unexpected tensor {name!r} in {Path(r.file[name]).name}: the streamed "
                                f"{type(model).__name__} has no parameter for it")
            if r.shape[name] != want[name]:
                raise LoadError(f"tensor {name!r} in {Path(r.file[name]).name} has shape {list(r.shape[name])}, "
                                f"the model's parameter {list(want[name])}")
        missing = sorted(set(want) - set(r.file))
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise LoadError(f"{r.model_dir}: checkpoint lacks {len(missing)} tensor(s): {missing[:8]}{more}")

    def _padded(self, numel: int) -> int:
        return -(-numel // self._align) * self._align

    @property
    def arena_bytes(self) -> int:
        """Bytes of the reusable weight buffer (0 until a cast read needs it)."""
        return 0 if self._arena is None else self._arena.numel() * self.itemsize

    def _buffers(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Views of the buffer for tensors of ``shapes``, laid out one after another; whatever module held
        weights in it is freed first (left there by an interrupted forward)."""
        if self._resident is not None:
            self._free(self._resident)
        if self._arena is None:
            self._arena = torch.empty(self.arena_numel, dtype=self.dtype)
        views, at = [], 0
        for shape in shapes:
            n = math.prod(shape)
            views.append(self._arena[at:at + n].view(shape))
            at += self._padded(n)
        return views

    def _count(self, n: int) -> None:
        self.resident_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def _load(self, mod: nn.Module) -> None:
        params = self.streamed[mod]
        bufs = self._buffers([self.reader.shape[n] for _, n in params])
        for (pname, name), buf in zip(params, bufs):
            w = self.reader.read(name, self.dtype, out=buf)
            mod._parameters[pname] = nn.Parameter(w, requires_grad=False)
            self._count(w.numel() * self.itemsize)
        self._resident = mod
        self.loads += 1

    def _free(self, mod: nn.Module) -> None:
        for pname, _ in self.streamed[mod]:
            p = mod._parameters[pname]
            if p is not None and not p.is_meta:
                mod._parameters[pname] = _meta_like(p)
                self._count(-p.numel() * self.itemsize)
        if self._resident is mod:
            self._resident = None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(input_ids, W)`` reading only the rows of the distinct tokens."""
        uniq, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        bad = uniq[(uniq < 0) | (uniq >= self.vocab)]
        if bad.numel():
            raise IndexError(f"token id {int(bad[0])} is outside the embedding's {self.vocab} rows")
        table = self.reader.rows(self.embed_name, self.dtype, uniq.tolist())
        out = table[inverse].reshape(*input_ids.shape, self.hidden)
        return out if self._embed_scale is None else out * self._embed_scale

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, W)`` over the vocab in chunks of ``head_chunk_rows`` rows, each read then dropped."""
        rows, V, h = self.head_chunk_rows, self.vocab, self.hidden
        if rows >= V:
            w = self.reader.read(self.head_name, self.dtype, out=self._buffers([(V, h)])[0])
            self._count(w.numel() * self.itemsize)
            try:
                return F.linear(x, w)
            finally:
                self._count(-w.numel() * self.itemsize)
        out = torch.empty((*x.shape[:-1], V), dtype=x.dtype)
        for a in range(0, V, rows):
            b = min(V, a + rows)
            w = self.reader.read(self.head_name, self.dtype, a, b, out=self._buffers([(b - a, h)])[0])
            self._count(w.numel() * self.itemsize)
            out[..., a:b] = F.linear(x, w)
            self._count(-w.numel() * self.itemsize)
            del w
        return out


def build_streamed_model(model_dir: str | Path, dtype: str | torch.dtype = "float64",
                         head_chunk_rows: int | None = None) -> nn.Module:
    """HF's causal LM of checkpoint ``model_dir`` (the class ``load_hf_model`` uses: ``Qwen2ForCausalLM``,
    ``LlamaForCausalLM`` ...) in ``dtype`` with its weights streamed from the safetensors (module docstring), in eval mode; ``model.tpcheck_streamer`` is its ``Streamer``.
    ``head_chunk_rows``: vocab rows per LM-head chunk (default: about the largest matrix of a layer, a multiple
    of ``HEAD_ROW_ALIGN``; ``>= vocab_size``: the head whole, as one matmul). A tensor the model lacks, a missing
    one or a shape that differs is a ``LoadError`` naming it."""
    td = parse_dtype(dtype)
    # the classes load_hf_model uses (an unsupported model_type is a ConfigError naming it)
    config_cls, model_cls = hf_classes(model_dir)
    config = config_cls.from_pretrained(str(model_dir))
    reader = CheckpointReader(model_dir)
    model = meta_model(model_dir, td, config, model_cls)
    model.tpcheck_streamer = Streamer(model, reader, td, head_chunk_rows)
    # PreTrainedModel.device is its first parameter's device (the embedding's, meta here) and HF code and
    # tpcheck.reference.hf's teacher hook move inputs there: a zero-size CPU parameter, registered first, says CPU
    # (the top module's own parameters come first in model.parameters())
    model.register_parameter("tpcheck_device_anchor", nn.Parameter(torch.empty(0, dtype=td), requires_grad=False))
    return model.eval()


def streamed_hf_capture(model_dir: str | Path, dtype: str | torch.dtype = "float64",
                        head_chunk_rows: int | None = None) -> HFCapture:
    """``HFCapture`` of ``build_streamed_model``: the same points, bit for bit, as ``HFCapture(load_hf_model(...))``
    with one weight matrix resident at a time; works with ``capture_hf.new_cache(capture.model)``."""
    return HFCapture(build_streamed_model(model_dir, dtype, head_chunk_rows))
