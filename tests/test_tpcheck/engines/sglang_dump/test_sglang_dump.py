"""SGLang's dumper format read by ``tpcheck compare --format sglang``: the safe loader and the file names, the dims
grammar (both spellings) driving the unsharding, the batches from the auxiliary dumps, and runs of impl at tp 2
written in the format (``tpcheck.engines.sglang_dump.writer``) judged with the same rows as tpcheck's own dump of the
same run, clean and with a seeded fault; bad dumps exit 2 naming the file."""
from __future__ import annotations

import os

import pytest
import torch

from impl.placements import Partial, Replicate, Shard
from tpcheck.capture.dump_format import DumpError
from tpcheck.cli.app import main
from tpcheck.engines.sglang_dump import sniff_format
from tpcheck.engines.sglang_dump.assemble import assemble
from tpcheck.engines.sglang_dump.batches import RequestIds, step_batch
from tpcheck.engines.sglang_dump.dims import parse_dims
from tpcheck.engines.sglang_dump.files import load_file, parse_filename
from tpcheck.engines.sglang_dump.writer import FileSink, write_from_dump
from sglang_runs import compare, tp2_dumps


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('I58_MARKER', '/nonexistent/x')}",))


def test_a_pickled_object_is_refused_and_never_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("I58_MARKER", str(marker))
    path = tmp_path / "step=0___rank=0___dump_index=1___name=x.pt"
    torch.save({"value": _Evil(), "meta": {}}, path)
    with pytest.raises(DumpError, match="refused.*weights_only") as e:
        load_file(parse_filename(path))
    assert str(path) in str(e.value) and not marker.exists()
    torch.save({"value": torch.ones(2), "meta": {"dims": torch.ones(1)}}, path)  # a tensor where metadata belongs
    with pytest.raises(DumpError, match="meta.dims is a Tensor"):
        load_file(parse_filename(path))


def test_file_names_and_meta_are_parsed_and_checked(tmp_path):
    f = parse_filename(tmp_path / "step=3___rank=1___dump_index=7___name=a.b___layer_id=2.pt")
    assert (f.step, f.rank, f.name, f.dump_index, f.tags["layer_id"]) == (3, 1, "a.b", 7, "2")
    for bad, why in (("rank=1___name=a.pt", "lacks the tags"), ("step=x___rank=1___name=a.pt", "integers"),
                     ("step=1___rank=1___name=a___oops.pt", "not key=value")):
        with pytest.raises(DumpError, match=why):
            parse_filename(tmp_path / bad)
    path = tmp_path / "step=0___rank=0___name=a.pt"
    torch.save({"value": torch.ones(2), "meta": {"rank": 1}}, path)  # a file of rank 1 renamed
    with pytest.raises(DumpError, match="meta says rank=1"):
        load_file(parse_filename(path))
    torch.save(torch.ones(3), path)  # an older dumper's bare value
    value, meta = load_file(parse_filename(path))
    assert torch.equal(value, torch.ones(3)) and meta == {}


def test_both_dims_spellings_mean_the_same():
    for new, old in (("t h[tp]", "t h(tp)"), ("b s[cp:zigzag] h[tp]", "b s(cp,zigzag) h(tp)"),
                     ("t h[tp:partial]", "t h(tp,partial)")):
        a, b = parse_dims(new, "f"), parse_dims(old, "f")
        assert a.dims == b.dims
    d = parse_dims("t (heads*d)[tp] 1 # dp:=attn_dp ep:replicated", "f")
    assert d.dims[1].name == "heads*d" and d.replicated == {"ep"} and d.dp_group == "attn_dp"
    for bad, why in (("t h[xp]", "unknown axis"), ("t h[tp:wobbly]", "unknown qualifier"), ("t h h", "twice"),
                     ("t h[tp] # tp:replicated", "both split and replicated"), ("t h(tp,cp)", "exactly one axis")):
        with pytest.raises(DumpError, match=why):
            parse_dims(bad, "file.pt")


