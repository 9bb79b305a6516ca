"""Shared fixtures: synthetic checkpoints and TP engines, cached per pytest(-xdist) worker process.

Each xdist worker has its own session, so its own temp dirs and its own engine pool: nothing is shared
between workers, no fixed ports (ranks rendezvous through a FileStore in a private temp dir)."""
from __future__ import annotations

import pytest

from impl import CacheConfig
from tpcheck.inputs.models.checkpoints import cached_checkpoint
from tpcheck.engines.pool import EnginePool

pytest_plugins = ["tpcheck.properties.profiles"]  # profile from HYPOTHESIS_PROFILE; prints the example count


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """``ckpt(preset, seed=0, dtype="float32") -> Path`` of a synthetic checkpoint, written once per worker."""
    root = tmp_path_factory.mktemp("checkpoints")

    def get(preset: str, seed: int = 0, dtype: str = "float32"):
        return cached_checkpoint(preset, seed=seed, dtype=dtype, root=root)

    return get


@pytest.fixture(scope="session")
def engines():
    """``engines.get(model_dir, tp, dtype=..., block_size=..., num_kv_blocks=...) -> impl.LLM``; the worker
    processes of each TP size live for the whole session."""
    pool = EnginePool(cache=CacheConfig(max_num_seqs=16))
    yield pool
    pool.close()


_HF: dict = {}


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(model_dir, dtype="float32")``: the Hugging Face reference model, loaded once."""
    from tpcheck.reference.hf import load_hf_model

    def get(model_dir, dtype: str = "float32"):
        key = (str(model_dir), dtype)
        if key not in _HF:
            _HF[key] = load_hf_model(model_dir, dtype)
        return _HF[key]

    return get
