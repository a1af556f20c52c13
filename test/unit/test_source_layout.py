"""Source holders from DTensor placements and explicit specs, checked against torch.chunk.

The reference splits an index-encoded tensor with ``torch.chunk`` mesh dim by
mesh dim, the way DTensor lays out shards (``_StridedShard(d, sf)``: cut dim d
into sf pieces, each into n chunks, and keep chunk i of every piece), and
compares each coordinate's local tensor with the one its holders rebuild.

That reference is ``_StridedShard``'s meaning from torch 2.11 on (the primary base's
2.13). Torch 2.9, pinned by the 0.5.10.post1 base, meant right-to-left sharding by the
same placement; the holders follow whichever torch is installed (they come from the
placement's own ``_split_tensor``), and every base's smoke checks them against real
FSDP2-over-TP shards (``test/distributed/test_reshard.py``).
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import (
    Partial,
    Replicate,
    Shard,
    _StridedShard,
)

from sglang.srt.weight_sync.planner import sources_digest
from sglang.srt.weight_sync.source_layout import (
    LayoutError,
    MeshSpec,
    SourceTensor,
    describe_mesh,
)


def _chunk(t, n, dim, i):
    chunks = list(torch.chunk(t, n, dim=dim))
    return chunks[i] if i < len(chunks) else t.narrow(dim, 0, 0)


def chunk_reference(full, mesh_shape, placements, coord):
    piece = full
    for size, place, i in zip(mesh_shape, placements, coord):
        if isinstance(place, Shard):
            piece = _chunk(piece, size, place.dim, i)
        elif isinstance(place, _StridedShard):
            parts = [
                _chunk(piece, place.split_factor, place.dim, j)
                for j in range(place.split_factor)
            ]
            piece = torch.cat(
                [_chunk(p, size, place.dim, i) for p in parts], dim=place.dim
            )
    return piece


def rebuild(layout, rank, local_shape):
    """The local tensor of ``rank``, written from its holders only (NaN where none writes)."""
    full = torch.arange(torch.Size(layout.shape).numel(), dtype=torch.float64).reshape(
        layout.shape
    )
    out = torch.full(local_shape, float("nan"), dtype=torch.float64)
    for h in layout.holders:
        if h.rank == rank and not h.box.is_empty():
            assert h.buffer == layout.name and h.buffer_shape == tuple(local_shape)
            out[h.buffer_box(h.box).slices()] = full[h.box.slices()]
    return out


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    data=st.data(),
)
def test_mesh_boxes_match_torch_chunk(shape, mesh_shape, data):
    placements = tuple(
        data.draw(
            st.sampled_from(
                [Replicate()]
                + [Shard(d) for d in range(len(shape))]
                + [
                    _StridedShard(d, split_factor=f)
                    for d in range(len(shape))
                    for f in (2, 3)
                ]
            )
        )
        for _ in mesh_shape
    )
    n = 1
    for s in mesh_shape:
        n *= s
    ranks = torch.arange(n).reshape(mesh_shape).tolist()
    layout = describe_mesh("w", shape, torch.float32, ranks, placements)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        rank = torch.tensor(ranks)[coord].item()
        expected = chunk_reference(full, mesh_shape, placements, coord)
        assert torch.equal(rebuild(layout, rank, expected.shape), expected), (
            coord,
            placements,
        )


def test_fsdp2_over_tp_strided_rows_are_one_box_per_rank():
    """FSDP2 over a TP-parallel module: placements (_StridedShard(0, sf=tp), Shard(0)) on a
    (dp, tp) mesh; rank (i, j) holds rows of TP chunk j, FSDP chunk i, in one box."""
    layout = describe_mesh(
        "w",
        (16, 3),
        torch.float32,
        [[0, 1], [2, 3]],
        (_StridedShard(0, split_factor=2), Shard(0)),
    )
    rows = {h.rank: (h.box.offsets[0], h.box.sizes[0]) for h in layout.holders}
    assert rows == {0: (0, 4), 2: (4, 4), 1: (8, 4), 3: (12, 4)}


def test_strided_shard_alone_holds_several_boxes_in_one_buffer():
    layout = describe_mesh(
        "w", (8,), torch.float32, [0, 1], (_StridedShard(0, split_factor=2),)
    )
    assert [(h.rank, h.box.offsets, h.offsets) for h in layout.holders] == [
        (0, (0,), (0,)),
        (0, (4,), (2,)),
        (1, (2,), (0,)),
        (1, (6,), (2,)),
    ]
    with pytest.raises(LayoutError, match="rank 0 holds 2 boxes"):
        layout.box_of(0)


def test_rank_map_translates_and_drops_ranks_outside_the_group():
    layout = describe_mesh(
        "w",
        (8, 2),
        torch.bfloat16,
        [[0, 1], [2, 3]],
        (Replicate(), Shard(0)),
        {2: 0, 3: 1},
    )
    assert [(h.rank, h.box.offsets, h.box.sizes) for h in layout.holders] == [
        (0, (0, 0), (4, 2)),
        (1, (4, 0), (4, 2)),
    ]


def test_megatron_explicit_shards_with_dp_replicas():
    layout = MeshSpec.sharded(
        (4, 6), torch.float32, 1, [[0, 1, 2], [3, 4, 5]]
    ).describe("o_proj")
    boxes = {h.rank: (h.box.offsets, h.box.sizes) for h in layout.holders}
    assert boxes[1] == boxes[4] == ((0, 2), (4, 2))
    assert boxes[2] == ((0, 4), (4, 2))


def test_full_copies():
    layout = MeshSpec.full((16,), torch.float32, [0, 3]).describe("norm")
    assert [(h.rank, h.box.sizes) for h in layout.holders] == [(0, (16,)), (3, (16,))]


def test_unsupported_placements_name_the_tensor():
    with pytest.raises(
        LayoutError, match="tensor 'model.x': .*Partial sums need a reduction"
    ):
        describe_mesh(
            "model.x", (8, 8), torch.float32, [[0, 1], [2, 3]], (Shard(0), Partial())
        )


def test_mismatched_mesh_and_placements():
    with pytest.raises(LayoutError, match="tensor 'w': 1 placements for a 2-d mesh"):
        describe_mesh("w", (8,), torch.float32, [[0, 1], [2, 3]], (Shard(0),))


def test_mesh_spec_round_trips_through_sglang_safe_unpickler():
    """Layout facts travel with each payload; SGLang's SafeUnpickler must accept them."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.source_layout import MeshSpec

    spec = MeshSpec(
        (10, 4),
        torch.bfloat16,
        [[0, 1], [2, 3]],
        (_StridedShard(0, split_factor=2), Shard(0)),
    )
    wire = MultiprocessingSerializer.deserialize(
        MultiprocessingSerializer.serialize(spec.to_wire())
    )
    assert MeshSpec.from_wire(wire) == spec
    # torch 2.9 makes _StridedShard a Shard that compares equal to Shard(d): check the type too.
    assert [type(p) for p in MeshSpec.from_wire(wire).placements] == [
        _StridedShard,
        Shard,
    ]
    assert wire[3] == (("SS", 0, 2), ("S", 0))
    assert MeshSpec.from_wire(wire).describe("w", {2: 0, 3: 1}) == describe_mesh(
        "w",
        (10, 4),
        torch.bfloat16,
        [[0, 1], [2, 3]],
        (_StridedShard(0, split_factor=2), Shard(0)),
        {2: 0, 3: 1},
    )


