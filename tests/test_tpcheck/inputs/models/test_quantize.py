"""tpcheck.inputs.models.quantize: compressed-tensors INT8 W8A8 checkpoints (no vLLM here: the format's dict is checked
against what compressed-tensors dumps, written down in the module; vLLM loading it was checked by hand)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tpcheck.cli.app import main
from tpcheck.inputs.models.quantize import (
    KV_CACHE, LINEAR_WEIGHT, SCHEMES, STATIC, quantization_config, quantize_checkpoint, quantize_weight, quantized_names, weight_scale,
)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module", params=[s for s in SCHEMES if s not in KV_CACHE])  # KV caches: test_quantize_kv.py
def quantized(request, ckpt, tmp_path_factory):
    """(scheme, source dir, quantized dir) of the untied 3-layer preset (it has an lm_head and qkv biases)."""
    src = ckpt("tiny-untied")
    return request.param, src, quantize_checkpoint(src, tmp_path_factory.mktemp("q") / "out", request.param)


def test_every_linear_is_quantized_and_round_trips(quantized):
    scheme, src, dst = quantized
    a, b = _tensors(src), _tensors(dst)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    want = sorted(f"model.layers.{i}.{m}.weight" for i in range(layers) for m in LINEARS)
    assert quantized_names(dst) == want
    assert [p.name for p in sorted(dst.glob("*.safetensors"))] == ["model.safetensors"]
    for name in want:
        w, q, scale = a[name], b[name], b[name + "_scale"]
        fp8 = "fp8" in scheme
        assert q.dtype == (torch.float8_e4m3fn if fp8 else torch.int8) and q.shape == w.shape
        assert scale.dtype == torch.float32
        assert scale.shape == ((w.shape[0], 1) if scheme in ("w8a8-int8", "w8a8-fp8") else (1,))
        assert (scale > 0).all()
        err = (q.double() * scale.double() - w.double()).abs()
        # dequantized with the stored scale: within half a step (e4m3: 2^-4 of |q|, 2^-10 among subnormals)
        step = torch.clamp(q.double().abs() / 16, min=2 ** -10) if fp8 else torch.full_like(err, 0.5)
        assert (err <= step * scale.double() * (1 + 1e-6)).all(), name
        top = 448 if fp8 else 127
        assert float(q.double().abs().max()) == top  # the absmax maps to the top exactly (per row, or per tensor)
        if scheme in ("w8a8-int8", "w8a8-fp8"):
            assert (q.double().abs().amax(dim=1) == top).all()
        if scheme in STATIC:
            s_x = b[name.removesuffix("weight") + "input_scale"]
            assert s_x.dtype == torch.float32 and s_x.shape == (1,) and s_x.item() > 0


def test_other_tensors_unchanged_bit_for_bit(quantized):
    scheme, src, dst = quantized
    a, b = _tensors(src), _tensors(dst)
    quant = set(quantized_names(dst))
    static = {n.removesuffix("weight") + "input_scale" for n in quant} if scheme in STATIC else set()
    assert set(b) == set(a) | {n + "_scale" for n in quant} | static
    kept = [n for n in a if n not in quant]
    assert "lm_head.weight" in kept and "model.embed_tokens.weight" in kept and "model.norm.weight" in kept
    assert any(n.endswith("q_proj.bias") for n in kept)
    for n in kept:
        assert b[n].dtype == a[n].dtype and torch.equal(b[n].view(torch.uint8), a[n].view(torch.uint8)), n


def test_config_has_the_compressed_tensors_entry(quantized):
    scheme, src, dst = quantized
    cfg, orig = json.loads((dst / "config.json").read_text()), json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == orig
    assert qc == quantization_config(scheme)
    fp8 = "fp8" in scheme
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == ("float-quantized" if fp8 else "int-quantized")
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"] is None
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    w, x = group["weights"], group["input_activations"]
    kind = "float" if fp8 else "int"
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, kind, True, False)
    assert w["strategy"] == ("channel" if scheme in ("w8a8-int8", "w8a8-fp8") else "tensor")
    static = scheme in STATIC
    assert (x["num_bits"], x["type"], x["symmetric"], x["strategy"], x["dynamic"]) == \
        (8, kind, True, "tensor" if static else "token", not static)


def test_safetensors_layout_is_aligned_with_pt_metadata(quantized):
    _, _, dst = quantized
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = (dst / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    size = {"F32": 4, "I8": 1}
    for name, h in header.items():
        assert h["data_offsets"][0] % size.get(h["dtype"], 1) == 0, name


def test_quantization_math_on_edge_cases():
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-2.54, 1.27, 0.0]], dtype=torch.float32)
    s = weight_scale(w, "w8a8-int8")
    assert s[0, 0] == 1.0  # an all-zero row: scale 1, q 0
    assert s[1, 0] == torch.tensor(1.0 / 127, dtype=torch.float64).float()
    q = quantize_weight(w, s)
    assert q[0].tolist() == [0, 0, 0] and q[1, 0] == 127 and q[2, 0] == -127
    assert weight_scale(torch.zeros(4, 4), "w8a8-int8-tensor").tolist() == [1.0]
    # half to even: 0.5 and 2.5 steps round down to 0 and 2, 1.5 up to 2
    half = torch.tensor([[127.0, 0.5, 1.5, 2.5]], dtype=torch.float64)
    assert quantize_weight(half, torch.ones(1, 1)).tolist() == [[127, 0, 2, 2]]
    bf = torch.randn(16, 8).to(torch.bfloat16)
    sb = weight_scale(bf, "w8a8-int8")
    assert ((quantize_weight(bf, sb).double() * sb.double() - bf.double()).abs() <= sb.double() / 2).all()


def test_deterministic_byte_identical(ckpt, tmp_path):
    src = ckpt("tiny")
    a = quantize_checkpoint(src, tmp_path / "a", "w8a8-int8")
    b = quantize_checkpoint(src, tmp_path / "b", "w8a8-int8")
    for f in ("model.safetensors", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_sharded_bf16_source_and_other_files_copied(tmp_path):
    from tpcheck.inputs.models.checkpoints import make_checkpoint
    src = make_checkpoint("tiny", tmp_path / "src", dtype="bfloat16", shards=3)
    (src / "generation_config.json").write_text('{"eos_token_id": 2}\n')
    (src / "tokenizer.json").write_text("{}\n")
    (src / "pytorch_model.bin").write_bytes(b"float weights")  # another copy of the float weights: left out
    dst = quantize_checkpoint(src, tmp_path / "q", "w8a8-int8-tensor")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    assert (dst / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    a, b = _tensors(src), _tensors(dst)
    assert len(quantized_names(dst)) == 14
    for n in quantized_names(dst):
        err = (b[n].double() * b[n + "_scale"].double() - a[n].double()).abs()
        assert (err <= b[n + "_scale"].double() / 2).all()
    assert b["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(b["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_refusals(ckpt, tmp_path):
    src = ckpt("tiny")
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'int4'.*w8a8-int8, w8a8-int8-tensor"):
        quantize_checkpoint(src, tmp_path / "x", "int4")
    with pytest.raises(ValueError, match=r"mixture-of-experts model \(num_experts=8\).*not supported yet"):
        quantize_checkpoint(ckpt("tiny-qwen2-moe"), tmp_path / "x", "w8a8-int8")
    with pytest.raises(ValueError, match=r"num_local_experts.*not supported yet"):
        quantize_checkpoint(ckpt("tiny-mixtral"), tmp_path / "x", "w8a8-int8")
    done = quantize_checkpoint(src, tmp_path / "done", "w8a8-int8")
    with pytest.raises(ValueError, match=r"already quantized.*quantization_config.*compressed-tensors"):
        quantize_checkpoint(done, tmp_path / "x", "w8a8-int8")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"destination .*full exists and is not an empty directory"):
        quantize_checkpoint(src, full, "w8a8-int8")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert quantize_checkpoint(src, empty, "w8a8-int8") == empty  # an empty destination is fine
    assert not list(tmp_path.glob(".*tmp-*"))  # no temporary directory left behind, refused or not


def test_refuses_a_non_float_linear_weight(ckpt, tmp_path):
    src = _copy(ckpt("tiny"), tmp_path / "src")
    t = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    t[name] = t[name].to(torch.int32)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {name.replace('.', '[.]')}: expected a 2-D float weight, found I32"):
        quantize_checkpoint(src, tmp_path / "x", "w8a8-int8")
    assert not (tmp_path / "x").exists()


def test_refuses_an_unknown_projection_and_non_finite_weights(ckpt, tmp_path):
    src = _copy(ckpt("tiny"), tmp_path / "src")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(4, 4)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj.weight: a projection weight this quantizer does not know"):
        quantize_checkpoint(src, tmp_path / "x", "w8a8-int8")
    del t["model.layers.0.self_attn.qkv_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj.weight: has inf or nan"):
        quantize_checkpoint(src, tmp_path / "x", "w8a8-int8")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*tmp-*"))


def test_linear_weight_pattern():
    assert LINEAR_WEIGHT.fullmatch("model.layers.12.self_attn.o_proj.weight")
    assert LINEAR_WEIGHT.fullmatch("model.layers.0.mlp.gate_proj.weight")
    for n in ("lm_head.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.experts.0.up_proj.weight",
              "model.layers.0.self_attn.q_norm.weight", "model.embed_tokens.weight"):
        assert not LINEAR_WEIGHT.fullmatch(n), n


def test_cli_preset_and_model(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["make-checkpoint", "--preset", "tiny", "--quantize", "w8a8-int8-tensor", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "w8a8-int8-tensor" in printed and "14 linear weights" in printed
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["strategy"] == "tensor"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # the float checkpoint was a temporary
    flt = tmp_path / "float"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(flt)]) == 0
    assert not json.loads((flt / "config.json").read_text()).get("quantization_config")
    capsys.readouterr()
    q2 = tmp_path / "q2"
    assert main(["make-checkpoint", "--model", str(flt), "--quantize", "w8a8-int8", "--out", str(q2)]) == 0
    assert "14 linear weights" in capsys.readouterr().out
    assert len(quantized_names(q2)) == 14


def test_cli_bad_input_exits_2(tmp_path, capsys):
    flt = tmp_path / "float"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(flt)]) == 0
    capsys.readouterr()
    assert main(["make-checkpoint", "--model", str(flt), "--out", str(tmp_path / "x")]) == 2
    assert "--model SRC_DIR needs --quantize" in capsys.readouterr().err
    assert main(["make-checkpoint", "--model", str(flt), "--quantize", "w8a8-int8", "--seed", "3",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--seed" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", "tiny", "--quantize", "w8a8-int8", "--out", str(flt)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", "tiny-mixtral", "--quantize", "w8a8-int8",
                 "--out", str(tmp_path / "x")]) == 2
    assert "not supported yet" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["float"]
    for argv in (["--out", str(tmp_path / "x")], ["--preset", "tiny", "--model", str(flt), "--out", "x"],
                 ["--preset", "tiny", "--quantize", "int4", "--out", "x"]):
        with pytest.raises(SystemExit) as e:  # argparse: usage and exit 2
            main(["make-checkpoint", *argv])
        assert e.value.code == 2
