"""Hypothesis strategies for tensor-parallel Qwen2 configurations and their inputs.

Hand-picked inputs find the bugs their author already imagined; these let Hypothesis search the space of
model shapes, TP sizes, prompts, decode lengths, block sizes and dtypes, and shrink what fails to the
smallest case that still fails. Everything drawn is valid for impl and for Hugging Face (no filtering):

* ``configs(tps)``: ``Qwen2Config`` keyword dicts (like ``tpcheck.checkpoints.PRESETS``) that every TP size
  in ``tps`` can split: small shapes (hidden <= 128, 1-3 layers, vocab <= ~600) so a checkpoint writes in
  milliseconds; head counts, KV-head counts (MHA, GQA, MQA), head_dim (implied or explicit), intermediate
  size, vocab sizes with and without padding, tied / untied, rope_theta, rms_norm_eps.
* ``config_and_tp(tps)``: a ``(config, tp)`` pair drawn together, so that both KV layouts are covered:
  partition (``tp <= num_kv_heads``) and replication (``tp > num_kv_heads``).
* ``tp_sizes(config)``, ``block_sizes()``, ``prompt_lengths(block_size)``, ``prompts(vocab, block_size)``
  (batch 1-8 of ragged lengths 1-300, lengths at block boundaries +-1 drawn often), ``decode_lengths(K)``,
  ``dtypes()``, ``bias_stds()``, ``outlier_strengths()`` (massive activations, as trained weights have
  them), ``seeds()``.
* ``cases(...)``: all of it together as a ``Case``, which writes its checkpoint (``Case.checkpoint``),
  runs the layer-by-layer diff (``Case.diff``), asserts the properties (``Case.check``: ranks agree on
  replicated points, every point within the noise floor) and prints a one-line reproduction
  (``Case.repro``) that recreates the drawn checkpoint if it is gone.

Use in your own tests::

    from hypothesis import given
    from tpcheck import strategies as tst
    from tpcheck.pool import EnginePool

    POOL = EnginePool()                       # one engine per TP size, reused by every example

    @given(tst.cases(tps=(2, 4), dtypes=("bfloat16",), max_decode=4))
    def test_my_engine(case):
        case.check(pool=POOL, root="/tmp/my-ckpts")   # AssertionError: report + `tpcheck diff` line

Drawn checkpoints are written by ``config_checkpoint`` into ``root`` under a hash of what defines them
(config, weight seed, bias scale, dtype): cached, and written atomically (safe under pytest-xdist).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import reduce

from hypothesis import strategies as st

DEFAULT_TPS = (1, 2, 4)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_BLOCK_SIZES = (16, 4, 1, 8, 32, 3)   # the first is where shrinking goes
HEAD_DIMS = (8, 16, 32)                      # even: RoPE rotates pairs
GROUPS = (1, 2, 4, 3, 7, 8)                  # query heads per KV head (7: Qwen2.5-0.5B's 14 / 2)
ROPE_THETAS = (10000.0, 1000000.0, 500000.0, 100.0)
BIAS_STDS = (0.5, 0.0, 4.0)                  # q/k/v bias scale: the presets' recipe, no bias, large (real Qwen2 k)
OUTLIER_STRENGTHS = (0.0, 1.0, 2.0)          # massive-activation recipe: off, small-outliers' strength, stronger
MAX_POSITION = 1024
_DEVNULL = open(os.devnull, "w")
_FIXED = dict(max_position_embeddings=MAX_POSITION, use_sliding_window=False, bos_token_id=1, eos_token_id=2)


# ---- configuration arithmetic ---------------------------------------------------------------------------

def kv_layout(num_kv_heads: int, tp: int) -> str:
    """``"partition"`` (each rank holds ``num_kv_heads / tp`` KV heads) or ``"replication"`` (each KV head
    is copied to ``tp / num_kv_heads`` ranks)."""
    return "partition" if tp <= num_kv_heads else "replication"


def tp_compatible(config: dict, tp: int) -> bool:
    """Whether impl can split ``config`` over ``tp`` ranks: query heads divisible by tp, KV heads divisible
    by tp (partition) or tp divisible by KV heads (replication), intermediate size divisible by tp.
    (impl's ``ModelConfig.check_tp`` checks the heads; the MLP split needs the last one.)"""
    h, kv, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    if tp < 1 or h % tp or inter % tp:
        return False
    return kv % tp == 0 if tp <= kv else tp % kv == 0


def _lcm(values) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


def _check_tps(tps) -> tuple[int, ...]:
    tps = tuple(sorted(set(int(t) for t in tps)))
    if not tps or tps[0] < 1:
        raise ValueError(f"tps must be non-empty positive TP sizes, got {tps!r}")
    return tps


def _kv_candidates(tps: tuple[int, ...], max_kv: int = 8) -> list[int]:
    """KV-head counts that every TP size in ``tps`` can partition or replicate."""
    out = []
    for kv in range(1, max_kv + 1):
        if all((kv % t == 0) if t <= kv else (t % kv == 0) for t in tps):
            out.append(kv)
    return out


@st.composite
def _shape(draw, heads: int, kv: int, tp_multiple: int, max_hidden: int, max_layers: int, max_vocab: int) -> dict:
    """Everything but the head counts (already valid for the TP sizes).

    Every draw happens whatever the earlier ones were (a value that does not fit falls back to one that
    does), so the number of choices never depends on the head count: Hypothesis' shrinker, which prefers
    shorter choice sequences, then lands on small models rather than on whichever branch draws least."""
    explicit = draw(st.booleans())  # False first: head_dim implied by hidden / heads, as in most checkpoints
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    hidden = 16 * draw(st.integers(2, max(2, max_hidden // 16)))  # used only with an explicit head_dim
    if explicit:
        if heads * head_dim > 4 * max_hidden:
            head_dim = HEAD_DIMS[0]
        explicit = hidden != heads * head_dim  # else the same model as the plain config: keep that form
    if not explicit:
        if heads * head_dim > max_hidden:
            head_dim = HEAD_DIMS[0]
        hidden = heads * head_dim
    unit = _lcm([tp_multiple, 8])
    inter = unit * draw(st.integers(max(1, 16 // unit), max(1, 4 * max_hidden // unit)))
    # vocab: any size (padded to a multiple of 64 and of tp) or an exact multiple of 64 (no padding)
    vocab = draw(st.one_of(st.integers(32, max_vocab), st.integers(1, max(1, max_vocab // 64)).map(lambda k: 64 * k)))
    cfg = dict(_FIXED, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
               intermediate_size=inter, num_hidden_layers=draw(st.integers(1, max_layers)), vocab_size=vocab,
               tie_word_embeddings=draw(st.booleans()), rope_theta=draw(st.sampled_from(ROPE_THETAS)),
               rms_norm_eps=draw(st.sampled_from((1e-6, 1e-5))))
    if explicit:
        cfg["head_dim"] = head_dim
    return cfg


def _pick(draw, options, ok):
    """Draw from the fixed ``options``; one that ``ok`` refuses falls back to the first that it accepts."""
    value = draw(st.sampled_from(options))
    return value if ok(value) else next(o for o in options if ok(o))


def configs(tps=DEFAULT_TPS, max_hidden: int = 128, max_layers: int = 3, max_vocab: int = 600,
            max_heads: int = 16) -> st.SearchStrategy[dict]:
    """``Qwen2Config`` keyword dicts that every TP size in ``tps`` can split (``tp_compatible``)."""
    tps = _check_tps(tps)
    t = _lcm(tps)
    kvs = _kv_candidates(tps)
    if not kvs or t > max_heads:
        raise ValueError(f"no KV-head count <= 8 / head count <= {max_heads} works for every tp in {tps}")

    @st.composite
    def draw_config(draw):
        kv = draw(st.sampled_from(kvs))
        base = _lcm([kv, t])  # heads: a multiple of the KV heads and of every tp
        heads = base * _pick(draw, GROUPS + (1,), lambda g: base * g <= max_heads or g == 1)
        return draw(_shape(heads, kv, t, max_hidden, max_layers, max_vocab))

    return draw_config()


def tp_sizes(config: dict, tps=DEFAULT_TPS) -> st.SearchStrategy[int]:
    """The TP sizes in ``tps`` that can split ``config``."""
    ok = [t for t in _check_tps(tps) if tp_compatible(config, t)]
    if not ok:
        raise ValueError(f"none of tp {tps} can split this config")
    return st.sampled_from(ok)


def config_and_tp(tps=DEFAULT_TPS, layouts=("partition", "replication"), max_hidden: int = 128,
                  max_layers: int = 3, max_vocab: int = 600,
                  max_heads: int = 16) -> st.SearchStrategy[tuple[dict, int]]:
    """A ``(config, tp)`` pair drawn together: first the TP size, then the KV layout (``layouts``; replication
    needs ``tp > 1``), then head counts that make it so: partition ``num_kv_heads = tp * a``; replication
    ``num_kv_heads`` a proper divisor of tp (MQA included). Shrinks toward tp 1, partition, few heads."""
    tps = _check_tps(tps)
    layouts = tuple(layouts)
    if not set(layouts) <= {"partition", "replication"} or not layouts:
        raise ValueError(f"layouts must be 'partition' and/or 'replication', got {layouts!r}")
    usable = [t for t in tps if "partition" in layouts or t > 1]
    if not usable:
        raise ValueError("replication needs a tp > 1")

    @st.composite
    def draw_pair(draw):
        # fixed option lists (see _shape): the shrinker compares like with like
        tp = draw(st.sampled_from(usable))
        layout = _pick(draw, layouts, lambda lay: lay == "partition" or tp > 1)
        if layout == "partition":
            kv = tp * _pick(draw, (1, 2, 4), lambda a: tp * a <= 8 or a == 1)
            fits = lambda g: kv * g <= max_heads  # noqa: E731
        else:
            kv = _pick(draw, (1, 2, 4, 8, 16), lambda d: (d < tp and tp % d == 0) or d == 1)
            fits = lambda g: (kv * g) % tp == 0 and kv * g <= max_heads  # noqa: E731
        g = _pick(draw, GROUPS + (tp // kv if layout == "replication" else 1,), fits)
        return draw(_shape(kv * g, kv, tp, max_hidden, max_layers, max_vocab)), tp

    return draw_pair()


def block_sizes(sizes=DEFAULT_BLOCK_SIZES) -> st.SearchStrategy[int]:
    """KV-cache block sizes (tokens per block); shrinks toward the first (16)."""
    return st.sampled_from(tuple(sizes))


def dtypes(names=DEFAULT_DTYPES) -> st.SearchStrategy[str]:
    return st.sampled_from(tuple(names))


def bias_stds(values=BIAS_STDS) -> st.SearchStrategy[float]:
    """Scale of the drawn q/k/v biases (``tpcheck.checkpoints.make_config_checkpoint(bias_std=...)``)."""
    return st.sampled_from(tuple(values))


def outlier_strengths(values=OUTLIER_STRENGTHS) -> st.SearchStrategy[float]:
    """Strength of the massive-activation recipe (``tpcheck.checkpoints.make_config_checkpoint(outliers=...)``:
    a few residual channels in the hundreds, as trained models have them); 0 is off, where shrinking goes."""
    return st.sampled_from(tuple(values))


def seeds() -> st.SearchStrategy[int]:
    """Sampling / weight seeds."""
    return st.integers(0, 2**32 - 1)


def decode_lengths(max_steps: int = 8) -> st.SearchStrategy[int]:
    """Decode steps after the prefill: 0 (prefill only) to ``max_steps``."""
    return st.integers(0, max_steps)


@st.composite
def prompt_lengths(draw, block_size: int = 16, max_len: int = 300, long_every: int = 8) -> int:
    """A prompt length in ``[1, max_len]``: mostly (5 in 8) at a block boundary +-1 (1-4 blocks in), else
    short (1-24), and one draw in ``long_every`` anywhere up to ``max_len``."""
    # sampled_from draws its options uniformly (small integer ranges are biased toward their lower bound);
    # option 0 is "short", where the shrinker lands
    kinds = ["short", "short"] + ["boundary"] * max(1, long_every - 3) + ["long"]
    kind = draw(st.sampled_from(kinds))
    if kind == "short" or max_len <= 24:
        n = draw(st.integers(1, min(24, max_len)))
    elif kind == "long":
        n = draw(st.integers(1, max_len))
    else:
        blocks = draw(st.integers(1, max(1, min(4, max_len // block_size))))
        n = blocks * block_size + draw(st.sampled_from((0, -1, 1)))
    return min(max(n, 1), max_len)


@st.composite
def prompts(draw, vocab_size: int, block_size: int = 16, max_batch: int = 8, max_len: int = 300,
            common_batch: int = 4, shared_prefix: bool = False) -> list[list[int]]:
    """A batch of 1 to ``max_batch`` prompts (``common_batch`` or fewer most of the time) of ragged lengths
    (``prompt_lengths``), token ids uniform in ``[0, vocab_size)`` from a drawn seed (every vocab shard,
    the last, partly padded one included). ``shared_prefix``: sometimes the later prompts start with a
    prefix of the first (prefix caching)."""
    big = max_batch > common_batch and draw(st.sampled_from([False] * 7 + [True]))
    batch = draw(st.integers(common_batch + 1, max_batch) if big else st.integers(1, min(common_batch, max_batch)))
    lens = [draw(prompt_lengths(block_size, max_len)) for _ in range(batch)]
    rng = random.Random(draw(st.integers(0, 2**16)))
    out = [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]
    if shared_prefix and batch > 1 and draw(st.booleans()):
        prefix = out[0][:draw(st.integers(1, len(out[0])))]
        out = [out[0]] + [(prefix + p)[:max_len] for p in out[1:]]
    return out


# ---- checkpoints of drawn configs -----------------------------------------------------------------------

def default_root() -> pathlib.Path:
    """``$TPCHECK_CACHE/configs`` or ``<tmp>/tpcheck-configs``: content-addressed, so sharing it is safe."""
    env = os.environ.get("TPCHECK_CACHE")
    return pathlib.Path(env) / "configs" if env else pathlib.Path(tempfile.gettempdir()) / "tpcheck-configs"


def checkpoint_key(config: dict, seed: int = 0, bias_std: float = 0.5, dtype: str = "float32",
                   outliers: float = 0.0) -> str:
    from tpcheck.checkpoints import RECIPE_VERSION
    what = {"config": config, "seed": seed, "bias_std": bias_std, "dtype": dtype, "recipe": RECIPE_VERSION}
    if outliers:
        what["outliers"] = outliers
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_checkpoint(config: dict, root: str | os.PathLike | None = None, seed: int = 0, bias_std: float = 0.5,
                      dtype: str = "float32", outliers: float = 0.0) -> pathlib.Path:
    """Path of the random-weight checkpoint of ``config`` (a ``Qwen2Config`` kwargs dict) under ``root``,
    written once (``tpcheck.checkpoints.make_config_checkpoint``: the presets' value recipe, atomic rename)
    and cached by a hash of (config, seed, bias_std, dtype, outliers). Deterministic: the same arguments recreate the
    same weights bit for bit, so a path printed by a failing test can be rebuilt after its temp dir is gone."""
    from tpcheck.checkpoints import make_config_checkpoint
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
    code = ("import json,sys; from tpcheck.strategies import config_checkpoint as c; "
            "print(c(json.loads(sys.argv[1]), sys.argv[2], seed=int(sys.argv[3]), bias_std=float(sys.argv[4]), "
            "outliers=float(sys.argv[5])))")
    python = "python" if shutil.which("python") == sys.executable else sys.executable
    return shlex.join([python, "-c", code, json.dumps(config, sort_keys=True), str(root), str(seed),
                       repr(float(bias_std)), repr(float(outliers))])


# ---- a whole drawn case -----------------------------------------------------------------------------------

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
    preset: str | None = None  # a named preset (``tpcheck.checkpoints.PRESETS``): its cached checkpoint
    exact_ops: bool = False  # also hold the elementwise ops to HF's bits (``tpcheck.exact_ops``)
    outliers: float = 0.0  # strength of the massive-activation recipe (0: off)

    @property
    def layout(self) -> str:
        return kv_layout(self.config["num_key_value_heads"], self.tp)

    def describe(self) -> str:
        c = self.config
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return (f"tp={self.tp} {self.dtype} heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv "
                f"({self.layout}) head_dim {hd} hidden {c['hidden_size']} inter {c['intermediate_size']} "
                f"layers {c['num_hidden_layers']} vocab {c['vocab_size']} "
                f"{'tied' if c['tie_word_embeddings'] else 'untied'}"
                f"{f', outliers {self.outliers:g}' if self.outliers else ''}; prompts {[len(p) for p in self.prompts]}, "
                f"decode {self.decode_steps}, block {self.block_size}")

    def checkpoint(self, root: str | os.PathLike | None = None) -> pathlib.Path:
        """Write (once) and return the checkpoint directory of this case's model under ``root``."""
        if self.preset is not None:
            from tpcheck.checkpoints import cached_checkpoint
            return cached_checkpoint(self.preset, seed=self.weight_seed, root=root)
        return config_checkpoint(self.config, root, self.weight_seed, self.bias_std, outliers=self.outliers)

    def diff_command(self, model_dir: str | os.PathLike, inject=(), inject_layer: int | None = None) -> str:
        """The ``tpcheck diff`` command line of this case (block size included)."""
        from tpcheck.layer_diff import diff_command
        by_name = self.preset is not None and self.weight_seed == 0
        return diff_command(["--preset", self.preset] if by_name else ["--model", model_dir], self.tp, self.dtype,
                            self.prompts, self.decode_steps, self.block_size, exact_ops=self.exact_ops, inject=inject,
                            inject_layer=inject_layer)

    def repro(self, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None) -> str:
        """One shell line that recreates the checkpoint if needed and runs ``tpcheck diff`` on this case."""
        if self.preset is not None and self.weight_seed == 0:
            return self.diff_command(None, inject, inject_layer)  # tpcheck diff --preset writes its own
        root = pathlib.Path(root) if root is not None else default_root()
        model = f'"$({recreate_command(self.config, root, self.weight_seed, self.bias_std, self.outliers)})"'
        cmd = self.diff_command("MODEL_DIR", inject, inject_layer)
        return cmd.replace("MODEL_DIR", model, 1)

    def diff(self, pool=None, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None,
             log=None, **kw):
        """``tpcheck.diff`` of this case (``pool``: a ``tpcheck.pool.EnginePool`` to reuse engines)."""
        import tpcheck
        model = self.checkpoint(root)
        return tpcheck.diff(model=str(model), tp=self.tp, dtype=self.dtype, prompts=self.prompts,
                            decode_steps=self.decode_steps, inject=list(inject), inject_layer=inject_layer,
                            pool=pool, block_size=self.block_size, exact_ops=self.exact_ops, log=log or _DEVNULL,
                            command=self.diff_command(model, inject, inject_layer), **kw)

    def check(self, pool=None, root: str | os.PathLike | None = None, inject=(), inject_layer: int | None = None,
              log=None):
        """The properties of one case, as assertions: ranks agree on every replicated point (the
        residual stream, replicated KV heads, ...) and every point of every step is within the noise
        floor (with ``exact_ops``: and the elementwise ops match HF bit for bit). Raises AssertionError with ``failure_report``; returns the ``DiffResult``."""
        r = self.diff(pool, root, inject, inject_layer, log)
        t = r.table
        split = t[t["note"].astype(str).str.startswith("ranks")]
        if len(split):
            w = split.iloc[0]
            raise AssertionError(f"ranks disagree on replicated point {w.point} (step {w.step}): {w.note}\n"
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
                cols = ["step", "point", "rel_err", "ref_rel_err", "excess", "note"]
                lines.append(bad[cols].head(limit).to_string(index=False))
        lines += [f"checkpoint: {self.checkpoint(root)}",
                  f"reproduce (recreates the checkpoint if its temp dir is gone):\n  {self.repro(root, inject)}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


@st.composite
def cases(draw, tps=DEFAULT_TPS, dtypes=DEFAULT_DTYPES, max_decode: int = 8, layouts=("partition", "replication"),
          block_sizes=DEFAULT_BLOCK_SIZES, max_batch: int = 8, common_batch: int = 4, max_len: int = 300,
          max_layers: int = 3, max_hidden: int = 128, max_vocab: int = 600, bias=BIAS_STDS,
          weight_seeds: bool = False, outliers=(0.0,)) -> Case:
    """A whole ``Case``. Shrinks toward: tp 1, partition, few small heads, 1 layer, short prompts, no
    decode, block size 16, the first dtype, the presets' bias recipe, the first outlier strength
    (``outliers``: strengths to draw, e.g. ``OUTLIER_STRENGTHS``; default: none)."""
    config, tp = draw(config_and_tp(tps, layouts, max_hidden, max_layers, max_vocab))
    dtype = draw(st.sampled_from(tuple(dtypes)))
    bs = draw(st.sampled_from(tuple(block_sizes)))
    ps = draw(prompts(config["vocab_size"], bs, max_batch, max_len, common_batch))
    steps = draw(decode_lengths(max_decode))
    return Case(config, tp, dtype, ps, steps, bs, weight_seed=draw(st.integers(0, 3)) if weight_seeds else 0,
                bias_std=draw(st.sampled_from(tuple(bias))), outliers=draw(outlier_strengths(outliers)))
