"""SGLang's dumper on Gemma 3 (``rules.toml``'s Gemma rules): its four norms a layer, q and k read where attention
takes them (SGLang hands them over per head, ``[1, tokens, heads, head_dim]``), its RoPE tables and copies left out;
a rule restricted to a model_type or a dumper applies to those alone. impl's tp 2 runs of ``tiny-gemma3`` (one KV
head: replicated) written in SGLang's layout are judged with the same rows as tpcheck's own dump of them. The
per-head q / k norms are not read (on GPUs SGLang's run on ``[1, heads, tokens, head_dim]``: no tokens-first
annotation fits), as for Qwen3."""
from __future__ import annotations

import re

import pytest
import torch

from tpcheck.cli.app import main
from tpcheck.engines.sglang_dump import rules as name_rules
from tpcheck.engines.sglang_dump.files import load_file, parse_filename
from tpcheck.engines.sglang_dump.writer import FileSink, write_from_dump
from sglang_runs import compare, tp2_dumps
from tpcheck.inputs.models.presets import preset_available

pytestmark = pytest.mark.skipif(not preset_available("tiny-gemma3"), reason="this transformers has no Gemma 3")

# what SGLang's non-intrusive dumper writes of a Gemma 3 step besides the points: the model's RoPE tables (cos,
# sin of the global and the sliding layers), the per-head q/k norms, attention's v input (a copy of qkv's v)
EXTRAS = ("non_intrusive__model.rotary_emb.output.0", "non_intrusive__model.rotary_emb.output.1",
          "non_intrusive__model.rotary_emb_local.output.0", "non_intrusive__model.rotary_emb_local.output.1",
          "non_intrusive__model.layers.0.self_attn.q_norm.output",
          "non_intrusive__model.layers.1.self_attn.attn.inputs.2")


class WithExtras(FileSink):
    """A ``FileSink`` that also writes, each step, what SGLang dumps of Gemma 3 that is not a point; and
    ``positions`` again as ``[1, tokens]``, as the dumper does wherever a module takes it as a keyword (Gemma 3's
    layers and attention on GPUs, after ``rearrange(positions, "s -> 1 s")``)."""

    def dump(self, rank, name, value, dims, tags):
        super().dump(rank, name, value, dims, tags)
        if name == "input_ids":
            for extra in EXTRAS:
                super().dump(rank, extra, torch.ones(len(value), 4), None, {})
        if name == "positions":
            super().dump(rank, name, value[None], None, {"layer_id": 0})


@pytest.fixture(scope="module")
def gemma_runs(ckpt, engines, tmp_path_factory):
    """impl at tp 2 on Gemma 3, 2 prompts, 2 decode steps, local pass on: tpcheck's dump, clean and with a fault."""
    root = tmp_path_factory.mktemp("sglang-gemma")
    d = ckpt("tiny-gemma3")
    tp2_dumps(root, d, engines, "gemma_norm_without_offset")
    return root, d


@pytest.mark.parametrize("spelling", ["none", "new"])
def test_an_sglang_dump_of_gemma3_judges_like_tpcheck_s_own(gemma_runs, tmp_path, capsys, spelling):
    root, d = gemma_runs
    for name in ("clean", "fault"):
        sg = tmp_path / name
        write_from_dump(root / name, str(d), WithExtras(sg, 2), spelling)
        capsys.readouterr()
        rc, ours = compare(sg, d, tmp_path / f"{name}.json", "--format", "sglang")
        names = capsys.readouterr().out
        assert re.search(r"names: +\d+ mapped to points, \d+ not compared by a rule, 0 unmapped", names), names
        for extra in EXTRAS:
            assert f"not compared: {extra}" in names
        rc0, theirs = compare(root / name, d, tmp_path / f"{name}0.json")
        assert (rc, rc0) == ((0, 0) if name == "clean" else (1, 1))
        got = {(r["point"], r["step"], r["mode"]): (r["rel_err"], r["excess"]) for r in ours["rows"]}
        want = {(r["point"], r["step"], r["mode"]): (r["rel_err"], r["excess"]) for r in theirs["rows"]
                if ".kv." not in r["point"] and r["point"] != "logits" and not r["point"].endswith(("q_norm", "k_norm"))}
        assert {k: got[k] for k in want} == want  # the same tensors, unsharded alike, judged alike
        kinds = {p.split(".", 2)[-1] for p, _, _ in got}
        assert {"attn.post_norm", "post_attn_norm", "attn.residual", "mlp.post_norm", "attn.q_rope",
                "attn.k_rope"} <= kinds
    assert ours["first_divergence"]["point"] == theirs["first_divergence"]["point"]
    assert ours["first_divergence"]["point"].endswith("norm")


