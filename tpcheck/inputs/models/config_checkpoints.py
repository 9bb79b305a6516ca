"""The cache of random-weight checkpoints of arbitrary configs of any supported family (HF config keyword dicts,
``model_type`` naming the family, none for Qwen2, such as ``tpcheck.properties.strategies`` draws), next to
``tpcheck.inputs.models.checkpoints``' cache of the named presets.

``config_checkpoint`` writes a config's checkpoint once into ``root`` under a hash of what defines it (config,
weight seed, bias scale, dtype, outlier strength, ``RECIPE_VERSION``): content-addressed, written atomically
(safe under pytest-xdist). ``recreate_command`` is the shell line that rebuilds one bit for bit after its
temporary root is gone (what a failure report prints)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
from tpcheck.inputs.models import checkpoints as _checkpoints  # RECIPE_VERSION read at each call (a test bumps it)
from tpcheck.inputs.models.checkpoints import make_config_checkpoint


def default_root() -> pathlib.Path:
    """``$TPCHECK_CACHE/configs`` or ``<tmp>/tpcheck-configs``: content-addressed, so sharing it is safe."""
    env = os.environ.get("TPCHECK_CACHE")
    return pathlib.Path(env) / "configs" if env else pathlib.Path(tempfile.gettempdir()) / "tpcheck-configs"


def checkpoint_key(config: dict, seed: int = 0, bias_std: float = 0.5, dtype: str = "float32",
                   outliers: float = 0.0) -> str:
    """The cache directory's hash (``cfg-<key>``) of what defines a config's checkpoint."""
    what = {"config": config, "seed": seed, "bias_std": bias_std, "dtype": dtype, "recipe": _checkpoints.RECIPE_VERSION}
    if outliers:
        what["outliers"] = outliers
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_checkpoint(config: dict, root: str | os.PathLike | None = None, seed: int = 0, bias_std: float = 0.5,
                      dtype: str = "float32", outliers: float = 0.0) -> pathlib.Path:
    """Path of the random-weight checkpoint of ``config`` (a config kwargs dict, ``model_type`` naming its family:
    ``tpcheck.inputs.models.checkpoints.config_from_kwargs``) under ``root``,
    written once (``tpcheck.inputs.models.checkpoints.make_config_checkpoint``: the presets' value recipe, atomic rename)
    and cached by a hash of (config, seed, bias_std, dtype, outliers). Deterministic: the same arguments recreate the
    same weights bit for bit, so a path printed by a failing test can be rebuilt after its temp dir is gone."""
    path = pathlib.Path(root) if root is not None else default_root()
    path = path / f"cfg-{checkpoint_key(config, seed, bias_std, dtype, outliers)}"
    if (path / "config.json").is_file():
        return path
    try:
        return make_config_checkpoint(dict(config), path, seed=seed, dtype=dtype, bias_std=bias_std,
                                      outliers=outliers)
    except FileExistsError:
        if (path / "config.json").is_file():  # another process (xdist worker) finished first
            return path
        raise


def recreate_command(config: dict, root: str | os.PathLike, seed: int = 0, bias_std: float = 0.5,
                     outliers: float = 0.0) -> str:
    """A shell command that writes (or finds) the checkpoint of ``config`` and prints its path."""
    code = ("import json,sys; from tpcheck.inputs.models.config_checkpoints import config_checkpoint as c; "
            "print(c(json.loads(sys.argv[1]), sys.argv[2], seed=int(sys.argv[3]), bias_std=float(sys.argv[4]), "
            "outliers=float(sys.argv[5])))")
    python = "python" if shutil.which("python") == sys.executable else sys.executable
    return shlex.join([python, "-c", code, json.dumps(config, sort_keys=True), str(root), str(seed),
                       repr(float(bias_std)), repr(float(outliers))])