def test_mesh_spec_refuses_unknown_wire_values():
    from sglang.srt.weight_sync.source_layout import MeshSpec

    with pytest.raises(LayoutError, match="unknown dtype 'float99'"):
        MeshSpec.from_wire(((4,), "float99", [0], (("R",),)))
    with pytest.raises(LayoutError, match="placement Partial is not supported"):
        MeshSpec.from_wire(((4,), "float32", [0], (("Partial",),)))


def _explicit(src):
    """The same holders with no mesh behind them (as megatron_layout describes tensors)."""
    return SourceTensor(src.name, src.shape, src.dtype, tuple(src.holders))


def test_sources_digest_hashes_the_mesh_and_tells_every_layout_apart():
    base = ("w", (8, 6), torch.float32, [[0, 1], [2, 3]], (Replicate(), Shard(0)))
    digest = sources_digest({"w": describe_mesh(*base)})
    assert (
        sources_digest({"w": describe_mesh(*base)}) == digest
    )  # a new description, same digest
    # The mesh determines the holders: an identity rank map gives the same layout and holders.
    same = describe_mesh(*base, rank_map={r: r for r in range(4)})
    assert same.holders.geometry is describe_mesh(*base).holders.geometry
    assert same.holders == describe_mesh(*base).holders
    variants = [
        ("v", (8, 6), torch.float32, [[0, 1], [2, 3]], (Replicate(), Shard(0))),
        ("w", (8, 8), torch.float32, [[0, 1], [2, 3]], (Replicate(), Shard(0))),
        ("w", (8, 6), torch.bfloat16, [[0, 1], [2, 3]], (Replicate(), Shard(0))),
        ("w", (8, 6), torch.float32, [[0, 1], [3, 2]], (Replicate(), Shard(0))),
        ("w", (8, 6), torch.float32, [[0, 1, 2, 3]], (Replicate(), Shard(0))),
        ("w", (8, 6), torch.float32, [[0, 1], [2, 3]], (Replicate(), Shard(1))),
        ("w", (8, 6), torch.float32, [[0, 1], [2, 3]], (Shard(0), Shard(0))),
        (
            "w",
            (8, 6),
            torch.float32,
            [[0, 1], [2, 3]],
            (_StridedShard(0, split_factor=2), Shard(0)),
        ),
    ]
    digests = {sources_digest({v[0]: describe_mesh(*v)}) for v in variants}
    digests.add(
        sources_digest({"w": describe_mesh(*base, rank_map={0: 0, 1: 1, 2: 2})})
    )  # rank 3 outside
    digests.add(
        sources_digest({"w": describe_mesh(*base, rank_map={0: 1, 1: 0, 2: 2, 3: 3})})
    )
    assert digest not in digests and len(digests) == len(variants) + 2
    # Holders listed one by one are hashed one by one, and tell layouts apart as well.
    explicit = sources_digest({"w": _explicit(describe_mesh(*base))})
    assert explicit == sources_digest({"w": _explicit(describe_mesh(*base))})
    assert explicit != sources_digest({"w": _explicit(describe_mesh(*variants[3]))})


