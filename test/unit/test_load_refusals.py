"""What an update cannot copy is refused before anything is written, per tensor, naming the op.

A toy model's ``load_weights`` does what quantising or computing loaders do: one
parameter is a plain (transposed) copy, one is computed from its checkpoint tensor
(``w * 2``), one has its storage replaced while loading. The derivation (SGLang's own
post-load code included) must describe the copy as a permuted piece and report the other
two by checkpoint tensor, parameter and op; the engine's validation (``_sources``) must
refuse an update sending them with that reason and accept the copy.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.delivery import Payload
from sglang.srt.weight_sync.derive.derived_targets import (
    CheckpointLayout,
    DerivedTargets,
    derive_rank,
)
from sglang.srt.weight_sync.engine_update import _sources
from sglang.srt.weight_sync.source_layout import MeshSpec
from sglang.srt.weight_sync.target_layout import EngineParallel, Piece


class Loader(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.copied = torch.nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.replaced = torch.nn.Parameter(torch.empty(4, 3), requires_grad=False)

    def load_weights(self, weights):
        w = dict(weights)
        self.copied.copy_(w["a"].t())
        self.scaled.copy_(w["b"] * 2)
        self.replaced = torch.nn.Parameter(w["c"].clone(), requires_grad=False)


CHECKPOINT = CheckpointLayout(
    (
        ("a", (3, 4), torch.float32),
        ("b", (4, 3), torch.float32),
        ("c", (4, 3), torch.float32),
    )
)


@pytest.fixture(scope="module")
def derived():
    with torch.device("meta"):
        model = Loader()
    return derive_rank(model, CHECKPOINT)


def test_copies_are_targets_and_the_rest_is_named(derived):
    assert [(t.name, t.pieces) for t in derived.targets] == [
        ("copied", (Piece("a", Box((0, 0), (3, 4)), (), (0, 0), (1, 0)),))
    ]
    assert derived.not_copied == {
        "b": "scaled[0:4, 0:3] is computed from it by mul.Tensor",
        "c": "replaced: its storage is replaced while loading",
    }
    assert derived.read == {"a", "b", "c"}


@pytest.mark.parametrize(
    "name, reason",
    [("b", "computed from it by mul.Tensor"), ("c", "storage is replaced")],
)
def test_engine_refuses_what_is_not_a_copy(derived, name, reason):
    targets = DerivedTargets(
        EngineParallel(1),
        (derived.targets,),
        CHECKPOINT.shapes(),
        not_copied=derived.not_copied,
    )
    spec = lambda n: MeshSpec(
        CHECKPOINT.shapes()[n], torch.float32, [0], (Replicate(),)
    )  # noqa: E731
    ok = Payload("u", 0, {0: 0}, {"a": torch.zeros(3, 4)}, {"a": spec("a")})
    sources, _ = _sources(ok, targets)
    assert set(sources) == {"a"}
    bad = Payload(
        "u",
        0,
        {0: 0},
        {"a": torch.zeros(3, 4), name: torch.zeros(4, 3)},
        {"a": spec("a"), name: spec(name)},
    )
    with pytest.raises(
        ValueError,
        match=f"tensor '{name}' is not a copy in SGLang's loader: .*{reason}",
    ):
        _sources(bad, targets)
