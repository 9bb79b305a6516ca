"""Every JSON document tpcheck writes is strict JSON (no NaN / Infinity), versioned (``schema_version``,
``kind``, run ``meta``) and valid against the shipped schema (``tpcheck.result.documents.load_schema``); a saved result
read back is judged the same, and the readers refuse what they cannot read (a newer schema_version, another
kind) by name."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")

import tpcheck  # noqa: E402
from tpcheck.result import documents  # noqa: E402
from tpcheck.cli import fault_matrix, fault_matrix_command, gate, sweep  # noqa: E402
from tpcheck.cli.app import main  # noqa: E402
from tpcheck.result.report import ResultFormatError, load_result  # noqa: E402
from tpcheck.result.report.sample import sample_result  # noqa: E402



def _no_constant(name):
    raise ValueError(f"non-strict JSON constant {name}")


def strict_load(path: Path) -> dict:
    """``path`` parsed as strict JSON: NaN / Infinity / -Infinity raise (``json.loads`` accepts them)."""
    return json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_no_constant)


@pytest.fixture(scope="module")
def validator():
    schema = documents.load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def valid(validator, doc: dict, kind: str) -> dict:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
    assert doc["schema_version"] == documents.SCHEMA_VERSION == 3 and doc["kind"] == kind
    meta = doc["meta"]
    assert set(documents.RUN_META_KEYS) <= set(meta)
    assert meta["versions"]["tpcheck"] and meta["versions"]["torch"] and meta["versions"]["python"]
    assert meta["machine"]["cpu_count"] == os.cpu_count()
    when = datetime.datetime.fromisoformat(meta["created_utc"])
    assert when.utcoffset() == datetime.timedelta(0)
    return doc


# ------------------------------------------------------------------------------------------ the schema itself

def test_schema_ships_and_describes_every_kind_and_column(validator):
    schema = documents.load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["properties"]["kind"]["enum"]) == set(documents.KINDS)
    assert all(k in schema["$defs"] for k in documents.KINDS)
    row = schema["$defs"]["diff_row"]
    cols = [c for c in tpcheck.result.COLUMNS if c != "order"]
    assert list(row["properties"]) == cols and row["required"] == cols and row["additionalProperties"] is False
    assert row["properties"]["rel_err"] == {"$ref": "#/$defs/number_or_null",
                                            "description": row["properties"]["rel_err"]["description"]}
    assert fault_matrix.COLUMNS == list(schema["$defs"]["fault_matrix_row"]["properties"])
    assert set(schema["$defs"]["meta"]["required"]) == set(documents.RUN_META_KEYS)
    # the shipped file is package data, so an installed wheel has it
    text = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    import tomllib
    assert "result.schema.json" in tomllib.loads(text)["tool"]["setuptools"]["package-data"]["tpcheck.result"]
    # a document of an unknown kind, a newer version, or with NaN where a number goes does not validate
    doc = documents.document("diff", {"passed": True, "first_divergence": None, "rows": []}, meta={})
    assert not validator.is_valid(doc)  # no rows, no meta.dtype / model
    assert not validator.is_valid({**doc, "kind": "nope"})
    assert not validator.is_valid({**doc, "schema_version": documents.SCHEMA_VERSION + 1})


def test_strict_json_nulls_every_non_finite_value_and_dumps_refuses_a_miss(monkeypatch):
    doc = {"a": math.nan, "b": [math.inf, -math.inf, np.float32("nan"), np.float64(2.5)], "c": (np.int64(3),),
           "d": {"e": np.array([1.0, np.nan]), 5: Path("/x")}, "f": np.bool_(True), "g": None}
    assert documents.strict_json(doc) == {"a": None, "b": [None, None, None, 2.5], "c": [3],
                                       "d": {"e": [1.0, None], "5": "/x"}, "f": True, "g": None}
    text = documents.dumps(doc)
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=_no_constant)
    monkeypatch.setattr(documents, "strict_json", lambda obj: obj)  # a sanitizer that misses: dumps raises
    with pytest.raises(ValueError, match="not JSON compliant"):
        documents.dumps({"x": math.nan})


def test_run_meta_and_document_layout():
    m = documents.run_meta("tpcheck check --tp 1")
    assert m["command"] == "tpcheck check --tp 1" and set(m) == set(documents.RUN_META_KEYS)
    assert set(m["versions"]) == {"tpcheck", "python", "torch", "transformers"}
    assert set(m["machine"]) == {"platform", "cpu_count", "gpu"}
    doc = documents.document("sweep", {"passed": True, "rows": [{"x": 1}]}, meta={"command": "mine", "seed": 3})
    assert list(doc) == ["schema_version", "kind", "passed", "meta", "rows"]
    assert doc["meta"]["command"] == "mine" and doc["meta"]["seed"] == 3  # the caller's meta wins
    with pytest.raises(ValueError, match="kind"):
        documents.document("table", {})
    with pytest.raises(ValueError, match="schema_version"):
        documents.document("check", {"schema_version": 7})


# ------------------------------------------------------------------------------------------ real outputs

@pytest.mark.parametrize("inject", [[], ["nan_causal_mask"]], ids=["clean", "nan_causal_mask"])
def test_cli_diff_json_is_strict_valid_and_gates_the_same(inject, validator, ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["diff", "--model", str(ckpt("tiny")), "--tp", "2", "--seq-len", "6", "--batch", "2", "--json", str(out)]
    rc = main(argv + (["--inject", ",".join(inject)] if inject else []))
    assert rc == (1 if inject else 0), capsys.readouterr().err
    doc = valid(validator, strict_load(out), "diff")
    assert doc["meta"]["dtype"] == "float32" and doc["meta"]["tp"] == 2
    assert doc["meta"]["command"].startswith("tpcheck diff")
    assert doc["passed"] is (not inject)
    if inject:  # the engine's NaN: null numbers, explained by the row's nan count
        fd = doc["first_divergence"]
        assert fd["point"] == "layers.0.attn.context" and fd["rel_err"] is None and fd["excess"] is None
        key = (fd["point"], fd["step"], fd["mode"])
        origin = next(r for r in doc["rows"] if (r["point"], r["step"], r["mode"]) == key)
        assert origin["nan"] > 0 and origin["rel_err"] is None and origin["passed"] is False
    else:
        assert doc["first_divergence"] is None
    code, msg = gate.regate(out)
    assert code == rc, msg
    if inject:
        assert "layers.0.attn.context" in msg


def test_nan_result_round_trips_to_the_same_verdict(validator, ckpt, engines, tmp_path):
    """A real NaN-bearing result: saved (null), read back (NaN), re-judged: the same verdict, origin and rows."""
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 7)]
    r = tpcheck.diff(model=ckpt("tiny"), tp=2, prompts=prompts, inject=["nan_causal_mask"], pool=engines)
    assert not np.isfinite(r.table["rel_err"].astype(float)).all()
    path = tmp_path / "r.json"
    r.to_json(path)
    valid(validator, strict_load(path), "diff")
    back = load_result(path)
    assert back.meta == r.meta  # nothing re-stamped on reading
    code, msg, judged = gate.gate_result(r)
    code2, msg2, judged2 = gate.gate_result(back)
    assert code == code2 == 1 and msg == msg2
    keys = ("point", "layer", "step", "mode", "note", "ref_by")
    assert [judged.first_divergence[k] for k in keys] == [judged2.first_divergence[k] for k in keys]
    assert judged.table["passed"].tolist() == judged2.table["passed"].tolist()
    for c in ("rel_err", "excess", "cosine", "max_abs", "threshold"):
        a, b = r.table[c].astype(float).to_numpy(), back.table[c].astype(float).to_numpy()
        assert (np.isfinite(a) == ~np.isnan(b)).all(), c  # non-finite -> null -> NaN
        assert np.array_equal(a[np.isfinite(a)], b[~np.isnan(b)]), c  # full precision


def test_sample_result_with_inf_and_nan_round_trips(validator, tmp_path):
    r = sample_result(3, 1, isolate=True, fail_at="layers.2.mlp.up")
    r.table.loc[2, ["rel_err", "excess", "max_abs", "passed", "note"]] = [math.inf, math.inf, math.inf, False,
                                                                           "shape [2] != golden [3]"]
    r.table.loc[4, ["rel_err", "excess", "cosine", "passed", "nan"]] = [math.nan, math.nan, math.nan, False, 7]
    path = tmp_path / "r.json"
    r.to_json(path)
    doc = valid(validator, strict_load(path), "diff")
    assert doc["rows"][2]["rel_err"] is None and doc["rows"][2]["note"].startswith("shape")
    assert doc["rows"][4]["rel_err"] is None and doc["rows"][4]["nan"] == 7
    assert all(r["layer"] is None or type(r["layer"]) is int for r in doc["rows"])  # not 1.0
    back = load_result(path)
    (code, _, judged), (code2, _, judged2) = gate.gate_result(r), gate.gate_result(back)
    assert code == code2 == 1 and judged.table["passed"].tolist() == judged2.table["passed"].tolist()
    keys = ("point", "step", "mode", "note")
    assert [judged.first_divergence[k] for k in keys] == [judged2.first_divergence[k] for k in keys]
    assert math.isnan(back.table.loc[2, "rel_err"]) and math.isnan(back.table.loc[4, "rel_err"])


def _sweep_args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tpcheck")
    sweep.register(ap.add_subparsers(dest="cmd"))
    return ap.parse_args(["sweep", *argv])


def test_sweep_json_is_strict_and_valid(validator, engines, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    a = _sweep_args("--preset", "tiny", "--tp", "1,2", "--dtype", "float32", "--decode-steps", "0", "--examples", "1",
                    "--max-len", "12", "--checkpoints", str(tmp_path / "ck"), "--json", str(out))
    assert sweep.run(a, pool=engines) == 0, capsys.readouterr().out
    doc = valid(validator, strict_load(out), "sweep")
    assert doc["passed"] is True and [(r["tp"], r["passed"]) for r in doc["rows"]] == [(1, True), (2, True)]
    assert doc["meta"]["args"]["tp"] == [1, 2] and doc["meta"]["args"]["checkpoints"] == str(tmp_path / "ck")
    with pytest.raises(ResultFormatError, match="a tpcheck sweep result, not a diff result"):
        load_result(out)


def test_check_json_is_strict_and_valid(validator, ckpt, engines, tmp_path):
    from tpcheck.pipeline.check import check_logits, random_prompts
    model = ckpt("tiny")
    df = check_logits(model, [1, 2], "float32", random_prompts(250, 1, 6, 0), pool=engines)
    ok = bool(df["passed"].all())
    out = tmp_path / "sub" / "check.json"
    # what cli.py's `check --json` writes
    documents.write_json(out, "check", {"passed": ok, "model": str(model), "rows": df.to_dict("records")})
    doc = valid(validator, strict_load(out), "check")
    assert doc["passed"] is True and {r["tp"] for r in doc["rows"]} == {1, 2}
    # a NaN in a check row is written as null and still validates
    df.loc[0, ["rel_err", "cosine", "nan", "passed"]] = [math.nan, math.nan, 12, False]
    documents.write_json(out, "check", {"passed": False, "model": str(model), "rows": df.to_dict("records")})
    doc = valid(validator, strict_load(out), "check")
    assert doc["rows"][0]["rel_err"] is None and doc["rows"][0]["nan"] == 12


def test_fault_matrix_json_is_strict_and_valid(validator, ckpt, engines, tmp_path, capsys):
    ap = argparse.ArgumentParser()
    fault_matrix_command.register(ap.add_subparsers(dest="action"))
    out = tmp_path / "m.json"
    args = ap.parse_args(["matrix", "--faults", "nan_causal_mask", "--no-clean", "--json", str(out)])
    assert fault_matrix_command.run(args, pool=engines, ckpt=ckpt) == 0, capsys.readouterr().out
    doc = valid(validator, strict_load(out), "fault_matrix")
    (row,) = doc["rows"]
    assert row["fault"] == "nan_causal_mask" and row["by"] == "NaN" and row["excess"] is None


# ------------------------------------------------------------------------------------------ readers

def test_readers_refuse_a_newer_schema_version_and_other_kinds_by_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: default tolerances
    path = tmp_path / "r.json"
    sample_result(2, 0, isolate=False).to_json(path)
    doc = json.loads(path.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**doc, "schema_version": documents.SCHEMA_VERSION + 1}))
    code, msg = gate.regate(newer)
    assert code == 2 and str(newer) in msg
    assert f"schema_version {documents.SCHEMA_VERSION + 1} is newer" in msg
    assert f"schema_version {documents.SCHEMA_VERSION} and older" in msg
    ap = argparse.ArgumentParser(prog="tpcheck")
    gate.register(ap.add_subparsers(dest="cmd"))
    assert gate.run(ap.parse_args(["gate", str(newer)])) == 2
    assert str(newer) in capsys.readouterr().err
    assert gate.run(ap.parse_args(["report", str(newer), "-o", str(tmp_path / "r.html")])) == 2
    assert "is newer than this tpcheck" in capsys.readouterr().err
    for bad, what in (({**doc, "kind": "check"}, "a tpcheck check result, not a diff result"),
                      ({k: v for k, v in doc.items() if k != "kind"}, "no 'kind'"),
                      ({**doc, "schema_version": "1"}, "schema_version must be an integer")):
        path.write_text(json.dumps(bad))
        code, msg = gate.regate(path)
        assert code == 2 and str(path) in msg and what in msg, msg


def test_a_file_without_schema_version_reads_as_version_0(tmp_path, monkeypatch):
    """Results written before documents were versioned (no schema_version / kind, NaN tokens) still read."""
    monkeypatch.chdir(tmp_path)
    r = sample_result(3, 1, isolate=False, fail_at="layers.1.attn.q")
    doc = r.to_document()
    old = {"passed": doc["passed"], "first_divergence": doc["first_divergence"],
           "meta": {k: v for k, v in doc["meta"].items() if k not in documents.RUN_META_KEYS or k == "command"},
           "rows": doc["rows"]}
    old["rows"][0]["cosine"] = math.nan  # the old writer let NaN through outside the rows' cleaning
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    back = load_result(path)
    assert "versions" not in back.meta  # not stamped with this machine on reading
    assert gate.regate(path)[0] == 1 and back.first_divergence["point"] == "layers.1.attn.q"
