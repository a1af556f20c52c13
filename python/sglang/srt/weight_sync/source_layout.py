"""Describe: which box of each (HF-named) tensor each rank holds.

A source layout is computed identically on every rank from small, shared facts
(global shape, a mesh of ranks, placements), never by exchanging data, so that
the planner can run everywhere without communication. Boxes come from torch's
own DTensor shard arithmetic; nothing here materialises a tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
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
class SourceTensor:
    """A global tensor and the ranks holding each of its boxes (DP replicas repeat boxes)."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    holders: Tuple[Tuple[int, Box], ...]

    def box_of(self, rank: int) -> Optional[Box]:
        for r, box in self.holders:
            if r == rank:
                return box
        return None


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


@functools.lru_cache(maxsize=65536)
def _mesh_boxes(
    shape: Tuple[int, ...], mesh_shape: Tuple[int, ...], placements: Tuple[Placement, ...]
) -> Tuple[Box, ...]:
    """Box held at every mesh coordinate (row-major), by torch's DTensor shard arithmetic."""
    boxes = []
    coords = [()]
    for size in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    for coord in coords:
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements
        )
        boxes.append(Box(tuple(int(o) for o in offset), tuple(int(s) for s in local)))
    return tuple(boxes)


def describe_mesh(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    mesh: NestedRanks,
    placements: Sequence[Placement],
    rank_map: Optional[Mapping[int, int]] = None,
) -> SourceTensor:
    """Boxes of a tensor placed on a mesh of ranks.

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
        if isinstance(p, _StridedShard):
            raise LayoutError(
                f"tensor {name!r}: placement {p} holds strided rows, not a box; "
                "reshard it to Shard/Replicate on the trainer first"
            )
        if not isinstance(p, (Shard, Replicate)):
            raise LayoutError(f"tensor {name!r}: placement {p} is not supported (Partial sums need a reduction)")
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            raise LayoutError(f"tensor {name!r}: {p} on a {len(shape)}-d tensor")
    holders = []
    for rank, box in zip(flat, _mesh_boxes(shape, mesh_shape, placements)):
        if rank is None:
            continue
        if rank_map is not None:
            if rank not in rank_map:
                continue
            rank = rank_map[rank]
        holders.append((int(rank), box))
    return SourceTensor(name, shape, dtype, tuple(holders))


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
        places = tuple(("S", p.dim) if isinstance(p, Shard) and not isinstance(p, _StridedShard) else ("R",)
                       if isinstance(p, Replicate) else (type(p).__name__,) for p in self.placements)
        return (tuple(self.shape), str(self.dtype).removeprefix("torch."), self.mesh, places)

    @staticmethod
    def from_wire(wire: tuple) -> "MeshSpec":
        shape, dtype, mesh, places = wire
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise LayoutError(f"unknown dtype {dtype!r}")
        decoded = []
        for p in places:
            if p[0] == "S":
                decoded.append(Shard(int(p[1])))
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
