"""The engine adapter base class and its reference page:

* ``docs/reference/adapter.md`` is what ``tpcheck.cli.adapter_reference`` renders from ``EngineAdapter``;
* every public member of ``EngineAdapter`` is a required method or one of ``CAPABILITIES`` (the page lists both);
* every built-in adapter derives from ``EngineAdapter``;
* an object that only has ``begin`` / ``step`` / ``close`` is wrapped (``as_adapter``) with the class's defaults,
  and a capability it does have is read from it each time (``point_rows`` changes every step)."""
from __future__ import annotations

from pathlib import Path

from tpcheck.capture.points import point_stage
from tpcheck.engines.adapter import CAPABILITIES, EngineAdapter, ProtocolAdapter, as_adapter

ROOT = Path(__file__).resolve().parents[3]


def test_adapter_reference_matches_the_class():
    from tpcheck.cli.adapter_reference import render
    page = (ROOT / "docs" / "reference" / "adapter.md").read_text(encoding="utf-8")
    assert page == render(), "docs/reference/adapter.md is stale: " \
                             "`python -m tpcheck.cli.adapter_reference > docs/reference/adapter.md`"
    for name in CAPABILITIES + ("begin", "step", "close"):
        assert f"| `{name}" in page, name


def test_every_member_is_listed():
    public = {n for n in vars(EngineAdapter) if not n.startswith("_")} | set(EngineAdapter.__annotations__)
    assert public == set(CAPABILITIES) | set(EngineAdapter.__abstractmethods__), \
        public ^ (set(CAPABILITIES) | set(EngineAdapter.__abstractmethods__))


def test_built_in_adapters_derive_from_the_base_class():
    from tpcheck.engines.dump.dumping import DumpingAdapter
    from tpcheck.engines.dump.replay import DumpAdapter
    from tpcheck.engines.dump.stages import PipelineDumpAdapter
    from tpcheck.engines.hf_tp.adapter import HFTPAdapter
    from tpcheck.engines.impl.adapter import ImplAdapter
    from tpcheck.engines.vllm.adapter import VLLMAdapter  # imports no vLLM until an engine starts
    for cls in (ImplAdapter, HFTPAdapter, VLLMAdapter, DumpAdapter, PipelineDumpAdapter, DumpingAdapter):
        assert issubclass(cls, EngineAdapter) and not cls.__abstractmethods__, cls


class _Bare:
    """An adapter as the protocol allowed before the base class: three methods, one capability."""

    teacher_forcing = True

    def __init__(self):
        self.point_rows, self.calls = None, []

    def begin(self, prompts, decode_steps):
        self.calls.append("begin")

    def step(self, new_tokens, teacher, capture_kv):
        self.point_rows = {"logits": [0]}
        return {}

    def close(self):
        self.calls.append("close")


def test_a_duck_typed_adapter_gets_the_defaults():
    bare = _Bare()
    a = as_adapter(bare)
    assert isinstance(a, ProtocolAdapter) and as_adapter(a) is a
    assert a.teacher_forcing is True and a.takes_prefix is False and a.reductions is None and a.stages is None
    assert a.schedule(0) is None and a.lacking(["layers.0.out"]) is None and dict(a.point_rows) == {}
    assert a.point_stage("layers.3.out", ((0, 2), (2, 4))) == point_stage("layers.3.out", ((0, 2), (2, 4))) == 1
    a.begin([[1]], 0)
    a.step([[1]], None, False)
    a.close()
    assert dict(a.point_rows) == {"logits": [0]} and bare.calls == ["begin", "close"]