def _info(**axes):
    return {a: (r, s) for a, (r, s) in axes.items() if s > 1}


def test_unsharding_concatenates_zigzags_sums_and_checks_replicas():
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # 8 tokens, 6 features
    chunks = full.chunk(4, dim=0)  # cp 2 zigzag: rank r holds chunks r and 3 - r
    entries = []
    for cp in range(2):
        for tp in range(2):
            local = torch.cat([chunks[cp], chunks[3 - cp]])[:, 3 * tp:3 * tp + 3]
            entries.append((f"f{cp}{tp}", local.clone(), _info(cp=(cp, 2), tp=(tp, 2))))
    placement, tensors = assemble("x", entries, parse_dims("t[cp:zigzag] h[tp]", "f"))
    assert placement == Shard(-1) and torch.equal(torch.cat(tensors, dim=-1), full)
    parts = [full / 2, full / 2]  # tp partial: the sum is the whole
    placement, tensors = assemble("x", [(f"f{r}", parts[r], _info(tp=(r, 2))) for r in range(2)],
                                  parse_dims("t h(tp,partial)", "f"))
    assert placement == Partial() and len(tensors) == 2
    sp = [(f"f{r}", full[4 * r:4 * r + 4] / 1, _info(sp=(r, 2))) for r in range(2)]  # sp over tokens, natural
    placement, tensors = assemble("x", sp, parse_dims("t[sp] h", "f"))
    assert placement == Replicate() and torch.equal(tensors[0], full)
    with pytest.raises(DumpError, match="f1: x differs from f0 along cp"):  # cp not annotated: replicas must agree
        assemble("x", [(f"f{r}", full + r, _info(cp=(r, 2))) for r in range(2)], parse_dims("t h", "f"))
    with pytest.raises(DumpError, match=r"no file of the rank\(s\) \[\{'tp': 1\}\]"):
        assemble("x", [("f0", full, _info(tp=(0, 2)))], parse_dims("t h[tp]", "f"))
    with pytest.raises(DumpError, match="name 3 dims, the tensor has 2"):
        assemble("x", [("f0", full, {})], parse_dims("t h d", "f"))
    with pytest.raises(DumpError, match="must lead the features"):
        assemble("x", [(f"f{r}", full.reshape(8, 2, 3), _info(tp=(r, 2))) for r in range(2)],
                 parse_dims("t d h[tp]", "f"))


def test_a_continuous_batch_is_split_into_requests_by_the_aux_dumps():
    ids = RequestIds()
    t = lambda *v: torch.tensor(v)  # noqa: E731
    # step 0: A prefills 3 tokens, B 2; step 1: A decodes at 3, C joins (slot of nobody), B decodes at 2
    b0 = step_batch({"input_ids": (t(5, 6, 7, 8, 9), "i"), "positions": (t(0, 1, 2, 0, 1), "p"),
                     "seq_lens": (t(3, 2), "s"), "req_pool_indices": (t(0, 1), "r")}, ids, 0)
    b1 = step_batch({"input_ids": (t(1, 2, 3, 4), "i"), "positions": (t(3, 0, 1, 2), "p"),
                     "seq_lens": (t(4, 2, 3), "s"), "req_pool_indices": (t(0, 2, 1), "r")}, ids, 1)
    assert b0.tokens == [[5, 6, 7], [8, 9]] and b0.starts == [0, 0]
    assert b1.tokens == [[1], [2, 3], [4]] and b1.starts == [3, 0, 2]
    assert b1.ids[0] == b0.ids[0] and b1.ids[2] == b0.ids[1] and b1.ids[1] not in b0.ids
    with pytest.raises(DumpError, match="do not run from"):
        step_batch({"input_ids": (t(1, 2), "i"), "positions": (t(0, 5), "p"), "seq_lens": (t(2,), "s"),
                    "rids": (["a"], "r")}, ids, 2)


