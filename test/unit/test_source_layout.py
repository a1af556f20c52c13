"""Source boxes from DTensor placements and explicit specs, checked against torch.chunk.

The reference splits an index-encoded tensor with ``torch.chunk`` mesh dim by
mesh dim, the way DTensor lays out shards, and compares what each coordinate
holds with the box the layout reports.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from sglang.srt.weight_sync.source_layout import (
    LayoutError,
    describe_full,
    describe_mesh,
    describe_sharded,
)


def chunk_reference(full, mesh_shape, placements, coord):
    piece = full
    for size, place, i in zip(mesh_shape, placements, coord):
        if isinstance(place, Shard):
            chunks = list(torch.chunk(piece, size, dim=place.dim))
            piece = chunks[i] if i < len(chunks) else piece.narrow(place.dim, 0, 0)
    return piece


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    data=st.data(),
)
def test_mesh_boxes_match_torch_chunk(shape, mesh_shape, data):
    placements = tuple(
        data.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))])) for _ in mesh_shape
    )
    n = 1
    for s in mesh_shape:
        n *= s
    ranks = torch.arange(n).reshape(mesh_shape).tolist()
    layout = describe_mesh("w", shape, torch.float32, ranks, placements)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    held = dict(layout.holders)
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        rank = torch.tensor(ranks)[coord].item()
        expected = chunk_reference(full, mesh_shape, placements, coord)
        box = held[rank]
        if expected.numel() == 0:
            assert box.is_empty()
        else:
            assert torch.equal(full[box.slices()], expected), (coord, box)


def test_rank_map_translates_and_drops_ranks_outside_the_group():
    layout = describe_mesh("w", (8, 2), torch.bfloat16, [[0, 1], [2, 3]], (Replicate(), Shard(0)), {2: 0, 3: 1})
    assert [(r, b.offsets, b.sizes) for r, b in layout.holders] == [(0, (0, 0), (4, 2)), (1, (4, 0), (4, 2))]


def test_megatron_explicit_shards_with_dp_replicas():
    layout = describe_sharded("o_proj", (4, 6), torch.float32, 1, [[0, 1, 2], [3, 4, 5]])
    boxes = {r: (b.offsets, b.sizes) for r, b in layout.holders}
    assert boxes[1] == boxes[4] == ((0, 2), (4, 2))
    assert boxes[2] == ((0, 4), (4, 2))


def test_full_copies():
    layout = describe_full("norm", (16,), torch.float32, [0, 3])
    assert [(r, b.sizes) for r, b in layout.holders] == [(0, (16,)), (3, (16,))]


@pytest.mark.parametrize("placement,message", [
    (_StridedShard(0, split_factor=2), "strided rows, not a box"),
    (Partial(), "Partial sums need a reduction"),
])
def test_unsupported_placements_name_the_tensor(placement, message):
    with pytest.raises(LayoutError, match=f"tensor 'model.x': .*{message}"):
        describe_mesh("model.x", (8, 8), torch.float32, [[0, 1], [2, 3]], (Shard(0), placement))


def test_mismatched_mesh_and_placements():
    with pytest.raises(LayoutError, match="tensor 'w': 1 placements for a 2-d mesh"):
        describe_mesh("w", (8,), torch.float32, [[0, 1], [2, 3]], (Shard(0),))


def test_mesh_spec_round_trips_through_sglang_safe_unpickler():
    """Layout facts travel with each payload; SGLang's SafeUnpickler must accept them."""
    from sglang.srt.utils import MultiprocessingSerializer

    from sglang.srt.weight_sync.source_layout import MeshSpec

    spec = MeshSpec((10, 4), torch.bfloat16, [[0, 1], [2, 3]], (Replicate(), Shard(0)))
    wire = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(spec.to_wire()))
    assert MeshSpec.from_wire(wire) == spec
    assert MeshSpec.from_wire(wire).describe("w", {2: 0, 3: 1}) == describe_mesh(
        "w", (10, 4), torch.bfloat16, [[0, 1], [2, 3]], (Replicate(), Shard(0)), {2: 0, 3: 1}
    )


def test_mesh_spec_refuses_unknown_wire_values():
    from sglang.srt.weight_sync.source_layout import MeshSpec

    with pytest.raises(LayoutError, match="unknown dtype 'float99'"):
        MeshSpec.from_wire(((4,), "float99", [0], (("R",),)))
    with pytest.raises(LayoutError, match="placement Partial is not supported"):
        MeshSpec.from_wire(((4,), "float32", [0], (("Partial",),)))
