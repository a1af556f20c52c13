"""Targets from SGLang's own loaders: for the engine's model and layout, which boxes of
which HF tensors each TP rank's parameters hold, and which tensors SGLang computes from
others (docs/design.md, "Targets from SGLang's loaders").

Three names leave this package: ``engine_derived_targets`` (each TP rank's targets,
memoised in the engine and cached on disk across restarts), the ``DerivedTargets`` they
come in, and ``ProvenanceCheck`` (which refuses an update that sends a tensor SGLang
computes rather than copies). Modules outside it import only these.
"""

from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
from sglang.srt.weight_sync.derive.provenance_check import ProvenanceCheck
from sglang.srt.weight_sync.derive.target_cache import engine_derived_targets

__all__ = ("DerivedTargets", "ProvenanceCheck", "engine_derived_targets")