@pytest.fixture(scope="module")
def runs(ckpt, engines, tmp_path_factory):
    """impl at tp 2 (dense), 2 prompts, 2 decode steps: tpcheck's dump, clean and with a fault in the ranks."""
    root = tmp_path_factory.mktemp("sglang")
    d = ckpt("tiny")
    tp2_dumps(root, d, engines, "skip_o_proj_allreduce", isolate=False)
    return root, d


@pytest.mark.parametrize("spelling", ["new", "old", "none"])
def test_an_sglang_dump_of_impl_judges_like_tpcheck_s_own(runs, tmp_path, spelling):
    root, d = runs
    for name in ("clean", "fault"):
        sg = tmp_path / name
        write_from_dump(root / name, str(d), FileSink(sg, 2), spelling, rids=name == "clean")
        assert sniff_format(sg) == "sglang" and sniff_format(root / name) == "tpcheck"
        rc, ours = compare(sg, d, tmp_path / f"{name}.json", "--format", "sglang")
        rc0, theirs = compare(root / name, d, tmp_path / f"{name}0.json")
        assert (rc, rc0) == ((0, 0) if name == "clean" else (1, 1))
        got = {(r["point"], r["step"], r["mode"]): (r["rel_err"], r["excess"]) for r in ours["rows"]}
        want = {(r["point"], r["step"], r["mode"]): (r["rel_err"], r["excess"]) for r in theirs["rows"]
                if ".kv." not in r["point"] and not (r["point"] == "logits")}
        assert {k: got[k] for k in want} == want  # the same tensors, unsharded alike, judged alike
    assert ours["first_divergence"]["point"] == theirs["first_divergence"]["point"] == "layers.0.attn.out"


def _files(sg, name_part):
    return [p for p in (sg / "dump_tpcheck").iterdir() if name_part in p.name]


def test_bad_sglang_dumps_exit_2_naming_the_file(runs, tmp_path, capsys):
    root, d = runs
    sg = tmp_path / "s"
    write_from_dump(root / "clean", str(d), FileSink(sg, 2))
    exp = sg / "dump_tpcheck"

    def refused(match: str):
        assert main(["compare", str(sg), "--model", str(d)]) == 2
        err = capsys.readouterr().err
        assert match in err, err
    unknown = exp / "step=0___rank=0___dump_index=999___name=my_probe___recompute_status=disabled.pt"
    torch.save({"value": torch.ones(12, 64), "meta": {}}, unknown)
    refused("my_probe")
    assert main(["compare", str(sg), "--model", str(d), "--allow-unmapped", "--no-isolate"]) == 0
    assert "UNMAPPED:     my_probe" in capsys.readouterr().out  # listed, not dropped silently
    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\nname = 'my_probe'\npoint = ''\n")
    assert main(["compare", str(sg), "--model", str(d), "--name-rules", str(rules), "--no-isolate"]) == 0
    assert "not compared: my_probe" in capsys.readouterr().out
    unknown.unlink()
    victim = next(p for p in _files(sg, "step=1___rank=1___") if "o_proj.output" in p.name)
    victim.rename(tmp_path / victim.name)
    refused("o_proj.output: no file of the rank(s) [{'tp': 1}]")
    (tmp_path / victim.name).rename(victim)
    q = _files(sg, "step=0___rank=0___")
    rope = next(p for p in q if "layers.0.self_attn.rotary_emb.output.0" in p.name)
    obj = torch.load(rope, weights_only=True)
    torch.save({"value": obj["value"], "meta": {**obj["meta"], "dims": "t h"}}, rope)  # sharded, said replicated
    for r in (1,):
        other = next(p for p in _files(sg, f"step=0___rank={r}___") if "layers.0.self_attn.rotary_emb.output.0" in p.name)
        o = torch.load(other, weights_only=True)
        torch.save({"value": o["value"], "meta": {**o["meta"], "dims": "t h"}}, other)
    refused("the dims annotation is wrong")
    torch.save({"value": _Evil(), "meta": {}}, rope)
    refused(f"{rope}: refused")


