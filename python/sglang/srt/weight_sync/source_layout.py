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
import operator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import (
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import (
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from sglang.srt.weight_sync.box import Box

__all__ = (
    "Described",
    "Holder",
    "HoldersSpec",
    "LayoutError",
    "MeshGeometry",
    "MeshHolders",
    "MeshRanks",
    "MeshSpec",
    "SourceLayout",
    "SourceTensor",
    "describe_mesh",
    "describe_specs",
)

NestedRanks = Union[int, Sequence["NestedRanks"]]
T = TypeVar("T")


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


@dataclass(frozen=True, eq=False)
class MeshGeometry:
    """The holders of every tensor of one shape on one mesh layout, less the buffer name:
    ``(rank, box, offsets in the local buffer, local shape)`` in mesh order. A model has
    tens of thousands of tensors but a few dozen geometries, so each is computed once
    and shared. ``layout`` is what it follows from: mesh shape, the mesh's ranks in the
    plan's group (None: outside it), placements in their wire form."""

    shape: Tuple[int, ...]
    layout: tuple
    entries: Tuple[Tuple[int, Box, Tuple[int, ...], Tuple[int, ...]], ...]
    # the planner's index of these holders, built on first use and shared with the geometry
    index: list = field(default_factory=list, compare=False, repr=False)


class MeshHolders(SequenceABC):
    """The holders of a tensor a mesh describes, as ``Holder``s made on demand from its
    shared ``MeshGeometry``: describing a tensor costs the same however many ranks hold
    it (a large trainer describes tens of thousands of tensors per update, millions of
    holders among them), and the planner indexes the geometry once for all its tensors.
    Compares equal to the same holders listed one by one."""

    __slots__ = ("geometry", "buffer")

    def __init__(self, geometry: MeshGeometry, buffer: str) -> None:
        self.geometry, self.buffer = geometry, buffer

    def __len__(self) -> int:
        return len(self.geometry.entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        rank, box, offsets, local_shape = self.geometry.entries[i]
        return Holder(rank, box, self.buffer, offsets, local_shape)

    def __iter__(self) -> Iterator[Holder]:
        buffer = self.buffer
        return (
            Holder(r, box, buffer, offsets, local)
            for r, box, offsets, local in self.geometry.entries
        )

    def __eq__(self, other) -> bool:
        if isinstance(other, MeshHolders) and other.geometry is self.geometry:
            return other.buffer == self.buffer
        if isinstance(other, (MeshHolders, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"MeshHolders({self.buffer!r}, layout={self.geometry.layout!r})"


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """A global tensor and its holders (DP replicas repeat boxes): listed one by one, or
    ``MeshHolders`` when a mesh describes the tensor."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    holders: Sequence[Holder]

    def box_of(self, rank: int) -> Optional[Box]:
        """The one box ``rank`` holds (None when it holds none)."""
        boxes = [h.box for h in self.holders if h.rank == rank]
        if len(boxes) > 1:
            raise LayoutError(
                f"tensor {self.name!r}: rank {rank} holds {len(boxes)} boxes, not one"
            )
        return boxes[0] if boxes else None


SourceLayout = Dict[str, SourceTensor]


_RANK_TYPES = {int, type(None)}


def _flatten(ranks: NestedRanks) -> Tuple[Tuple[int, ...], Tuple[Optional[int], ...]]:
    """Shape and row-major flat list of a nested list of ranks (None marks an absent rank).
    Level by level, not rank by rank: every tensor of an update brings its mesh (up to
    every trainer rank) to be flattened."""
    if ranks is None or isinstance(ranks, int):
        return (), (ranks,)
    items = list(ranks)
    shape = [len(items)]
    while items and not (items[0] is None or isinstance(items[0], int)):
        n = len(items[0])
        if any(x is None or isinstance(x, int) or len(x) != n for x in items):
            raise LayoutError(
                f"ragged rank mesh {ranks!r} (expected nested lists of int ranks, of equal lengths)"
            )
        shape.append(n)
        items = [r for x in items for r in x]
    if not set(map(type, items)) <= _RANK_TYPES:
        raise LayoutError(
            f"ragged rank mesh {ranks!r} (expected nested lists of int ranks, of equal lengths)"
        )
    return tuple(shape), tuple(items)


Runs = Tuple[
    Tuple[int, int, int], ...
]  # (global start, local start, length) along one dim


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
    shape: Tuple[int, ...], mesh_shape: Tuple[int, ...], wire: Tuple[tuple, ...]
) -> Tuple[Tuple[Tuple[int, ...], Tuple[Tuple[Box, Tuple[int, ...]], ...]], ...]:
    """At every mesh coordinate (row-major): local shape and (box, local offsets) pieces,
    for placements in their wire form (torch 2.9's ``Shard(0) == _StridedShard(0, sf)``
    must not make two layouts one cache entry).

    Each tensor dim gets an index ``arange(size)`` shaped to that dim, split by
    every placement on it in mesh order with the placement's own ``_split_tensor``
    (what ``distribute_tensor`` does); the runs of consecutive indices left on a
    coordinate are its boxes along that dim, and boxes are their products.
    """
    placements = tuple(_placement_from_wire(p) for p in wire)
    coords = [()]
    for size in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    out = []
    for coord in coords:
        per_dim = []
        for d, size in enumerate(shape):
            index = torch.arange(size).view(
                (1,) * d + (size,) + (1,) * (len(shape) - d - 1)
            )
            for m, place in enumerate(placements):
                if isinstance(place, (Shard, _StridedShard)) and place.dim == d:
                    chunks, _ = place._split_tensor(
                        index, mesh_shape[m], with_padding=False, contiguous=False
                    )
                    index = (
                        chunks[coord[m]]
                        if coord[m] < len(chunks)
                        else index.narrow(d, 0, 0)
                    )
            per_dim.append(_runs(index.flatten()))
        local_shape = tuple(sum(n for _, _, n in runs) for runs in per_dim)
        pieces = [((), ())]
        for runs in per_dim:
            pieces = [
                (g + (g0,), l + ((l0, n),)) for g, l in pieces for g0, l0, n in runs
            ]
        out.append(
            (
                local_shape,
                tuple(
                    (Box(g, tuple(n for _, n in l)), tuple(l0 for l0, _ in l))
                    for g, l in pieces
                ),
            )
        )
        if any(
            s == 0 for s in local_shape
        ):  # an empty shard holds an empty box, as DTensor reports it
            out[-1] = (
                local_shape,
                ((Box((0,) * len(shape), local_shape), (0,) * len(shape)),),
            )
    return tuple(out)


def _placement_wire(p: Placement) -> tuple:
    """A placement as builtins: ("S", dim), ("SS", dim, split factor), ("R",), or its type's
    name (refused on arrival). ``_StridedShard`` goes first: torch 2.9 makes it a ``Shard``
    subclass (and ``Shard(d) == _StridedShard(d, ...)``); its split factor is an int from
    ``_split_factor_int()`` where torch has it (2.13), else ``split_factor`` (2.9, 2.11)."""
    return _wire_of(type(p), p)


@functools.lru_cache(maxsize=1024)
def _wire_of(kind: type, p: Placement) -> tuple:
    """``_placement_wire``, remembered: torch's placement isinstance checks are slow, and
    every tensor of every update asks. Keyed by type too, as torch 2.9's ``Shard(0)``
    equals ``_StridedShard(0, sf)``."""
    if isinstance(p, _StridedShard):
        split = getattr(p, "_split_factor_int", None)
        return ("SS", p.dim, int(split() if split is not None else p.split_factor))
    if isinstance(p, Shard):
        return ("S", p.dim)
    if isinstance(p, Replicate):
        return ("R",)
    return (kind.__name__,)


def _placement_from_wire(p: tuple) -> Placement:
    if p[0] == "S":
        return Shard(int(p[1]))
    if p[0] == "SS":
        return _StridedShard(int(p[1]), split_factor=int(p[2]))
    if p[0] == "R":
        return Replicate()
    raise LayoutError(f"placement {p[0]} is not supported")


@functools.lru_cache(maxsize=4096)
def _mesh_geometry(
    shape: Tuple[int, ...],
    mesh_shape: Tuple[int, ...],
    flat: Tuple[Optional[int], ...],
    wire: Tuple[tuple, ...],
) -> MeshGeometry:
    entries = tuple(
        (int(rank), box, offsets, local_shape)
        for rank, (local_shape, pieces) in zip(
            flat, _mesh_pieces(shape, mesh_shape, wire)
        )
        if rank is not None
        for box, offsets in pieces
    )
    return MeshGeometry(shape, (mesh_shape, flat, wire), entries)


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
    wire = tuple(_placement_wire(p) for p in placements)
    for p, w in zip(placements, wire):
        if w[0] not in ("S", "SS", "R"):
            raise LayoutError(
                f"tensor {name!r}: placement {p} is not supported (Partial sums need a reduction)"
            )
        if w[0] != "R" and not 0 <= w[1] < len(shape):
            raise LayoutError(f"tensor {name!r}: {p} on a {len(shape)}-d tensor")
    if rank_map is not None:
        flat = tuple(rank_map.get(r) for r in flat)
    return SourceTensor(
        name,
        shape,
        dtype,
        MeshHolders(_mesh_geometry(shape, mesh_shape, flat, wire), name),
    )


def describe_specs(
    specs: Iterable[Tuple[str, Union[MeshSpec, HoldersSpec]]],
    rank_map: Optional[Mapping[int, int]] = None,
) -> SourceLayout:
    """Each spec's ``describe``, a ``MeshSpec`` object described once: the tensors that
    share one (``MeshRanks.spec_of``) differ only in their names."""
    out: SourceLayout = {}
    described: Dict[int, Tuple[MeshSpec, SourceTensor]] = {}
    for name, spec in specs:
        known = described.get(id(spec))
        if known is None or known[0] is not spec:
            out[name] = spec.describe(name, rank_map)
            if isinstance(out[name].holders, MeshHolders):
                described[id(spec)] = (spec, out[name])
            continue
        first = known[1]
        out[name] = SourceTensor(
            name, first.shape, first.dtype, MeshHolders(first.holders.geometry, name)
        )
    return out


class Described:
    """The last update's description of a trainer rank's tensors, kept by what drives its
    updates (``TrainerSync``, ``RemoteSync``): a training run hands the same tensors in
    the same layouts over every step, and describing a MoE model's tens of thousands of
    them anew costs a trainer rank a tenth of a second. ``meshes`` hands one ``MeshSpec``
    object per layout, update after update, so the same names with the same spec objects
    are the same description (``sources``, read-only). ``memo``: what a caller derives
    from that description (its wire form, the side chosen for it), dropped with it."""

    def __init__(self) -> None:
        self.meshes = MeshRanks()
        self.memo: Dict[object, object] = {}
        self._names: List[str] = []
        self._specs: List[object] = []
        self._sources: Optional[SourceLayout] = None

    def sources(self, specs: Sequence[Tuple[str, object]]) -> SourceLayout:
        """The layout (name, spec) pairs ``specs`` describe (``describe_specs``); the last
        one when their names and spec objects are the last update's."""
        names = list(map(operator.itemgetter(0), specs))
        objects = list(map(operator.itemgetter(1), specs))
        if (
            self._sources is not None
            and names == self._names
            and len(objects) == len(self._specs)
            and all(map(operator.is_, objects, self._specs))
        ):
            return self._sources
        self._sources = describe_specs(zip(names, objects))
        self._names, self._specs, self.memo = names, objects, {}
        return self._sources

    def current(self, sources: SourceLayout) -> bool:
        """Whether ``sources`` is the description kept (its ``memo`` then applies)."""
        return sources is self._sources

    def remembered(
        self, sources: SourceLayout, key: object, make: Callable[[], T]
    ) -> T:
        """``make()``, kept in ``memo`` under ``key`` while ``sources`` is the description
        kept (computed each time for any other)."""
        if not self.current(sources):
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


class MeshRanks:
    """A device mesh's global ranks in mesh order (``DeviceMesh.mesh.tolist()``), each mesh
    read once: torch computes ``DeviceMesh.mesh`` anew on every access (2.13 through its
    layout algebra, about 65 us), which a model's tens of thousands of DTensors on one or
    two meshes would pay per tensor; and one ``MeshSpec`` object per layout. Lives as long
    as its owner (a description, or a trainer's sync from update to update); it keeps the
    meshes it read alive, so their ids stay theirs, and forgets them all past
    ``MAX_MESHES`` (a trainer making a new mesh every update)."""

    MAX_MESHES = 64

    def __init__(self) -> None:
        self._read: Dict[int, Tuple[object, NestedRanks]] = {}
        self._specs: Dict[tuple, MeshSpec] = {}
        self._placed: Dict[int, Tuple[tuple, tuple]] = {}  # id -> (placements, key)

    def __call__(self, mesh) -> NestedRanks:
        known = self._read.get(id(mesh))
        if known is None or known[0] is not mesh:
            if len(self._read) >= self.MAX_MESHES:
                self._read.clear()
                self._specs.clear()
                self._placed.clear()
            known = self._read[id(mesh)] = (mesh, mesh.mesh.tolist())
        return known[1]

    def full(
        self, shape: Sequence[int], dtype: torch.dtype, ranks: Sequence[int]
    ) -> MeshSpec:
        """``MeshSpec.full``, one object per shape, dtype and ranks."""
        key = (tuple(shape), dtype, tuple(ranks))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = MeshSpec.full(shape, dtype, ranks)
        return spec

    def spec_of(self, tensor: DTensor) -> MeshSpec:
        """``MeshSpec.of_dtensor``, one object per layout: the experts of a MoE model share
        a few, and ``describe_specs`` then describes each layout once."""
        mesh = tensor.device_mesh
        places = tensor.placements
        # DTensors of one layout share their placements tuple: its key is made once (the
        # tuple is kept, so its id stays its own)
        placed = self._placed.get(id(places))
        if placed is None or placed[0] is not places:
            if len(self._placed) >= self.MAX_MESHES:
                self._placed.clear()
            placed = (places, tuple(map(_placement_key, places)))
            self._placed[id(places)] = placed
        key = (tensor.shape, tensor.dtype, id(mesh), placed[1])
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = MeshSpec(
                tuple(tensor.shape), tensor.dtype, self(mesh), tuple(places)
            )
        return spec


def _placement_key(p: Placement) -> tuple:
    """A placement as a key that never relies on its ``__eq__`` (torch 2.9's ``Shard(0)``
    equals ``_StridedShard(0, sf)``): its type, dim and split factor."""
    split = getattr(p, "_split_factor_int", None)
    return (
        type(p),
        getattr(p, "dim", None),
        split() if split is not None else getattr(p, "split_factor", None),
    )


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
    def of_dtensor(tensor: DTensor, ranks: Optional[MeshRanks] = None) -> MeshSpec:
        """A DTensor's layout from its mesh and placements; its data is never touched.
        ``ranks``: the mesh ranks read so far, for many DTensors on few meshes."""
        if ranks is not None:
            return ranks.spec_of(tensor)
        return MeshSpec(
            tuple(tensor.shape),
            tensor.dtype,
            tensor.device_mesh.mesh.tolist(),
            tuple(tensor.placements),
        )

    @staticmethod
    def sharded(
        shape: Sequence[int], dtype: torch.dtype, dim: int, ranks: NestedRanks
    ) -> MeshSpec:
        """Megatron-style explicit shards: ``ranks[i]`` holds chunk i of ``dim``;
        a 2-d ``ranks`` lists DP replicas (one row per replica)."""
        mesh_shape, _ = _flatten(ranks)
        placements = (Replicate(),) * (len(mesh_shape) - 1) + (Shard(dim),)
        return MeshSpec(tuple(shape), dtype, ranks, placements)

    @staticmethod
    def full(
        shape: Sequence[int], dtype: torch.dtype, ranks: Sequence[int]
    ) -> MeshSpec:
        """Every listed rank holds the whole tensor."""
        return MeshSpec(tuple(shape), dtype, list(ranks), (Replicate(),))

    def describe(
        self, name: str, rank_map: Optional[Mapping[int, int]] = None
    ) -> SourceTensor:
        return describe_mesh(
            name, self.shape, self.dtype, self.mesh, self.placements, rank_map
        )

    def to_wire(self) -> tuple:
        return (
            tuple(self.shape),
            str(self.dtype).removeprefix("torch."),
            self.mesh,
            tuple(_placement_wire(p) for p in self.placements),
        )

    @staticmethod
    def from_wire(wire: tuple) -> MeshSpec:
        shape, dtype, mesh, places = wire
        dt = _dtype_from_wire(dtype)
        return MeshSpec(
            tuple(int(s) for s in shape),
            dt,
            mesh,
            tuple(_placement_from_wire(p) for p in places),
        )


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

    def describe(
        self, name: str, rank_map: Optional[Mapping[int, int]] = None
    ) -> SourceTensor:
        holders = self.holders
        if rank_map is not None:
            holders = tuple(
                Holder(rank_map[h.rank], h.box, h.buffer, h.offsets, h.buffer_shape)
                for h in holders
                if h.rank in rank_map
            )
        return SourceTensor(name, self.shape, self.dtype, holders)

    def to_wire(self) -> tuple:
        return (
            "holders",
            tuple(self.shape),
            str(self.dtype).removeprefix("torch."),
            tuple(
                (
                    h.rank,
                    h.box.offsets,
                    h.box.sizes,
                    h.buffer,
                    h.offsets,
                    h.buffer_shape,
                )
                for h in self.holders
            ),
        )

    @staticmethod
    def from_wire(wire: tuple) -> HoldersSpec:
        _, shape, dtype, holders = wire
        dt = _dtype_from_wire(dtype)
        return HoldersSpec(
            tuple(int(s) for s in shape),
            dt,
            tuple(
                Holder(int(r), Box(tuple(o), tuple(s)), str(b), tuple(lo), tuple(bs))
                for r, o, s, b, lo, bs in holders
            ),
        )
