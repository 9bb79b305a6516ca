"""Model configuration: read through transformers' own config class of each supported family (``FAMILIES``)
so impl and HF never disagree on a default, plus the checks HF does not do for us (a missing ``rope_theta``
is an error, not 10000; a RoPE type, activation or sliding-window layout impl does not implement is refused
by name rather than computed differently)."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from impl.errors import ConfigError
from impl.gemma_config import GemmaOptions, gemma_layer_types, read_gemma
from impl.layers.activation import ACTIVATIONS
from impl.layers.rotary import Llama3RopeScaling
from impl.moe_config import MIXTRAL, QWEN2_MOE, QWEN3_MOE, MoeConfig, MoeSpelling, read_moe
from impl.quant import Int8Scheme, QuantConfigError
from impl.quant_awq import AwqScheme, parse_quantization_config
from impl.quant_gptq import GptqScheme

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


_TF_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])
# transformers 5 resolves rope_theta / rope_scaling into config.rope_parameters; 4.x reads them at the top level
TRANSFORMERS_5 = _TF_VERSION >= (5, 0)
# the keyword (from_pretrained, configs) naming the weights' dtype: ``dtype`` since transformers 4.56; before,
# ``dtype`` is taken for an unknown config attribute and the model silently loads in float32
HF_DTYPE_KEY = "dtype" if _TF_VERSION >= (4, 56) else "torch_dtype"

ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Family:
    """One supported ``model_type``: the transformers config class that reads its config.json, HF's causal LM
    class (the reference implementation, as in ``architectures``), impl's model class (``"module:Class"``,
    imported on demand so that reading a config never builds a model), and how the family spells its
    options:

    * ``qkv_bias``: ``True`` always (Qwen2), ``False`` never (Mistral), ``"attention_bias"`` from that config
      flag, which then also gives ``o_proj`` a bias (Llama, Qwen3, as in HF), ``"qkv_bias"`` from that flag,
      q/k/v only, true where absent (Qwen2-MoE: transformers 5 added the flag, 4.x always has the biases);
    * ``mlp_bias``: whether the config's ``mlp_bias`` flag exists (Llama) or the MLP never has biases;
    * ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3);
    * ``sliding``: ``"refuse"`` (Qwen2: ``use_sliding_window`` is refused), ``"all"`` (Mistral: a non-null
      ``sliding_window`` applies to every layer), ``"layer_types"`` (Qwen3: the layers HF marks
      ``sliding_attention``), ``"none"`` (Llama has no sliding window);
    * ``moe``: how a mixture-of-experts family spells its experts (``impl.moe_config.MoeSpelling``); None for a
      dense family;
    * ``act_key``: the config key naming the MLP's activation (``hidden_act``; Gemma's ``hidden_activation``);
    * ``gemma``: Gemma 3's decoder (``impl.gemma_config``): ``(1 + w)`` norms, four norms per layer, a scaled
      embedding, a RoPE base per layer type, the attention scaled by ``query_pre_attn_scalar``."""

    config_class: str
    hf_model_class: str
    impl_model: str
    qkv_bias: bool | str
    mlp_bias: bool
    qk_norm: bool
    sliding: str
    moe: MoeSpelling | None = None
    act_key: str = "hidden_act"
    gemma: bool = False

    @property
    def available(self) -> bool:
        """Whether the installed transformers has this family (Qwen3 and Qwen3-MoE need >= 4.51)."""
        return getattr(transformers, self.config_class, None) is not None

    def hf_config_class(self, path: Path | str = "") -> type[PretrainedConfig]:
        cls = getattr(transformers, self.config_class, None)
        if cls is None:
            raise ConfigError(f"{path or 'config'}: transformers {transformers.__version__} has no "
                              f"{self.config_class}; upgrade transformers to read this family")
        return cls

    def model_class(self) -> type[nn.Module]:
        module, _, name = self.impl_model.partition(":")
        return getattr(importlib.import_module(module), name)


# model_type -> family: the one list of what impl runs (the engine builds ``FAMILIES[cfg.model_type]``'s model)
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "impl.models.llama:LlamaForCausalLM",
                    qkv_bias="attention_bias", mlp_bias=True, qk_norm=False, sliding="none"),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "impl.models.llama:MistralForCausalLM",
                      qkv_bias=False, mlp_bias=False, qk_norm=False, sliding="all"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "impl.models.qwen2:Qwen2ForCausalLM",
                    qkv_bias=True, mlp_bias=False, qk_norm=False, sliding="refuse"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "impl.models.qwen3:Qwen3ForCausalLM",
                    qkv_bias="attention_bias", mlp_bias=False, qk_norm=True, sliding="layer_types"),
    # mixture of experts (impl.layers.moe); Qwen3-MoE's and Qwen2-MoE's sliding windows differ between
    # transformers versions, so ``use_sliding_window`` is refused; Mixtral's applies to every layer, as Mistral's
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "impl.models.qwen2_moe:Qwen2MoeForCausalLM",
                        qkv_bias="qkv_bias", mlp_bias=False, qk_norm=False, sliding="refuse", moe=QWEN2_MOE),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "impl.models.qwen3_moe:Qwen3MoeForCausalLM",
                        qkv_bias="attention_bias", mlp_bias=False, qk_norm=True, sliding="refuse", moe=QWEN3_MOE),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", "impl.models.mixtral:MixtralForCausalLM",
                      qkv_bias=False, mlp_bias=False, qk_norm=False, sliding="all", moe=MIXTRAL),
    # Gemma 3's text decoder (transformers >= 4.50): sliding-window and global layers (HF's layer_types)
    "gemma3_text": Family("Gemma3TextConfig", "Gemma3ForCausalLM", "impl.models.gemma3:Gemma3ForCausalLM",
                          qkv_bias="attention_bias", mlp_bias=False, qk_norm=True, sliding="layer_types",
                          act_key="hidden_activation", gemma=True),
}


def family_biases(family: Family, hf) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) of an HF config of ``family``, as HF's attention builds them."""
    if family.qkv_bias == "attention_bias":  # Llama, Qwen3: one flag biases q/k/v and o_proj
        qkv = bool(getattr(hf, "attention_bias", False))
        return qkv, qkv
    if family.qkv_bias == "qkv_bias":
        return bool(getattr(hf, "qkv_bias", True)), False
    return bool(family.qkv_bias), False


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def hf_rope_theta(hf: PretrainedConfig) -> float:
    """The theta HF's rotary embedding uses: ``rope_parameters["rope_theta"]`` in transformers 5 (which
    wins when a file has both), the top-level ``rope_theta`` in 4.x (where a ``rope_parameters`` key is
    just an unread attribute)."""
    params = _rope_parameters(hf)
    if "full_attention" in params:  # Gemma 3: one dict per layer type; the global layers' base is its rope_theta
        params = params["full_attention"] or {}
    return float(params["rope_theta"] if "rope_theta" in params else hf.rope_theta)


