"""SGLang's older forward-hook dumps (``TP*_PP*_Rank*_pid*/Pass*.pt``) read by ``tpcheck compare`` and judged like
tpcheck's own dump of the same run; requests followed by position; bad Pass dumps exit 2 naming the file; and two
dumps compared with each other (no golden) or each against the golden."""
from __future__ import annotations

import json
import os

import pytest
import torch

import tpcheck
from tpcheck.capture.dump_format import DumpError
from tpcheck.cli.app import main
from tpcheck.engines.sglang_dump import passes, sniff_format
from tpcheck.engines.sglang_dump.batches import RequestIds
from tpcheck.engines.sglang_dump.writer import FileSink, PassSink, passes_rules, write_from_dump


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('PASSES_MARKER', '/nonexistent/x')}",))


@pytest.fixture(scope="module")
def runs(ckpt, engines, tmp_path_factory):
    """impl at tp 2, 2 prompts, 2 decode steps, dumped by tpcheck clean and with a fault, and written again in
    SGLang's Pass layout."""
    root = tmp_path_factory.mktemp("passes")
    d = ckpt("tiny")
    prompts = [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]
    for name, inject in (("clean", []), ("fault", ["skip_o_proj_allreduce"])):
        tpcheck.diff(model=d, tp=2, prompts=prompts, decode_steps=2, inject=inject, pool=engines,
                     dump=str(root / name), isolate=False)
        write_from_dump(root / name, str(d), PassSink(root / f"{name}-passes", 2), "none", rules=passes_rules())
    return root, d


def _compare(dump, d, out, *extra) -> tuple[int, dict]:
    rc = main(["compare", str(dump), "--model", str(d), "--json", str(out), "--no-isolate", *extra])
    return rc, json.loads(out.read_text())


def test_the_pass_layout_of_impl_judges_like_tpcheck_s_own(runs, tmp_path):
    root, d = runs
    for name, want in (("clean", 0), ("fault", 1)):
        assert sniff_format(root / f"{name}-passes") == "sglang-passes"
        rc, ours = _compare(root / f"{name}-passes", d, tmp_path / f"{name}.json")
        rc0, theirs = _compare(root / name, d, tmp_path / f"{name}0.json")
        assert (rc, rc0) == (want, want)
        got = {(r["point"], r["step"]): r["excess"] for r in ours["rows"]}
        # the layout has no module inputs (attn.context), no KV cache, and the logits of the last pass are never
        # written (its dumper records them after writing the pass)
        want_rows = {(r["point"], r["step"]): r["excess"] for r in theirs["rows"] if ".kv." not in r["point"]
                     and "attn.context" not in r["point"] and r["point"] != "logits"}
        assert {k: got[k] for k in want_rows} == want_rows
    assert ours["first_divergence"]["point"] == theirs["first_divergence"]["point"] == "layers.0.attn.out"
    assert ours["first_divergence"]["excess"] == theirs["first_divergence"]["excess"]


def test_the_logits_are_read_from_the_next_pass(runs):
    """The dumper records the logits processor's output after writing the pass: Pass n+1 holds pass n's."""
    root, _ = runs
    rank0 = next((root / "clean-passes").iterdir())
    first, second = (torch.load(rank0 / f"Pass0000{n}.pt", weights_only=True) for n in (0, 1))
    assert "logits_processor" not in first and "logits_processor" in second
    f = next(f for f in passes.scan(root / "clean-passes") if f.name == "non_intrusive__logits_processor.output")
    assert (f.step, f.tags["pass"]) == (0, "1")


def test_bad_pass_dumps_exit_2_naming_the_file(runs, tmp_path, capsys, monkeypatch):
    root, d = runs
    src = root / "clean-passes"

    def refused(where, match: str):
        assert main(["compare", str(where), "--model", str(d), "--no-isolate"]) == 2
        err = capsys.readouterr().err
        assert match in err, err
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    r1 = next(p for p in bad.iterdir() if p.name.startswith("TP1_"))
    p0 = sorted(r1.iterdir())[0]
    obj = torch.load(p0, weights_only=True)
    torch.save({**obj, "model.layers.0.my_probe": torch.ones(2)}, p0)  # an unknown module: listed, exit 2
    refused(bad, f"{p0}: 1 dumped name(s) no rule maps")
    marker = tmp_path / "ran"
    monkeypatch.setenv("PASSES_MARKER", str(marker))
    passes._CACHE.clear()
    torch.save({**obj, "model.embed_tokens": _Evil()}, p0)  # a pickled object: refused, never run
    refused(bad, f"{p0}: refused")
    assert not marker.exists()
    passes._CACHE.clear()
    torch.save({**obj, "model.embed_tokens": {"x": 1}}, p0)
    refused(bad, f"{p0}: model.embed_tokens is a dict")
    passes._CACHE.clear()
    shutil.rmtree(r1)  # a missing rank: rank 1 of 2 lost
    (bad / "TP2_PP0_Rank2_pid7").mkdir()
    refused(bad, "no directory of tp rank(s) [1]")
    shutil.copytree(src / r1.name, r1)
    shutil.copytree(src / r1.name, bad / r1.name.replace("pid4242", "pid99"))  # a restarted server's passes too
    refused(bad, "tp rank 1 has 2 directories")


def test_requests_are_followed_by_position_and_ambiguity_is_refused():
    ids = RequestIds()
    a, b = ids.by_position([0, 0], [3, 5], 0, "f")  # two prefills
    assert ids.by_position([5, 3], [6, 4], 1, "f") == [b, a]  # decodes, in another order
    assert ids.by_position([4], [5], 2, "f") == [a]  # b sits a step out (finished, or waiting)
    assert ids.by_position([6], [7], 3, "f") == [b]
    with pytest.raises(DumpError, match="prefix-cache hit"):
        ids.by_position([9], [10], 4, "f")
    ids = RequestIds()
    a, b = ids.by_position([0, 0], [3, 3], 0, "f")
    with pytest.raises(DumpError, match="cannot be told apart"):  # one of two equal requests goes on
        ids.by_position([3], [4], 1, "f")


def test_two_dumps_compared_without_a_golden(runs, tmp_path, capsys):
    """Two layouts of one run: the same numbers (exit 0); a fault against the clean run: they part first where the
    fault is, at o_proj's output (exit 1); with --model each is judged against the golden."""
    root, d = runs
    write_from_dump(root / "clean", str(d), FileSink(tmp_path / "dumper", 2))
    assert main(["compare", str(tmp_path / "dumper"), str(root / "clean-passes")]) == 0
    assert "SAME:" in capsys.readouterr().out
    assert main(["compare", "--format", "sglang", str(root / "clean-passes"), str(root / "fault-passes")]) == 1
    out = capsys.readouterr().out
    assert "PART: first at step 0, non_intrusive__model.layers.0.self_attn.o_proj.output" in out
    assert "both sides' unit roundoff" in out
    assert main(["compare", str(root / "clean-passes"), str(root / "fault-passes"), "--model", str(d),
                 "--no-isolate"]) == 1
    out = capsys.readouterr().out
    assert "baseline: exit 0; target: exit 1" in out
    assert main(["compare", str(root / "clean-passes")]) == 2  # one dump and no golden
