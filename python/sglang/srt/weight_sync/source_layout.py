"""Describe: which boxes of each (HF-named) tensor each rank holds, and where.

A source is the mirror of a target piece: a ``Holder`` is a box of an HF tensor
held by a rank at an offset inside one of its local buffers. A DTensor shard is
one box at offset 0 of a buffer named after the tensor; a ``_StridedShard``
holds several boxes of one tensor in one buffer; a Megatron-core ``linear_qkv``
holds boxes of q, k and v (``megatron_layout``). The planner and executor only
read holders.

A source layout is computed identically on every rank from small, shared facts
(global shape, a mesh of ranks, placements), never by exchanging data, so that
the planner can run everywhere without communication. Which rows a mesh
coordinate holds comes from the placements' own split functions (torch's
DTensor semantics, ``_StridedShard`` included), applied to an index per tensor
dim; nothing here materialises a tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import (
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from sglang.srt.weight_sync.box import Box

NestedRanks = Union[int, Sequence["NestedRanks"]]


class LayoutError(ValueError):
    """A layout that cannot be described as boxes (named tensor and reason in the message)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """``box`` of an HF tensor, held by ``rank`` at ``buffer[offsets : offsets + box.sizes]``;
    ``buffer`` is the key the rank delivers its local tensor (of ``buffer_shape``) under."""

    rank: int
    box: Box
    buffer: str
    offsets: Tuple[int, ...]
    buffer_shape: Tuple[int, ...]

    def buffer_box(self, region: Box) -> Box:
        """``region`` (HF coordinates, inside ``box``) in the buffer's coordinates."""
        return region.relative_to(self.box).translate(self.offsets)


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """A global tensor and its holders (DP replicas repeat boxes). ``layout``, when a mesh
    describes the tensor, is what ``holders`` follow from together with ``name`` and
    ``shape`` (mesh shape, its ranks in the plan's group, placements): a digest hashes it
    once per distinct mesh instead of every holder of every tensor."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    holders: Tuple[Holder, ...]
    layout: Optional[tuple] = field(default=None, compare=False)

    def box_of(self, rank: int) -> Optional[Box]:
        """The one box ``rank`` holds (None when it holds none)."""
        boxes = [h.box for h in self.holders if h.rank == rank]
        if len(boxes) > 1:
            raise LayoutError(f"tensor {self.name!r}: rank {rank} holds {len(boxes)} boxes, not one")
        return boxes[0] if boxes else None


SourceLayout = Dict[str, SourceTensor]


def _flatten(ranks: NestedRanks) -> Tuple[Tuple[int, ...], Tuple[Optional[int], ...]]:
    """Shape and row-major flat list of a nested list of ranks (None marks an absent rank)."""
    if ranks is None or isinstance(ranks, int):
        return (), (ranks,)
    items = [_flatten(r) for r in ranks]
    inner = items[0][0] if items else ()
    if any(shape != inner for shape, _ in items):
        raise LayoutError(f"ragged rank mesh {ranks!r}")
    return (len(items),) + inner, tuple(r for _, flat in items for r in flat)


Runs = Tuple[Tuple[int, int, int], ...]  # (global start, local start, length) along one dim


def _runs(index: torch.Tensor) -> Runs:
    """Maximal runs of consecutive global indices in a local-to-global index map."""
    if index.numel() == 0:
        return ()
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [index.numel()]
    return tuple((int(index[a]), a, b - a) for a, b in zip(starts, ends))


@functools.lru_cache(maxsize=65536)
def _mesh_pieces(
    shape: Tuple[int, ...], mesh_shape: Tuple[int, ...], placements: Tuple[Placement, ...]
) -> Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[Box, Tuple[int, ...]], ...]], ...]:
    """At every mesh coordinate (row-major): local shape and (box, local offsets) pieces.

    Each tensor dim gets an index ``arange(size)`` shaped to that dim, split by
    every placement on it in mesh order with the placement's own ``_split_tensor``
    (what ``distribute_tensor`` does); the runs of consecutive indices left on a
    coordinate are its boxes along that dim, and boxes are their products.
    """
    coords = [()]
    for size in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    out = []
    for coord in coords:
        per_dim = []
        for d, size in enumerate(shape):
            index = torch.arange(size).view((1,) * d + (size,) + (1,) * (len(shape) - d - 1))
            for m, place in enumerate(placements):
                if isinstance(place, (Shard, _StridedShard)) and place.dim == d:
                    chunks, _ = place._split_tensor(index, mesh_shape[m], with_padding=False, contiguous=False)
                    index = chunks[coord[m]] if coord[m] < len(chunks) else index.narrow(d, 0, 0)
            per_dim.append(_runs(index.flatten()))
        local_shape = tuple(sum(n for _, _, n in runs) for runs in per_dim)
        pieces = [((), ())]
        for runs in per_dim:
            pieces = [(g + (g0,), l + ((l0, n),)) for g, l in pieces for g0, l0, n in runs]
        out.append((local_shape, tuple(
            (Box(g, tuple(n for _, n in l)), tuple(l0 for l0, _ in l)) for g, l in pieces
        )))
        if any(s == 0 for s in local_shape):  # an empty shard holds an empty box, as DTensor reports it
            out[-1] = (local_shape, ((Box((0,) * len(shape), local_shape), (0,) * len(shape)),))
    return tuple(out)


def _placement_wire(p: Placement) -> tuple:
    """A placement as builtins: ("S", dim), ("SS", dim, split factor), ("R",), or its type's
    name (refused on arrival). ``_StridedShard`` goes first: torch 2.9 makes it a ``Shard``
    subclass (and ``Shard(d) == _StridedShard(d, ...)``); its split factor is an int from
    ``_split_factor_int()`` where torch has it (2.13), else ``split_factor`` (2.9, 2.11)."""
    if isinstance(p, _StridedShard):
        split = getattr(p, "_split_factor_int", None)
        return ("SS", p.dim, int(split() if split is not None else p.split_factor))
    if isinstance(p, Shard):
        return ("S", p.dim)
    if isinstance(p, Replicate):
        return ("R",)
    return (type(p).__name__,)


def describe_mesh(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    mesh: NestedRanks,
    placements: Sequence[Placement],
    rank_map: Optional[Mapping[int, int]] = None,
) -> SourceTensor:
    """Holders of a tensor placed on a mesh of ranks, each in a buffer named ``name``.

    ``mesh`` holds the global ranks in mesh order (``DeviceMesh.mesh.tolist()``);
    ``rank_map`` translates them into the ranks of the group the plan runs over
    (ranks missing from it are outside that group and are dropped).
    """
    shape = tuple(int(s) for s in shape)
    mesh_shape, flat = _flatten(mesh)
    placements = tuple(placements)
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"tensor {name!r}: {len(placements)} placements for a {len(mesh_shape)}-d mesh"
        )
    for p in placements:
        if not isinstance(p, (Shard, _StridedShard, Replicate)):
            raise LayoutError(f"tensor {name!r}: placement {p} is not supported (Partial sums need a reduction)")
        if isinstance(p, (Shard, _StridedShard)) and not 0 <= p.dim < len(shape):
            raise LayoutError(f"tensor {name!r}: {p} on a {len(shape)}-d tensor")
    if rank_map is not None:
        flat = tuple(rank_map.get(r) for r in flat)
    holders = []
    for rank, (local_shape, pieces) in zip(flat, _mesh_pieces(shape, mesh_shape, placements)):
        if rank is not None:
            holders.extend(Holder(int(rank), box, name, offsets, local_shape) for box, offsets in pieces)
    layout = (mesh_shape, flat, tuple(_placement_wire(p) for p in placements))
    return SourceTensor(name, shape, dtype, tuple(holders), layout)


@dataclass(frozen=True)
class MeshSpec:
    """The facts a tensor's layout is computed from: global shape, dtype, the mesh of
    (trainer) ranks and one placement per mesh dim. Small and made of builtins on the
    wire, so it travels with every rank's payload and each receiver derives the same
    layout without talking to the others."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    mesh: NestedRanks
    placements: Tuple[Placement, ...]

    @staticmethod
    def of_dtensor(tensor: DTensor) -> "MeshSpec":
        return MeshSpec(tuple(tensor.shape), tensor.dtype, tensor.device_mesh.mesh.tolist(), tuple(tensor.placements))

    @staticmethod
    def sharded(shape: Sequence[int], dtype: torch.dtype, dim: int, ranks: NestedRanks) -> "MeshSpec":
        """Megatron-style explicit shards: ``ranks[i]`` holds chunk i of ``dim``;
        a 2-d ``ranks`` lists DP replicas (one row per replica)."""
        mesh_shape, _ = _flatten(ranks)
        placements = (Replicate(),) * (len(mesh_shape) - 1) + (Shard(dim),)
        return MeshSpec(tuple(shape), dtype, ranks, placements)

    @staticmethod
    def full(shape: Sequence[int], dtype: torch.dtype, ranks: Sequence[int]) -> "MeshSpec":
        return MeshSpec(tuple(shape), dtype, list(ranks), (Replicate(),))

    def describe(self, name: str, rank_map: Optional[Mapping[int, int]] = None) -> SourceTensor:
        return describe_mesh(name, self.shape, self.dtype, self.mesh, self.placements, rank_map)

    def to_wire(self) -> tuple:
        return (tuple(self.shape), str(self.dtype).removeprefix("torch."), self.mesh,
                tuple(_placement_wire(p) for p in self.placements))

    @staticmethod
    def from_wire(wire: tuple) -> "MeshSpec":
        shape, dtype, mesh, places = wire
        dt = _dtype_from_wire(dtype)
        decoded = []
        for p in places:
            if p[0] == "S":
                decoded.append(Shard(int(p[1])))
            elif p[0] == "SS":
                decoded.append(_StridedShard(int(p[1]), split_factor=int(p[2])))
            elif p[0] == "R":
                decoded.append(Replicate())
            else:
                raise LayoutError(f"placement {p[0]} is not supported")
        return MeshSpec(tuple(int(s) for s in shape), dt, mesh, tuple(decoded))