def _rope_parameters(hf: PretrainedConfig) -> dict:
    """``rope_parameters`` as HF reads it: transformers 5 only (in 4.x the key is an unread attribute)."""
    return (getattr(hf, "rope_parameters", None) or {}) if TRANSFORMERS_5 else {}


def _rope_theta(raw: dict, hf: PretrainedConfig, path: Path) -> float:
    """The theta HF itself will use, after checking on the raw file that HF will not fill in 10000 silently."""
    nested = "rope_theta" in (raw.get("rope_parameters") or {})
    if "rope_theta" not in raw and not nested:
        raise ConfigError(f"{path}: no rope_theta (neither 'rope_theta' nor 'rope_parameters.rope_theta'); "
                          "impl does not guess a default")
    if "rope_theta" not in raw and not TRANSFORMERS_5:
        raise ConfigError(f"{path}: rope_theta is only in 'rope_parameters' (the transformers 5 layout); "
                          f"transformers {transformers.__version__} reads the top-level 'rope_theta' and would use "
                          "10000: add a top-level rope_theta or use transformers >= 5")
    return hf_rope_theta(hf)


def _rope_scaling(hf: PretrainedConfig, path: Path) -> Llama3RopeScaling | None:
    """The RoPE frequency scaling HF will apply: None for the default RoPE, the llama3 parameters for
    ``rope_type: llama3``; any other type is refused. transformers 5 reads them from ``rope_parameters``
    (where it also merges a legacy ``rope_scaling``), 4.x from ``rope_scaling``."""
    params = _rope_parameters(hf)
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{path}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    src = params if TRANSFORMERS_5 else scaling
    partial = src.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{path}: partial_rotary_factor={partial} is not supported (RoPE over the whole head)")
    if kind == "default":
        return None
    missing = [k for k in _LLAMA3_KEYS if src.get(k) is None]
    if missing:
        raise ConfigError(f"{path}: rope type 'llama3' needs {', '.join(missing)} in its rope parameters")
    s = Llama3RopeScaling(float(src["factor"]), float(src["low_freq_factor"]), float(src["high_freq_factor"]),
                          int(src["original_max_position_embeddings"]))
    if s.high_freq_factor <= s.low_freq_factor:  # the interpolation divides by their difference
        raise ConfigError(f"{path}: llama3 rope needs high_freq_factor > low_freq_factor, got "
                          f"{s.high_freq_factor} <= {s.low_freq_factor}")
    return s


