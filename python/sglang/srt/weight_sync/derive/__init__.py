"""Targets from SGLang's own loaders: for the engine's model and layout, which boxes of
which HF tensors each TP rank's parameters hold, and which tensors SGLang computes from
others (docs/design.md, "Targets from SGLang's loaders").

Only the names of ``__all__`` leave this package: each TP rank's targets
(``engine_derived_targets``, memoised in the engine), the ``DerivedTargets`` they come in,
and what checks them against SGLang's real loaders. Modules outside it import only these.
"""

from sglang.srt.weight_sync.derive.derived_targets import DerivedTargets
from sglang.srt.weight_sync.derive.target_cache import engine_derived_targets

# isort: split
# pr: scale
from sglang.srt.weight_sync.derive.provenance_check import ProvenanceCheck

# pr: scale end

__all__ = (
    "DerivedTargets",
    # pr: scale
    "ProvenanceCheck",
    # pr: scale end
    "engine_derived_targets",
)
