"""One drawn example (``Case``: what ``tpcheck.properties.strategies.cases`` draws) and how it runs: its checkpoint
(``Case.checkpoint``: a preset's cached one, or the drawn config's, ``tpcheck.inputs.models.config_checkpoints``), the
layer-by-layer diff through an engine pool (``Case.diff``), the properties as assertions (``Case.check``: ranks
agree on replicated points, every point within the noise floor), the failure report and a one-line
reproduction (``Case.repro``) that recreates the drawn checkpoint if it is gone."""
from __future__ import annotations

import logging

import os
import pathlib
from dataclasses import asdict, dataclass

from tpcheck.inputs.models.checkpoints import cached_checkpoint
from tpcheck.inputs.models.config_checkpoints import config_checkpoint, default_root, recreate_command
from tpcheck.inputs.tp_layout import kv_layout
from tpcheck.options import DiffOptions
from tpcheck.pipeline.diff import run
from tpcheck.result.origin import ranks_cause

logger = logging.getLogger(__name__)  # progress: tpcheck's CLI shows INFO on stderr



@dataclass
class Case:
    """One drawn example: a model (config + weight seed + bias scale), a TP size, a dtype, prompts, decode
    steps and a KV block size."""

    config: dict
    tp: int
    dtype: str
    prompts: list[list[int]]
    decode_steps: int = 0
    block_size: int = 16
    weight_seed: int = 0
    bias_std: float = 0.5
    preset: str | None = None  # a named preset (``tpcheck.inputs.models.checkpoints.PRESETS``): its cached checkpoint
    exact_ops: bool = False  # also hold the elementwise ops to HF's bits (``tpcheck.measure.exact_ops``)
    outliers: float = 0.0  # strength of the massive-activation recipe (0: off)
    ep: int = 1  # expert-parallel size (mixture-of-experts models)
    pp: int = 1  # pipeline stages of tp ranks each (impl.pipeline; vLLM's layer split)

    @property
    def layout(self) -> str:
        return kv_layout(self.config["num_key_value_heads"], self.tp)

    def describe(self) -> str:
        c = self.config
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return (f"{f'preset {self.preset}: ' if self.preset else ''}tp={self.tp}"
                f"{f' pp={self.pp}' if self.pp != 1 else ''} {self.dtype} heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv "
                f"({self.layout}) head_dim {hd} hidden {c['hidden_size']} inter {c['intermediate_size']} "
                f"layers {c['num_hidden_layers']} vocab {c['vocab_size']} "
                f"{'tied' if c['tie_word_embeddings'] else 'untied'}"
                f"{f', outliers {self.outliers:g}' if self.outliers else ''}{self._moe()}; prompts {[len(p) for p in self.prompts]}, "
                f"decode {self.decode_steps}, block {self.block_size}")

    def _moe(self) -> str:
        c = self.config
        experts = c.get("num_experts", c.get("num_local_experts"))
        return "" if experts is None else f", {c['model_type']} top-{c['num_experts_per_tok']} of {experts} ep={self.ep}"

    def checkpoint(self, root: str | os.PathLike | None = None) -> pathlib.Path:
        """Write (once) and return the checkpoint directory of this case's model under ``root``."""
        if self.preset is not None:
            return cached_checkpoint(self.preset, seed=self.weight_seed, root=root)
        return config_checkpoint(self.config, root, self.weight_seed, self.bias_std, outliers=self.outliers)

    def options(self, model_dir: str | os.PathLike, inject=(), inject_layer: int | None = None, **kw) -> DiffOptions:
        """The ``DiffOptions`` of this case on the checkpoint ``model_dir`` (``kw``: more of its fields)."""
        return DiffOptions(model=str(model_dir), tp=self.tp, dtype=self.dtype, prompts=self.prompts,
                           decode_steps=self.decode_steps, block_size=self.block_size, exact_ops=self.exact_ops,
                           inject=tuple(inject), inject_layer=inject_layer, ep=self.ep, pp=self.pp, **kw)

    def diff_command(self, model_dir: str | os.PathLike, inject=(), inject_layer: int | None = None) -> str:
        """The ``tpcheck diff`` command line of this case (block size included): by preset name where the preset's
        own checkpoint is the case's."""
        opts = self.options(model_dir, inject, inject_layer)
        if self.preset is not None and self.weight_seed == 0:
            opts = opts.replace(model=None, preset=self.preset)
        return opts.command()

    def repro(self, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None) -> str:
        """One shell line that recreates the checkpoint if needed and runs ``tpcheck diff`` on this case."""
        if self.preset is not None and self.weight_seed == 0:
            return self.diff_command(None, inject, inject_layer)  # tpcheck diff --preset writes its own
        root = pathlib.Path(root) if root is not None else default_root()
        model = f'"$({recreate_command(self.config, root, self.weight_seed, self.bias_std, self.outliers)})"'
        cmd = self.diff_command("MODEL_DIR", inject, inject_layer)
        return cmd.replace("MODEL_DIR", model, 1)

    def diff(self, pool=None, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None,
             **kw):
        """The diff of this case (``pool``: a ``tpcheck.engines.pool.EnginePool`` to reuse engines; ``kw``: more
        ``DiffOptions`` fields)."""
        model = self.checkpoint(root)
        return run(self.options(model, inject, inject_layer, **kw), pool=pool,
                   command=self.diff_command(model, inject, inject_layer))

    def check(self, pool=None, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None):
        """The properties of one case, as assertions: ranks agree on every replicated point (the
        residual stream, replicated KV heads, ...: every replica within the noise floor) and every point of every step is within the noise
        floor (with ``exact_ops``: and the elementwise ops match HF bit for bit). Raises AssertionError with ``failure_report``; returns the ``DiffResult``."""
        r = self.diff(pool, root, inject, inject_layer)
        t = r.table
        failing = t[~t["passed"]]  # ranks_cause reads one failing row at a time: only those are asked
        by_ranks = failing.index[failing.apply(lambda w: bool(ranks_cause(w)), axis=1)] if len(failing) else []
        split = t[t["note"].astype(str).str.startswith("ranks") | t.index.isin(by_ranks)]
        if len(split):
            w = split.iloc[0]
            why = w.note or ranks_cause(w)
            raise AssertionError(f"ranks disagree on replicated point {w.point} (step {w.step}): {why}\n"
                                 + self.failure_report(r, root, inject))
        if not r.passed:
            raise AssertionError(self.failure_report(r, root, inject))
        return r

    def failure_report(self, result, root: str | os.PathLike | None = None, inject=(), limit: int = 8) -> str:
        """The verdict, the first failing points and how to reproduce: for a failing assertion."""
        lines = [result.summary(), f"case: {self.describe()}"]
        if "passed" in result.table:
            bad = result.table[~result.table["passed"]]
            if len(bad):
                cols = ["step", "point", "rel_err", "ref_rel_err", "rank_spread", "excess", "note"]
                lines.append(bad[cols].head(limit).to_string(index=False))
        lines += [f"checkpoint: {self.checkpoint(root)}",
                  f"reproduce (recreates the checkpoint if its temp dir is gone):\n  {self.repro(root, inject)}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)
