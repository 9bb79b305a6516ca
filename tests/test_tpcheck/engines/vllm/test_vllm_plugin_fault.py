"""``TPCHECK_DUMP_FAULT`` (``tpcheck.engines.vllm.fault_plugin.parse_fault``), without vLLM: the variable names a fault
of ``--engine vllm``'s catalogue, a decoder layer and a TP rank; anything else is an error naming the variable. The
seeded fault in a real vLLM script is in ``test_vllm_chat.py``."""
from __future__ import annotations

import pytest

from tpcheck.engines.vllm.fault_plugin import ENV_FAULT, parse_fault, register
from tpcheck.engines.vllm.faults import VLLM_FAULTS


def test_parse_fault_reads_name_layer_and_rank():
    assert parse_fault("o-proj-partial@1:1", 2) == ("o-proj-partial", 1, 1)
    assert parse_fault("k-rope-shift@0", 24) == ("k-rope-shift", 0, 0)  # rank 0 unless named
    assert all(parse_fault(f"{n}@0", 1)[0] == n for n in VLLM_FAULTS)


@pytest.mark.parametrize("spec, says", [("nope@1", "unknown fault 'nope'"), ("o-proj-partial@2", "0..1"),
                                        ("o-proj-partial", "NAME@LAYER"), ("o-proj-partial@1:x", "NAME@LAYER"),
                                        ("o-proj-partial@-1", "NAME@LAYER")])
def test_parse_fault_refuses_what_it_cannot_apply(spec, says):
    with pytest.raises(ValueError, match=ENV_FAULT) as e:
        parse_fault(spec, 2)
    assert says in str(e.value)


def test_register_needs_both_variables(monkeypatch):
    from tpcheck.engines.vllm.plugin import AFTER_LOAD
    from tpcheck.engines.vllm.fault_plugin import seed
    monkeypatch.setattr("tpcheck.engines.vllm.plugin.AFTER_LOAD", AFTER_LOAD[:0])
    from tpcheck.engines.vllm import plugin as vllm_plugin
    monkeypatch.delenv(ENV_FAULT, raising=False)
    register()
    assert vllm_plugin.AFTER_LOAD == []  # unset: nothing
    monkeypatch.setenv(ENV_FAULT, "o-proj-partial@1:1")
    monkeypatch.delenv("TPCHECK_DUMP", raising=False)
    register()
    assert vllm_plugin.AFTER_LOAD == []  # a fault without a dump: warned of, nothing seeded
    monkeypatch.setenv("TPCHECK_DUMP", "/nonexistent-dir")
    register()
    register()  # loaded twice: once in the list
    assert vllm_plugin.AFTER_LOAD == [seed]
