"""Hypothesis strategies for tensor-parallel model configurations (Qwen2, Llama, Mistral, Qwen3) and their inputs.

Hand-picked inputs find the bugs their author already imagined; these let Hypothesis search the space of
model shapes, TP sizes, prompts, decode lengths, block sizes and dtypes, and shrink what fails to the
smallest case that still fails. Everything drawn is valid for impl and for Hugging Face (no filtering):

* ``configs(tps)``: config keyword dicts (like ``tpcheck.inputs.models.checkpoints.PRESETS``) that every TP size in ``tps``
  can split: small shapes (hidden <= 128, 1-3 layers, vocab <= ~600) so a checkpoint writes in
  milliseconds; head counts, KV-head counts (MHA, GQA, MQA), head_dim (implied or explicit), intermediate
  size, vocab sizes with and without padding, tied / untied, rope_theta, rms_norm_eps; and the family
  (``families``, Qwen2 first: where shrinking goes) with its options: Llama's ``attention_bias`` /
  ``mlp_bias`` / llama3 RoPE scaling, Mistral's sliding window, Qwen3's ``attention_bias`` and sliding
  layers (``_family``). A Qwen2 config has no ``model_type`` key, as the Qwen2 presets.
* ``config_and_tp(tps)``: a ``(config, tp)`` pair drawn together, so that both KV layouts are covered:
  partition (``tp <= num_kv_heads``) and replication (``tp > num_kv_heads``).
* ``tp_sizes(config)``, ``block_sizes()``, ``prompt_lengths(block_size)``, ``prompts(vocab, block_size)``
  (batch 1-8 of ragged lengths 1-300, lengths at block boundaries +-1 drawn often), ``decode_lengths(K)``,
  ``dtypes()``, ``bias_stds()``, ``outlier_strengths()`` (massive activations, as trained weights have
  them), ``seeds()``.
* ``cases(...)``: all of it together as a ``Case`` (what it draws from: a ``CaseSpace``; with its ``presets``,
  e.g. ``DEPTH_PRESETS``, one example in ``preset_share`` is that named preset instead of a drawn config:
  ``deep-sink``'s 24 layers and 2e4 attention sink, which no small drawn shape reaches), which writes its
  checkpoint (``Case.checkpoint``), runs the layer-by-layer diff (``Case.diff``), asserts the properties
  (``Case.check``: ranks agree on replicated points, every point within the noise floor) and prints a
  one-line reproduction (``Case.repro``) that recreates the drawn checkpoint if it is gone.

Use in your own tests::

    from hypothesis import given
    from tpcheck.properties import strategies as tst
    from tpcheck.engines.pool import EnginePool

    POOL = EnginePool()                       # one engine per TP size, reused by every example

    @given(tst.cases(tps=(2, 4), dtypes=("bfloat16",), max_decode=4))
    def test_my_engine(case):
        case.check(pool=POOL, root="/tmp/my-ckpts")   # AssertionError: report + `tpcheck diff` line

``Case`` and how it runs are in ``tpcheck.properties.case``; drawn checkpoints are written by
``tpcheck.inputs.models.config_checkpoints.config_checkpoint`` into ``root`` under a hash of what defines them (config,
weight seed, bias scale, dtype, outliers): cached, and written atomically (safe under pytest-xdist). Which TP
sizes split a config and how its KV heads do is impl's rule (``tpcheck.inputs.tp_layout``: ``ModelConfig.check_tp``,
``impl.shard_plan.kv_split``). All of these names are also importable from here.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from functools import reduce

from hypothesis import strategies as st

# re-exported: the drawn case and its checkpoints live in their own modules (``from tpcheck import strategies as
# tst; tst.Case``, ``tst.config_checkpoint``, ``tst.tp_compatible`` keep working)
from tpcheck.inputs.models.config_checkpoints import checkpoint_key, config_checkpoint, default_root, recreate_command  # noqa: F401
from tpcheck.properties.moe_strategies import MOE_FAMILIES, base_family, draw_ep, moe_options
from tpcheck.properties.pp_strategies import draw_pp
from tpcheck.properties.case import Case
from tpcheck.inputs.tp_layout import kv_layout, splits, tp_compatible
from impl.config import FAMILIES as SUPPORTED
from tpcheck.inputs.models.presets import PRESETS

DEFAULT_TPS = (1, 2, 4)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_BLOCK_SIZES = (16, 4, 1, 8, 32, 3)   # the first is where shrinking goes
HEAD_DIMS = (8, 16, 32)                      # even: RoPE rotates pairs
GROUPS = (1, 2, 4, 3, 7, 8)                  # query heads per KV head (7: Qwen2.5-0.5B's 14 / 2)
ROPE_THETAS = (10000.0, 1000000.0, 500000.0, 100.0)
BIAS_STDS = (0.5, 0.0, 4.0)                  # q/k/v bias scale: the presets' recipe, no bias, large (real Qwen2 k)
OUTLIER_STRENGTHS = (0.0, 1.0, 2.0)          # massive-activation recipe: off, small-outliers' strength, stronger
DEPTH_PRESETS = ("deep-sink",)               # trained-model magnitudes at depth (24 layers, a 2e4 sink at token 0)
PRESET_SHARE = 8                             # with ``CaseSpace.presets``: about one example in 8 draws one of them
MAX_POSITION = 1024
_FIXED = dict(max_position_embeddings=MAX_POSITION, use_sliding_window=False, bos_token_id=1, eos_token_id=2)
FAMILIES = ("qwen2", "llama", "mistral", "qwen3")  # model_type; the first is where shrinking goes
LLAMA3_ROPE = ((8.0, 32), (32.0, 64))        # (factor, original_max_position_embeddings): remaps that matter
                                             # at the drawn prompt lengths (low / high freq factor 1 / 4)
WINDOWS = (None, 4, 12, 33)                  # sliding window (Mistral; Qwen3 from layer 1): none, or shorter
                                             # than many drawn prompts


# ---- configurations ------------------------------------------------------------------------------------

def _lcm(values) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


def _check_tps(tps) -> tuple[int, ...]:
    tps = tuple(sorted(set(int(t) for t in tps)))
    if not tps or tps[0] < 1:
        raise ValueError(f"tps must be non-empty positive TP sizes, got {tps!r}")
    return tps


def _kv_candidates(tps: tuple[int, ...], max_kv: int = 8) -> list[int]:
    """KV-head counts that every TP size in ``tps`` can partition or replicate (impl's ``check_tp``, with
    query heads and MLP width that split: only the KV rule decides)."""
    return [kv for kv in range(1, max_kv + 1) if all(splits(t, _lcm([kv, t]), kv, t) for t in tps)]


def _check_families(families) -> tuple[str, ...]:
    families = tuple(families)
    bad = [f for f in families if f not in SUPPORTED]
    if not families or bad:
        raise ValueError(f"families must be model types of {sorted(SUPPORTED)}, got {families!r}")
    return families


@st.composite
def _family(draw, families: tuple[str, ...]) -> dict:
    """The family keys of a config: ``model_type`` and the options that family reads (none for Qwen2, whose
    biases ``bias_std`` scales). Every option is drawn whatever the family (see ``_shape``); with Qwen2
    alone nothing is drawn, so Qwen2-only strategies draw what they drew before the families existed."""
    if families == ("qwen2",):
        return {}
    model_type = draw(st.sampled_from(families))
    family = base_family(model_type)  # an MoE family draws its attention's options (moe_strategies)
    attention_bias, mlp_bias = draw(st.booleans()), draw(st.booleans())  # False first: the plain model
    rope = draw(st.sampled_from((None,) + LLAMA3_ROPE))
    window = draw(st.sampled_from(WINDOWS))
    if model_type == "qwen3_moe":
        window = None  # impl refuses Qwen3-MoE's use_sliding_window (transformers versions disagree on it)
    if family == "qwen2":
        return {} if model_type == "qwen2" else {"model_type": model_type}
    out: dict = {"model_type": model_type}
    if family == "llama":
        out.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
        if rope is not None:
            out["rope_scaling"] = {"rope_type": "llama3", "factor": rope[0], "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": rope[1]}
    elif family == "mistral":
        out["sliding_window"] = window  # None: full attention
    else:  # qwen3: per-head q/k norms always; sliding layers from layer 1 on (HF's max_window_layers)
        out["attention_bias"] = attention_bias
        if window is not None:
            out.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    return out


@st.composite
def _shape(draw, heads: int, kv: int, tp_multiple: int, max_hidden: int, max_layers: int, max_vocab: int,
           families: tuple[str, ...] = FAMILIES) -> dict:
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
    fam = draw(_family(families))
    if fam.get("model_type") in ("llama", "mistral", "mixtral"):
        del cfg["use_sliding_window"]  # a Qwen config key: Llama / Mistral do not read it
    if fam.get("model_type") in MOE_FAMILIES:
        fam.update(draw(moe_options(fam["model_type"], cfg["num_hidden_layers"], unit, inter)))
    if fam.get("model_type") == "llama" and hidden % heads:
        # transformers' LlamaConfig refuses hidden % heads != 0 even with an explicit head_dim: the nearest
        # hidden size it takes (no extra draw, so the choice sequence stays the same)
        cfg["hidden_size"] = heads * max(1, hidden // heads)
    if fam.get("model_type") in ("qwen3", "qwen3_moe"):
        cfg.setdefault("head_dim", hidden // heads)  # Qwen3Config's default head_dim is 128, not hidden / heads
    return {**cfg, **fam}


def _lays_out(kv: int, tp: int) -> str | None:
    """``kv_layout`` of ``kv`` KV heads at ``tp``, None where tp cannot split them."""
    return kv_layout(kv, tp) if splits(tp, _lcm([kv, tp]), kv, tp) else None


def _pick(draw, options, ok):
    """Draw from the fixed ``options``; one that ``ok`` refuses falls back to the first that it accepts."""
    value = draw(st.sampled_from(options))
    return value if ok(value) else next(o for o in options if ok(o))


def configs(tps=DEFAULT_TPS, max_hidden: int = 128, max_layers: int = 3, max_vocab: int = 600,
            max_heads: int = 16, families=FAMILIES) -> st.SearchStrategy[dict]:
    """Config keyword dicts of the ``families`` (model types; a Qwen2 dict has no ``model_type``) that every
    TP size in ``tps`` can split (``tp_compatible``)."""
    tps = _check_tps(tps)
    families = _check_families(families)
    t = _lcm(tps)
    kvs = _kv_candidates(tps)
    if not kvs or t > max_heads:
        raise ValueError(f"no KV-head count <= 8 / head count <= {max_heads} works for every tp in {tps}")

    @st.composite
    def draw_config(draw):
        kv = draw(st.sampled_from(kvs))
        base = _lcm([kv, t])  # heads: a multiple of the KV heads and of every tp
        heads = base * _pick(draw, GROUPS + (1,), lambda g: base * g <= max_heads or g == 1)
        return draw(_shape(heads, kv, t, max_hidden, max_layers, max_vocab, families))

    return draw_config()


def tp_sizes(config: dict, tps=DEFAULT_TPS) -> st.SearchStrategy[int]:
    """The TP sizes in ``tps`` that can split ``config``."""
    ok = [t for t in _check_tps(tps) if tp_compatible(config, t)]
    if not ok:
        raise ValueError(f"none of tp {tps} can split this config")
    return st.sampled_from(ok)


def config_and_tp(tps=DEFAULT_TPS, layouts=("partition", "replication"), max_hidden: int = 128,
                  max_layers: int = 3, max_vocab: int = 600, max_heads: int = 16,
                  families=FAMILIES) -> st.SearchStrategy[tuple[dict, int]]:
    """A ``(config, tp)`` pair drawn together: first the TP size, then the KV layout (``layouts``; replication
    needs ``tp > 1``), then head counts that make it so: partition ``num_kv_heads = tp * a``; replication
    ``num_kv_heads`` a proper divisor of tp (MQA included). Shrinks toward tp 1, partition, few heads."""
    tps = _check_tps(tps)
    families = _check_families(families)
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
        # KV heads in that layout (impl.shard_plan.kv_split), then query heads tp splits (check_tp)
        if layout == "partition":
            kv = tp * _pick(draw, (1, 2, 4), lambda a: tp * a <= 8 or a == 1)
        else:
            kv = _pick(draw, (1, 2, 4, 8, 16), lambda d: _lays_out(d, tp) == "replication" or d == 1)
        fits = lambda g: kv * g <= max_heads and splits(tp, kv * g, kv, tp)  # noqa: E731
        g = _pick(draw, GROUPS + (tp // kv if layout == "replication" else 1,), fits)
        return draw(_shape(kv * g, kv, tp, max_hidden, max_layers, max_vocab, families)), tp

    return draw_pair()


def block_sizes(sizes=DEFAULT_BLOCK_SIZES) -> st.SearchStrategy[int]:
    """KV-cache block sizes (tokens per block); shrinks toward the first (16)."""
    return st.sampled_from(tuple(sizes))


def dtypes(names=DEFAULT_DTYPES) -> st.SearchStrategy[str]:
    return st.sampled_from(tuple(names))


def bias_stds(values=BIAS_STDS) -> st.SearchStrategy[float]:
    """Scale of the drawn q/k/v biases (``tpcheck.inputs.models.checkpoints.make_config_checkpoint(bias_std=...)``)."""
    return st.sampled_from(tuple(values))


def outlier_strengths(values=OUTLIER_STRENGTHS) -> st.SearchStrategy[float]:
    """Strength of the massive-activation recipe (``tpcheck.inputs.models.checkpoints.make_config_checkpoint(outliers=...)``:
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


# ---- a whole drawn case -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CaseSpace:
    """What ``cases`` draws from: the TP sizes, dtypes, KV layouts, block sizes and families to pick among, and
    the bounds of the drawn model and workload. The defaults are the whole space the strategies cover."""
    tps: tuple[int, ...] = DEFAULT_TPS
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    max_decode: int = 8
    # pipeline stages to draw (impl.pipeline); a model of fewer layers draws only those it can split into
    pps: tuple[int, ...] = (1,)
    layouts: tuple[str, ...] = ("partition", "replication")
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    max_batch: int = 8
    common_batch: int = 4
    max_len: int = 300
    max_layers: int = 3
    max_hidden: int = 128
    max_vocab: int = 600
    bias: tuple[float, ...] = BIAS_STDS
    weight_seeds: bool = False
    outliers: tuple[float, ...] = (0.0,)  # strengths to draw, e.g. ``OUTLIER_STRENGTHS``; default: none
    families: tuple[str, ...] = FAMILIES
    presets: tuple[str, ...] = ()  # named presets drawn in one example of ``preset_share``, e.g. ``DEPTH_PRESETS``
    preset_share: int = PRESET_SHARE  # 1: every example is one of ``presets``


def _preset_config(draw, s: CaseSpace) -> tuple[dict, int, str] | None:
    """With ``s.presets``: one draw in ``s.preset_share`` a named preset (its config and a TP size of ``s.tps`` in
    one of ``s.layouts`` that splits it), else None; without, nothing is drawn (the choice sequence of a
    space without presets is the one it always was)."""
    # sampled_from draws uniformly (small integer ranges lean toward their lower bound)
    if not s.presets or not draw(st.sampled_from((False,) * (s.preset_share - 1) + (True,))):
        return None
    name = draw(st.sampled_from(tuple(s.presets)))
    config = dict(PRESETS[name])
    ok = [t for t in s.tps if tp_compatible(config, t) and kv_layout(config["num_key_value_heads"], t) in s.layouts]
    if not ok:
        raise ValueError(f"preset {name!r}: no tp of {s.tps} splits it in a layout of {s.layouts}")
    return config, draw(st.sampled_from(ok)), name


@st.composite
def cases(draw, space: CaseSpace | None = None, **fields) -> Case:
    """A whole ``Case`` drawn from ``space`` (default ``CaseSpace()``) with ``fields`` (``CaseSpace``'s) replaced:
    ``cases(dtypes=("bfloat16",), max_decode=4)``. Shrinks toward: tp 1, partition, few small heads, 1 layer,
    short prompts, no decode, block size 16, the first dtype, the presets' bias recipe, the first outlier
    strength, a drawn config rather than a named preset. A drawn preset (``presets``) keeps its own recipe,
    shape and weight seed 0 (``Case.preset``: its cached checkpoint); the bounds of the drawn shape do not
    apply to it, and its prompts are at most 2 of at most 64 tokens (a 24-layer model costs ~10x a drawn one)."""
    s = replace(space or CaseSpace(), **fields)
    named = _preset_config(draw, s)
    if named is None:
        config, tp = draw(config_and_tp(s.tps, s.layouts, s.max_hidden, s.max_layers, s.max_vocab,
                                        families=s.families))
    else:
        config, tp, _ = named
    ep = draw_ep(draw, config, tp)  # MoE: an expert-parallel size that splits the experts (dense: 1, no draw)
    pp = draw_pp(draw, config, s.pps)  # with tp (and ep): stages the model's layers allow (one choice: no draw)
    dtype = draw(st.sampled_from(tuple(s.dtypes)))
    bs = draw(st.sampled_from(tuple(s.block_sizes)))
    batch, length, common = ((s.max_batch, s.max_len, s.common_batch) if named is None
                             else (min(s.max_batch, 2), min(s.max_len, 64), min(s.common_batch, 2)))
    ps = draw(prompts(config["vocab_size"], bs, batch, length, common))
    steps = draw(decode_lengths(s.max_decode))
    seed = draw(st.integers(0, 3)) if s.weight_seeds else 0
    bias, outliers = draw(st.sampled_from(tuple(s.bias))), draw(outlier_strengths(s.outliers))
    if named is not None:  # the preset's checkpoint: its own recipe and seed
        seed, bias, outliers = 0, 0.5, 0.0
    return Case(config, tp, dtype, ps, steps, bs, weight_seed=seed, bias_std=bias, outliers=outliers,
                preset=None if named is None else named[2], ep=ep, pp=pp)

