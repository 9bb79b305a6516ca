"""Capture, the engine-independent machinery an engine's ranks run: the canonical point names (``points``), name-map
rules and placement specs (``rules``), name maps from an engine's modules to them (``maps``), in-rank hooks that take
them (``core``: ``install``, ``from_env``, ``Capture``), teacher forcing (``teacher``), a pipeline stage's hand-offs
(``stages``) and the per-rank, per-step dump files (``dump``: ``DumpWriter``). What is one engine's own lives in its
package under ``tpcheck.engines``.

``import tpcheck.capture`` is the in-rank API a user's engine calls: ``tpcheck.capture.from_env(model, VLLM_MAP,
rank, tp, dtype, engine)``; the ready maps, and the placements a rule declares (``impl.placements``), are
re-exported here."""
from impl.placements import Fused, Partial, Replicate, Shard
from tpcheck.capture.copies import as_rows
from tpcheck.capture.core import Capture, from_env, install
from tpcheck.capture.maps import HF_MAP, HF_TP_MAP, IMPL_MAP, MAPS, VLLM_MAP, VLLM_NORMS_ONLY_MAP
from tpcheck.capture.rules import NameMap, Rule, declared, dtensor_placement, of_sibling, weight_placement

__all__ = ["Capture", "NameMap", "Rule", "as_rows", "declared", "dtensor_placement", "from_env", "install",
           "of_sibling", "weight_placement", "HF_MAP", "HF_TP_MAP", "IMPL_MAP", "MAPS", "VLLM_MAP",
           "VLLM_NORMS_ONLY_MAP", "Fused", "Partial", "Replicate", "Shard"]