def describe_dtensor(
    name: str, tensor: DTensor, rank_map: Optional[Mapping[int, int]] = None
) -> SourceTensor:
    """Layout of a DTensor from its mesh and placements; its data is never touched."""
    return MeshSpec.of_dtensor(tensor).describe(name, rank_map)


def describe_sharded(
    name: str, shape: Sequence[int], dtype: torch.dtype, dim: int, ranks: NestedRanks
) -> SourceTensor:
    """Megatron-style explicit shards (see ``MeshSpec.sharded``)."""
    return MeshSpec.sharded(shape, dtype, dim, ranks).describe(name)


def describe_full(name: str, shape: Sequence[int], dtype: torch.dtype, ranks: Sequence[int]) -> SourceTensor:
    """Every listed rank holds the whole tensor."""
    return MeshSpec.full(shape, dtype, ranks).describe(name)


def _dtype_from_wire(dtype: str) -> torch.dtype:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"unknown dtype {dtype!r}")
    return dt


@dataclass(frozen=True)
class HoldersSpec:
    """An HF tensor's holders listed one by one (trainer ranks), for sources no mesh
    describes (Megatron-core fused parameters, ``megatron_layout``). Builtins on the
    wire, like ``MeshSpec``, so it travels with a payload."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    holders: Tuple[Holder, ...]

    def describe(self, name: str, rank_map: Optional[Mapping[int, int]] = None) -> SourceTensor:
        holders = self.holders
        if rank_map is not None:
            holders = tuple(Holder(rank_map[h.rank], h.box, h.buffer, h.offsets, h.buffer_shape)
                            for h in holders if h.rank in rank_map)
        return SourceTensor(name, self.shape, self.dtype, holders)

    def to_wire(self) -> tuple:
        return ("holders", tuple(self.shape), str(self.dtype).removeprefix("torch."), tuple(
            (h.rank, h.box.offsets, h.box.sizes, h.buffer, h.offsets, h.buffer_shape) for h in self.holders))

    @staticmethod
    def from_wire(wire: tuple) -> "HoldersSpec":
        _, shape, dtype, holders = wire
        dt = _dtype_from_wire(dtype)
        return HoldersSpec(tuple(int(s) for s in shape), dt, tuple(
            Holder(int(r), Box(tuple(o), tuple(s)), str(b), tuple(lo), tuple(bs)) for r, o, s, b, lo, bs in holders))