def test_nested_rank_meshes_flatten_row_major_and_ragged_ones_are_refused():
    from sglang.srt.weight_sync.source_layout import _flatten

    assert _flatten(3) == ((), (3,))
    assert _flatten([]) == ((0,), ())
    assert _flatten([[], []]) == ((2, 0), ())
    assert _flatten([2, None, 0]) == ((3,), (2, None, 0))
    assert _flatten([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]) == (
        (2, 2, 2),
        tuple(range(8)),
    )
    for ragged in ([[0, 1], [2]], [[0, 1], 2], [0, [1]], [[0, 1], ["2", 3]]):
        with pytest.raises(LayoutError, match="ragged rank mesh"):
            _flatten(ragged)


def test_tensors_of_one_layout_share_a_spec_and_its_description():
    """``MeshRanks.spec_of`` hands one ``MeshSpec`` per layout (shape, dtype, mesh,
    placements), and ``describe_specs`` describes each once: the same holders as one
    ``describe`` per tensor, each under its own name."""
    from types import SimpleNamespace

    from sglang.srt.weight_sync.source_layout import MeshRanks, describe_specs

    mesh_a = SimpleNamespace(mesh=torch.tensor([0, 1]))
    mesh_b = SimpleNamespace(mesh=torch.tensor([1, 0]))

    def dtensor(shape, mesh, placements, dtype=torch.float32):
        return SimpleNamespace(
            shape=torch.Size(shape),
            dtype=dtype,
            device_mesh=mesh,
            placements=placements,
        )

    ranks = MeshRanks()
    tensors = {
        "e0": dtensor((8, 4), mesh_a, (Shard(0),)),
        "e1": dtensor((8, 4), mesh_a, (Shard(0),)),
        "rows": dtensor((8, 4), mesh_a, (Shard(1),)),
        "other_mesh": dtensor((8, 4), mesh_b, (Shard(0),)),
        "other_shape": dtensor((6, 4), mesh_a, (Shard(0),)),
        "other_dtype": dtensor((8, 4), mesh_a, (Shard(0),), torch.bfloat16),
        # torch 2.9 has Shard(0) == _StridedShard(0, sf): the key never relies on it
        "strided2": dtensor((8, 4), mesh_a, (_StridedShard(0, split_factor=2),)),
        "strided4": dtensor((8, 4), mesh_a, (_StridedShard(0, split_factor=4),)),
    }
    specs = {n: ranks.spec_of(t) for n, t in tensors.items()}
    assert specs["e0"] is specs["e1"]
    assert len({id(s) for s in specs.values()}) == 7
    assert specs["strided4"].placements == (_StridedShard(0, split_factor=4),)
    described = describe_specs(specs.items())
    assert described == {n: s.describe(n) for n, s in specs.items()}
    assert [h.buffer for h in described["e1"].holders] == ["e1", "e1"]
    assert described["e1"].holders.geometry is described["e0"].holders.geometry
    assert described["other_mesh"].box_of(1) == described["e0"].box_of(0)