@pytest.mark.parametrize("rids", [True, False])
def test_a_continuous_batch_of_staggered_requests_compares_clean(ckpt, tmp_path, rids):
    """impl's scheduler (4 requests, at most 3 running: requests join at later steps) dumped, written as SGLang
    would with or without request ids (then followed by their request-pool slots), compared clean; a fault seeded in
    the ranks is found at its origin."""
    from impl import LLM, CacheConfig, SamplingParams
    from tpcheck.engines.impl.adapter import generate_dumped
    from tpcheck.engines.impl import faults
    d = ckpt("tiny")
    prompts = [[(7 * k + t) % 200 + 3 for t in range(n)] for k, n in enumerate((5, 11, 3, 8))]
    params = [SamplingParams(max_tokens=m) for m in (6, 3, 8, 5)]
    with LLM(d, tp_size=2, block_size=4, num_kv_blocks=32, cache=CacheConfig(max_num_seqs=3)) as llm:
        generate_dumped(llm, prompts, params, tmp_path / "dump")
        llm.call(faults.apply, ["skip_o_proj_allreduce"])
        generate_dumped(llm, prompts, params, tmp_path / "faulty")
    for name, want in (("dump", 0), ("faulty", 1)):
        write_from_dump(tmp_path / name, str(d), FileSink(tmp_path / f"sg-{name}", 2), rids=rids)
        rc, out = compare(tmp_path / f"sg-{name}", d, tmp_path / f"{name}.json", "--no-isolate")
        assert rc == want
    assert out["first_divergence"]["point"] == "layers.0.attn.out" and out["first_divergence"]["step"] == 0


def test_the_docs_commands_run(ckpt, tmp_path, capsys):
    """docs/sglang.md's "Try it without SGLang" block, run as written (CKPT a synthetic checkpoint, runs/ under
    tmp_path): the SGLang-format dump of impl passes."""
    import re
    import shlex
    from pathlib import Path
    from tpcheck.engines.sglang_dump import writer
    text = (Path(__file__).parents[4] / "docs" / "sglang.md").read_text()
    block = re.search(r"## Try it without SGLang.*?```(?:bash)?\n(.*?)```", text, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 3
    for line in lines:
        argv = [str(ckpt("tiny")) if a == "CKPT" else str(tmp_path / a) if a.startswith("runs/") else a
                for a in shlex.split(line)]
        if argv[0] == "tpcheck":
            assert main(argv[1:]) == 0, line
        else:
            assert argv[:3] == ["python", "-m", "tpcheck.engines.sglang_dump.writer"] and writer.main(argv[3:]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.skipif(not os.environ.get("TPCHECK_SGLANG_DUMPER"), reason="TPCHECK_SGLANG_DUMPER: the path of "
                    "sglang/srt/debug_utils/dumper.py from a PyPI sglang wheel (pip download --no-deps sglang)")
def test_files_written_by_sglang_s_own_dumper_compare_like_tpcheck_s(runs, tmp_path):
    """The same run written through SGLang's own ``_Dumper`` (file names, tag order, meta, torch.save): the same
    rows as tpcheck's own dump, logits aside (SGLang's holds each request's last row only)."""
    import sglang_own_dumper
    from tpcheck.engines.sglang_dump.writer import parallel_info
    root, d = runs
    mod = sglang_own_dumper.load(os.environ["TPCHECK_SGLANG_DUMPER"])
    write_from_dump(root / "clean", str(d), sglang_own_dumper.SGLangSink(mod, tmp_path / "own", 2, parallel_info),
                    rids=True)
    rc, ours = compare(tmp_path / "own", d, tmp_path / "own.json", "--no-isolate")
    _, theirs = compare(root / "clean", d, tmp_path / "theirs.json", "--no-isolate")
    got = {(r["point"], r["step"]): r["excess"] for r in ours["rows"]}
    want = {(r["point"], r["step"]): r["excess"] for r in theirs["rows"] if ".kv." not in r["point"]
            and r["point"] != "logits"}
    assert rc == 0 and {k: got[k] for k in want} == want