def _sliding_windows(family: Family, hf: PretrainedConfig, path: Path) -> tuple[int | None, ...]:
    """Per layer, the sliding window HF's attention uses (None: full causal attention); ``()`` when no layer
    has one. A window of at least ``max_position_embeddings`` can never hide a key (impl refuses longer
    sequences), so it is dropped."""
    n = hf.num_hidden_layers
    if family.sliding in ("refuse", "none"):  # "refuse" was checked on the raw file (``load_config``)
        return ()
    window = getattr(hf, "sliding_window", None)
    if family.sliding == "all":
        layers = [True] * n
    else:  # "layer_types": transformers >= 4.53 lists them; older versions derive them the same way
        types = getattr(hf, "layer_types", None)
        if types is None and family.gemma:
            types = gemma_layer_types(hf)
        if types is None:
            use = bool(getattr(hf, "use_sliding_window", False)) and window is not None
            types = ["sliding_attention" if use and i >= hf.max_window_layers else "full_attention" for i in range(n)]
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad or len(types) != n:
            raise ConfigError(f"{path}: layer_types {list(types)} not understood (expected {n} entries of "
                              "'full_attention' / 'sliding_attention')")
        layers = [t == "sliding_attention" for t in types]
    if window is None or not any(layers):
        return ()
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"{path}: sliding_window={window!r} is not a positive integer")
    if window >= hf.max_position_embeddings:
        return ()
    return tuple(window if s else None for s in layers)


@dataclass(frozen=True)
class ModelConfig:
    """The numbers impl needs, taken from the HF config (``hf``) of a checkpoint directory.

    The family options default to Qwen2's: q/k/v biases, no o_proj / MLP biases, no q/k norm, default RoPE,
    no sliding window."""

    hf: PretrainedConfig
    model_dir: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    model_type: str = "qwen2"
    qkv_bias: bool = True
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () = every layer attends to all its past
    moe: MoeConfig | None = None  # mixture of experts: the experts and which layers are sparse
    hidden_act: str = "silu"  # the MLP's gated activation (impl.layers.activation.ACTIVATIONS)
    gemma: GemmaOptions | None = None  # Gemma 3 (impl.gemma_config): local RoPE base, attention scale
    quant: Int8Scheme | GptqScheme | AwqScheme | None = None  # quantized linears (impl.quant*); None: float

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def sliding_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: full causal attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of decoder layer ``layer``: Gemma 3's sliding layers have their own (``rope_local_base_freq``)."""
        if self.gemma is not None and self.sliding_window(layer) is not None:
            return self.gemma.rope_local_theta
        return self.rope_theta

    @property
    def attn_scale(self) -> float:
        """The softmax scale of the attention scores: ``head_dim ** -0.5``, Gemma 3's ``query_pre_attn_scalar ** -0.5``."""
        return self.gemma.attn_scale if self.gemma is not None else self.head_dim ** -0.5

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a mixture-of-experts block (else a dense MLP)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def check_tp(self, tp: int, ep: int = 1) -> None:
        """Refuse a TP size (and expert-parallel size ``ep``) the head, MLP and expert layout cannot be split
        over, with the numbers."""
        if tp < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by tp_size={tp}")
        if self.moe is not None:
            self.moe.check_layout(tp, ep)
        elif ep != 1:
            raise ConfigError(f"ep_size={ep} needs a mixture-of-experts model; model_type {self.model_type!r} has "
                              "no experts")
        dense = self.moe is None or self.moe.has_dense_layers  # MoE models may have no dense MLP at all
        if dense and self.intermediate_size % tp:
            raise ConfigError(f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp}")
        kv = self.num_kv_heads
        if tp <= kv and kv % tp:
            raise ConfigError(f"num_key_value_heads={kv} is not divisible by tp_size={tp}")
        if tp > kv and tp % kv:
            raise ConfigError(f"tp_size={tp} > num_key_value_heads={kv} needs tp_size % num_key_value_heads == 0 "
                              "to replicate KV heads")