def test_q_and_k_are_written_per_head_as_sglang_hands_them_to_attention(gemma_runs, tmp_path):
    root, d = gemma_runs
    sg = tmp_path / "s"
    write_from_dump(root / "clean", str(d), FileSink(sg, 2), "none")
    files = sorted((sg / "dump_tpcheck").iterdir())
    q = next(p for p in files if "name=non_intrusive__model.layers.1.self_attn.attn.inputs.0___" in p.name)
    k = next(p for p in files if "name=non_intrusive__model.layers.1.self_attn.attn.inputs.1___" in p.name)
    qv, kv = load_file(parse_filename(q)), load_file(parse_filename(k))
    assert qv[0].shape[0] == 1 and list(qv[0].shape[2:]) == [2, 32]  # 4 heads over 2 ranks, head_dim 32
    assert list(kv[0].shape[2:]) == [1, 32]  # the one KV head, on each rank
    assert "dims" not in qv[1]  # the non-intrusive dumper writes none: the rule's annotation reads it


def _rule_point(model_type, engine, name):
    rules = name_rules.for_run(name_rules.load_rules(), model_type, engine)
    m = name_rules.match(rules, name, None, 18, "f")
    return None if m is None else m.point


def test_gemma_rules_apply_to_gemma_alone_and_the_vllm_embedding_is_not_compared():
    post = "non_intrusive__model.layers.3.post_attention_layernorm.output"
    assert _rule_point("gemma3_text", "sglang", post) == "layers.3.attn.post_norm"
    assert _rule_point("llama", "sglang", post) is None  # a Llama layer's is a fused add + norm: .output.0 / .1
    assert _rule_point("llama", "sglang", post + ".0") == "layers.3.post_attn_norm"
    q = "non_intrusive__model.layers.3.self_attn.attn.inputs.0"
    assert _rule_point("gemma3_text", "vllm", q) == "layers.3.attn.q_rope"
    assert _rule_point("llama", "sglang", q) is None  # Llama's q after RoPE is its rotary_emb's output
    rope = "non_intrusive__model.layers.3.self_attn.rotary_emb.output.0"
    assert _rule_point("llama", "sglang", rope) == "layers.3.attn.q_rope"
    assert _rule_point("gemma3_text", "sglang", rope) is None  # a copy of attention's input there
    embed = "non_intrusive__model.embed_tokens.output"
    assert _rule_point("gemma3_text", "sglang", embed) == "embed"  # SGLang's module scales it
    assert _rule_point("gemma3_text", "vllm", embed) is None  # vLLM scales it after the module
    assert _rule_point("llama", "vllm", embed) == "embed"
    # no checkpoint (two dumps compared with each other): a rule for some models only where no other matches
    assert _rule_point(None, None, rope) == "layers.3.attn.q_rope"
    assert _rule_point(None, None, post) == "layers.3.attn.post_norm"


def test_a_rule_s_dims_alternatives_are_chosen_by_the_tensor_s_dims(tmp_path):
    rule = next(r for r in name_rules.load_rules() if r.point == "layers.{layer}.attn.q_rope" and r.model_types)
    assert rule.dims_for(4).text == "b s h[tp] d" and rule.dims_for(2).text == "t h[tp]"
    assert rule.dims_for(3).text == "b s h[tp] d"  # none fits: the first, whose misfit assemble names
    bad = tmp_path / "r.toml"
    bad.write_text("[[rule]]\nname = 'x'\npoint = ''\nengine = 'trt'\n")
    with pytest.raises(Exception, match="engine \\['trt'\\] is not one of"):
        name_rules.load_rules([bad])
    bad.write_text("[[rule]]\nname = 'x'\npoint = ''\nmodel_type = 3\n")
    with pytest.raises(Exception, match="model_type must be a string or a list of strings"):
        name_rules.load_rules([bad])


def test_two_gemma3_dumps_compared_without_a_golden(gemma_runs, tmp_path, capsys):
    """No checkpoint, so no model_type: the Gemma rules come after the rest, and every name SGLang dumps of Gemma 3
    is still mapped or left out by a rule; a fault parts the two first at a norm (exit 1)."""
    root, d = gemma_runs
    for name in ("clean", "fault"):
        write_from_dump(root / name, str(d), WithExtras(tmp_path / name, 2), "none")
    write_from_dump(root / "clean", str(d), WithExtras(tmp_path / "annotated", 2), "new")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "clean"), str(tmp_path / "annotated")]) == 0  # the same numbers
    assert main(["compare", str(tmp_path / "clean"), str(tmp_path / "fault")]) == 1
    out = capsys.readouterr().out
    assert "UNMAPPED" not in out
    assert re.search(r"PART: first at step 0, non_intrusive__model\.layers\.0\.\w+\.output", out), out
