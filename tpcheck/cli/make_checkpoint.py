"""``tpcheck make-checkpoint``: a synthetic Hugging Face checkpoint of a preset (``--preset``), optionally quantized
(``--quantize SCHEME``); or the quantization of an existing float checkpoint (``--model SRC_DIR --quantize SCHEME``).

The quantized formats, as vLLM reads them: compressed-tensors INT8 W8A8 (``tpcheck.inputs.models.quantize``), 4-bit GPTQ
(``gptq-w4g32`` ..., ``tpcheck.inputs.models.quantize_gptq``), 4-bit AWQ (``awq-w4g32`` ..., ``tpcheck.inputs.models.quantize_awq``).

``--from-gguf FILE.gguf``: the float32 checkpoint of a llama.cpp GGUF file of a Gemma 3 text model, its weights
dequantized (``tpcheck.inputs.models.gguf_checkpoint``; the file, its sha256 and tensor types in tpcheck_source.json)."""
from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from tpcheck.cli.lazy import Lazy
from tpcheck.inputs.models.presets import DTYPE_NAMES, preset_names
from tpcheck.inputs.models.quant_schemes import AWQ_SCHEMES, GPTQ_SCHEMES, SCHEMES

checkpoints = Lazy("tpcheck.inputs.models.checkpoints")  # these import torch: only the command's run needs them
quantize = Lazy("tpcheck.inputs.models.quantize")
quantize_awq = Lazy("tpcheck.inputs.models.quantize_awq")
gguf_checkpoint = Lazy("tpcheck.inputs.models.gguf_checkpoint")


def _schemes() -> dict[str, str]:
    """Every ``--quantize`` scheme: INT8 / FP8 W8A8 (``tpcheck.inputs.models.quantize``), 4-bit GPTQ (``quantize_gptq``)
    and AWQ (``quantize_awq``)."""
    return {**SCHEMES, **GPTQ_SCHEMES, **AWQ_SCHEMES}


def register(subparsers) -> None:
    mk = subparsers.add_parser("make-checkpoint", help="write a synthetic Hugging Face checkpoint (any supported "
                                                       "family), or a quantized one (--quantize)",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = mk.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=preset_names(), help="write this synthetic preset")
    src.add_argument("--model", type=Path, metavar="SRC_DIR",
                     help="a float Hugging Face checkpoint directory to quantize (needs --quantize)")
    src.add_argument("--from-gguf", type=Path, metavar="FILE.gguf",
                     help="convert a GGUF file of a Gemma 3 text model (llama.cpp's) to a float32 Hugging Face "
                          "checkpoint, its weights dequantized")
    mk.add_argument("--out", required=True, type=Path)
    mk.add_argument("--quantize", choices=list(_schemes()), metavar="SCHEME",
                    help="write the checkpoint quantized: " + "; ".join(f"{k}: {v}" for k, v in _schemes().items()))
    # None: not given (they describe a preset's float weights, so --model refuses them)
    mk.add_argument("--seed", type=int, default=None, help="the preset's random seed (default 0)")
    mk.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES),
                    help="the preset's float dtype (default float32)")
    mk.add_argument("--shards", type=int, default=None,
                    help="number of safetensors files (>1 writes an index; not with --quantize)")
    mk.set_defaults(handler=lambda a, argv: run(a))


def run(a) -> int:
    """Write the checkpoint; print what was written."""
    if a.from_gguf is not None:
        return _run_from_gguf(a)
    if a.model is not None:
        if a.quantize is None:
            raise ValueError("--model SRC_DIR needs --quantize SCHEME (a float checkpoint is written from --preset)")
        given = [f for f, v in (("--seed", a.seed), ("--dtype", a.dtype), ("--shards", a.shards)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: describe a --preset's weights, not --model's")
    seed, dtype = a.seed or 0, a.dtype or "float32"
    if a.quantize is None:
        print(checkpoints.make_checkpoint(a.preset, a.out, seed=seed, dtype=dtype, shards=a.shards or 1))
        return 0
    if a.shards is not None:
        raise ValueError("--shards: a quantized checkpoint is written as one model.safetensors")
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):  # before the preset is written
        raise ValueError(f"destination {a.out} exists and is not an empty directory")
    if a.model is not None:
        out = quantize_awq.quantize_any(a.model, a.out, a.quantize)
        source = str(a.model)
    else:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{a.out.name}.float-", dir=a.out.parent) as tmp:
            float_dir = checkpoints.make_checkpoint(a.preset, Path(tmp) / "float", seed=seed, dtype=dtype)
            out = quantize_awq.quantize_any(float_dir, a.out, a.quantize)
        source = f"preset {a.preset} (seed {seed}, {dtype})"
    n = len(quantize.quantized_names(out))
    print(f"{out}\nwrote the {a.quantize} quantization of {source}: {n} linear weights quantized "
          f"({_schemes()[a.quantize]})")
    return 0


def _run_from_gguf(a) -> int:
    """``--from-gguf``: convert, then print the directory and what it holds (progress went to stderr)."""
    given = [f for f, v in (("--quantize", a.quantize), ("--seed", a.seed), ("--dtype", a.dtype),
                            ("--shards", a.shards)) if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: not with --from-gguf (it writes the dequantized weights in float32, "
                         "as one model.safetensors)")
    done = gguf_checkpoint.convert_gguf(a.from_gguf, a.out)
    counts = Counter(done.tensor_types.values())
    print(f"{done.out}\nwrote the float32 dequantization of {a.from_gguf} (sha256 {done.sha256[:12]}...): "
          f"{len(done.tensor_types)} tensors (" + ", ".join(f"{n} {t}" for t, n in counts.most_common())
          + f") in {done.seconds:.1f} s")
    return 0