def test_a_trainers_description_is_reused_while_names_and_layouts_stay():
    """``Described`` (kept by ``TrainerSync`` and ``RemoteSync``): the same names with the
    same ``MeshSpec`` objects (``MeshRanks`` hands them update after update) give the last
    description, its memo and side; a changed layout or name describes anew and drops
    the memo."""
    from types import SimpleNamespace

    from sglang.srt.weight_sync.source_layout import Described
    from sglang.srt.weight_sync.trainer_flow import described_side

    mesh = SimpleNamespace(mesh=torch.tensor([0, 1]))

    def dtensor(shape, placements=(Shard(0),)):
        return SimpleNamespace(
            shape=torch.Size(shape),
            dtype=torch.float32,
            device_mesh=mesh,
            placements=placements,
        )

    described = Described()

    def shards(tensors):
        return [(n, described.meshes.spec_of(t)) for n, t in tensors.items()]

    tensors = {f"e{i}": dtensor((8, 4)) for i in range(3)}
    first = described.sources(shards(tensors))
    assert first == {n: s.describe(n) for n, s in shards(tensors)}
    assert described.sources(shards(tensors)) is first
    assert described_side(described, first, [[0, 1]]) == "engine"
    # pr: scale
    # each engine lacks rows
    assert described_side(described, first, [[0], [1]]) == "trainer"
    # pr: scale end
    # a side this build does not reshard on: refused before anything moves
    with pytest.raises(LayoutError, match="mode='sideways'"):
        described_side(described, first, [[0, 1]], "sideways")
    described.memo["wire"] = b"kept"
    assert described.sources(shards(tensors)) is first and described.memo["wire"]
    tensors["e1"] = dtensor((8, 4), (Shard(1),))
    second = described.sources(shards(tensors))
    assert second is not first and second["e1"] == described.meshes.spec_of(
        tensors["e1"]
    ).describe("e1")
    assert "wire" not in described.memo and not described.current(first)
    renamed = described.sources(shards({"x" + n: t for n, t in tensors.items()}))
    assert renamed is not second and sorted(renamed) == ["xe0", "xe1", "xe2"]