MAX_LAYERS = 10_000  # a hostile num_hidden_layers must not reach a range()
_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
          "vocab_size", "max_position_embeddings")


def _check_sizes(hf: PretrainedConfig, path: Path) -> None:
    """Every size impl and tpcheck build from is a positive integer (a bound on the layer count); head_dim even."""
    for key in _SIZES:
        v = getattr(hf, key, None)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{path}: {key} must be a positive integer, got {v!r}")
    if hf.num_hidden_layers > MAX_LAYERS:
        raise ConfigError(f"{path}: num_hidden_layers={hf.num_hidden_layers} is beyond any model (at most {MAX_LAYERS})")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is None and hf.hidden_size % hf.num_attention_heads:
        raise ConfigError(f"{path}: hidden_size={hf.hidden_size} is not divisible by num_attention_heads="
                          f"{hf.num_attention_heads} (and no head_dim)")
    head_dim = head_dim if head_dim is not None else hf.hidden_size // hf.num_attention_heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ConfigError(f"{path}: head_dim must be an even positive integer (RoPE rotates pairs), got {head_dim!r}")
    if hf.num_attention_heads % hf.num_key_value_heads:
        raise ConfigError(f"{path}: num_attention_heads={hf.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads={hf.num_key_value_heads}")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` of a checkpoint directory of a family in ``FAMILIES``; anything else is refused."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply, a 5000-digit integer
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"{path}: model_type is {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    if family.sliding == "refuse" and raw.get("use_sliding_window"):
        raise ConfigError(f"{path}: use_sliding_window=true is not supported for model_type {model_type!r}")
    cls = family.hf_config_class(path)
    try:
        hf = cls.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - HF's own validation (transformers 5's strict dataclass errors are not
        # ValueErrors): a config HF refuses is the checkpoint's fault, named, never an internal error
        first = " ".join(str(e).split())[:300]  # HF's message spans lines: one line, the details kept
        raise ConfigError(f"{path}: transformers' {cls.__name__} refuses it: {type(e).__name__}: {first}") from None
    _check_sizes(hf, path)
    if family.gemma:
        theta, gemma = read_gemma(raw, hf, path, TRANSFORMERS_5)
        scaling = None
    else:
        theta, gemma, scaling = _rope_theta(raw, hf, path), None, _rope_scaling(hf, path)
    act = getattr(hf, family.act_key, "silu")
    if act not in ACTIVATIONS:  # another activation would be computed wrongly, not refused
        raise ConfigError(f"{path}: {family.act_key}={act!r} is not supported (only {', '.join(map(repr, ACTIVATIONS))})")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qkv_bias, o_bias = family_biases(family, hf)
    moe = read_moe(family.moe, raw, hf, path, model_type) if family.moe is not None else None
    quant = _quant(raw, path, moe)
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        hf=hf, model_dir=str(model_dir), hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, vocab_size=hf.vocab_size, rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps, max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings), eos_token_ids=eos_ids,
        model_type=model_type, qkv_bias=qkv_bias, o_proj_bias=o_bias,
        mlp_bias=family.mlp_bias and bool(getattr(hf, "mlp_bias", False)), qk_norm=family.qk_norm,
        rope_scaling=scaling, sliding_windows=_sliding_windows(family, hf, path), moe=moe, quant=quant,
        hidden_act=act, gemma=gemma,
    )


def _quant(raw: dict, path: Path, moe: MoeConfig | None) -> Int8Scheme | GptqScheme | AwqScheme | None:
    """The checkpoint's quantization scheme (``impl.quant``), refused with the field at fault and the path."""
    try:
        quant = parse_quantization_config(raw.get("quantization_config"))
    except QuantConfigError as e:
        raise QuantConfigError(f"{path}: {e}") from None
    if quant is not None and moe is not None:
        raise QuantConfigError(f"{path}: a quantized mixture-of-experts model is not supported yet "
                               f"(quantization_config with model_type {raw.get('model_type')!r})")
    return quant
