"""Every file tpcheck reads is untrusted: a saved golden or a dump that was changed, copied into the wrong place
or written for another checkpoint is exit 2 naming the file (and the tensor or field), never a pass and never a
divergence blamed on the engine."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tpcheck
from tpcheck.cli.app import main
from tpcheck.inputs.files.validate import tensor_record

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


def _ids(prompts=PROMPTS):
    return sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), [])


@pytest.fixture(scope="module")
def golden(ckpt, engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("golden") / "g"
    tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=PROMPTS, decode_steps=1, pool=engines, save_golden=str(root))
    return root


@pytest.fixture(scope="module")
def dump(ckpt, engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("dump") / "d"
    tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=PROMPTS, decode_steps=1, pool=engines, dump=str(root))
    return root


def _edit_tensor(path, name, fn, rehash_json=None, step=0):
    """Change one tensor of a safetensors file; with ``rehash_json`` (golden.json or a dump step JSON) also
    rewrite its record, as someone who knows the format would."""
    tensors = load_file(str(path))
    tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, str(path))
    if rehash_json is not None:
        meta = json.loads(rehash_json.read_text())
        records = meta["tensors"][step] if isinstance(meta["tensors"], list) else meta["tensors"]
        records[name] = tensor_record(tensors[name])
        rehash_json.write_text(json.dumps(meta))


def _replay(ckpt, root, capsys, *extra) -> tuple[int, str]:
    code = main(["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--decode-steps", "1", "--golden", str(root),
                 *_ids(), *extra])
    return code, capsys.readouterr().err


def _copy(src, tmp_path, name="x"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_a_changed_golden_tensor_is_refused_by_its_hash(golden, ckpt, tmp_path, capsys):
    g = _copy(golden, tmp_path)
    _edit_tensor(g / "step0.safetensors", "layers.1.mlp.out", lambda t: t * 1.5)
    code, err = _replay(ckpt, g, capsys)
    assert code == 2 and "step0.safetensors: layers.1.mlp.out: content hash differs" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("change,needle", [
    (lambda t: t * 1.5, "layers.1.mlp.out: HF at float32 is"),                # scaled, re-hashed
    (lambda t: t[:, :-1], "layers.1.mlp.out: golden shape"),                  # wrong shape, re-hashed
])
def test_a_wrong_but_rehashed_golden_is_refused_by_the_reference(golden, ckpt, tmp_path, capsys, change, needle):
    g = _copy(golden, tmp_path)
    _edit_tensor(g / "step0.safetensors", "layers.1.mlp.out", change, g / "golden.json")
    code, err = _replay(ckpt, g, capsys)
    assert code == 2 and needle in err, err


def test_a_golden_one_percent_off_cannot_raise_the_floor(golden, ckpt, tmp_path, capsys):
    g = _copy(golden, tmp_path)
    for s in (0, 1):
        names = list(load_file(str(g / f"step{s}.safetensors")))
        for n in names:
            _edit_tensor(g / f"step{s}.safetensors", n, lambda t: t * 1.01, g / "golden.json", step=s)
    code, err = _replay(ckpt, g, capsys, "--inject", "allreduce_low_precision")
    assert code == 2 and "above the" in err and "the golden is wrong" in err


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.pop("tensors") and m, "no 'tensors'"),
    (lambda m: [m], "expected a JSON object"),
    (lambda m: {**m, "num_layers": 10**9}, "num_layers must be an integer"),
    (lambda m: {**m, "format": "2"}, "'format' must be an int"),
])
def test_a_malformed_golden_json_is_named(golden, ckpt, tmp_path, capsys, edit, needle):
    g = _copy(golden, tmp_path)
    (g / "golden.json").write_text(json.dumps(edit(json.loads((g / "golden.json").read_text()))))
    code, err = _replay(ckpt, g, capsys)
    assert code == 2 and "golden.json" in err and needle in err, err


def test_a_golden_without_logits_is_named(golden, ckpt, tmp_path, capsys):
    g = _copy(golden, tmp_path)
    tensors = load_file(str(g / "step0.safetensors"))
    del tensors["logits"]
    save_file(tensors, str(g / "step0.safetensors"))
    meta = json.loads((g / "golden.json").read_text())
    del meta["tensors"][0]["logits"]
    (g / "golden.json").write_text(json.dumps(meta))
    code, err = _replay(ckpt, g, capsys)
    assert code == 2 and "step0.safetensors: no 'logits'" in err


def _compare(ckpt, d, capsys, preset="tiny") -> tuple[int, str]:
    code = main(["compare", str(d), "--model", str(ckpt(preset))])
    return code, capsys.readouterr().err


def test_a_rank_directory_holding_another_ranks_files_is_named(dump, ckpt, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    shutil.rmtree(d / "rank1")
    shutil.copytree(d / "rank0", d / "rank1")
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "rank1/step0.json: says rank 0 step 0, but sits in rank1/step0" in err


def test_an_int8_tensor_in_a_float_dump_is_named(dump, ckpt, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    step = d / "rank1" / "step0.safetensors"
    _edit_tensor(step, "layers.0.out", lambda t: t.to(torch.int8))
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "rank1/step0.safetensors: layers.0.out: dtype int8" in err
    _edit_tensor(step, "layers.0.out", lambda t: t, d / "rank1" / "step0.json")  # re-hashed: still refused
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "a torch.int8 tensor in a float32 dump" in err


def _edit_meta(d, fn, rank=0, step=0):
    path = d / f"rank{rank}" / f"step{step}.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


@pytest.mark.parametrize("edit,needle", [
    (lambda m: {**m, "tp": 10**9}, "rank0/step0.json: tp must be an integer in [1, 4096]"),
    (lambda m: {**m, "format": "2"}, "rank0/step0.json: 'format' must be an int"),
    (lambda m: {**m, "placements": {**m["placements"], "layers.0.attn.out": {"type": "shard", "dim": 5}}},
     "layers.0.attn.out: Shard dim 5 is outside"),
    (lambda m: {**m, "placements": {**m["placements"], "layers.0.attn.": {"type": "fused", "parts": [
        ["q", 3, {"type": "shard", "dim": -1}]]}}}, "Fused widths sum to 3"),
    (lambda m: {**m, "tokens": [[10**6] + m["tokens"][0][1:], m["tokens"][1]]}, "token id must be an integer in"),
])
def test_malformed_dump_meta_is_named(dump, ckpt, tmp_path, capsys, edit, needle):
    d = _copy(dump, tmp_path)
    for r in (0, 1):
        _edit_meta(d, edit, rank=r)
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and needle in err, err
    assert "Traceback" not in err


def test_deeply_nested_or_huge_json_is_named(dump, ckpt, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    path = d / "rank0" / "step0.json"
    text = path.read_text()
    path.write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "rank0/step0.json: JSON nested" in err
    path.write_text(text[:-1] + ', "x": ' + "9" * 5000 + "}")
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "rank0/step0.json: not valid JSON: an integer of 5000 digits" in err


def test_unequal_rows_across_ranks_are_named(dump, ckpt, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    _edit_tensor(d / "rank1" / "step0.safetensors", "layers.0.attn.out", lambda t: t[:-1], d / "rank1" / "step0.json")
    code, err = _compare(ckpt, d, capsys)
    assert code == 2 and "rank1/step0.safetensors: layers.0.attn.out: 7 rows, other ranks' 8" in err


def test_a_dump_of_another_checkpoint_is_named(dump, ckpt, capsys):
    code, err = _compare(ckpt, dump, capsys, preset="tiny-untied")
    assert code == 2 and "model_fingerprint is not that of --model" in err


def test_a_step_whose_rows_disagree_with_its_tokens_is_refused_before_any_comparison(dump, ckpt, tmp_path, capsys):
    d = _copy(dump, tmp_path)
    for r in (0, 1):  # a row more than the step's 8 tokens, re-hashed: the file agrees with its hash, not its tokens
        _edit_tensor(d / f"rank{r}" / "step0.safetensors", "embed", lambda t: torch.cat([t, t[-1:]]),
                     d / f"rank{r}" / "step0.json")
    code, err = _compare(ckpt, d, capsys)
    assert code == 2, err
    assert "rank0/step0.safetensors: embed: 9 rows, but an embed point has a row per token: the 8 tokens " \
           "step0.json records" in err, err
    assert "origin" not in err and "Traceback" not in err
