"""Plan: who sends which box to whom. Pure functions, no communication.

Input: the source layout (which rank holds which box of each HF tensor), the
target layout (which boxes each rank needs and where they land) and the
topology (which ranks share a device or a node). Output: a ``Plan`` that every
rank computes identically:

* every target element gets exactly one source (uncovered -> ``CoverageError``
  naming tensor, box and rank);
* a box held on the receiving rank is copied locally, so each rank receives
  exactly (needed - held) bytes;
* otherwise the closest holder wins (same device, then same node), ties go to
  the least-loaded holder so DP replicas share the sending;
* identical bytes needed by several ranks from one holder become one move with
  several receivers (the executor sends it to each); everything else is one receiver;
* moves are cut and grouped into rounds so that no rank moves more than
  ``bucket_bytes`` in a round (the executor's memory cap).

Overlap search is an interval index on one dim per tensor, not an all-pairs scan.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.phase_timing import collector_paused
from sglang.srt.weight_sync.protocol import DEFAULT_BUCKET_BYTES
from sglang.srt.weight_sync.source_layout import (
    Holder,
    MeshGeometry,
    MeshHolders,
    SourceLayout,
    SourceTensor,
)
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

# isort: split
# pr: scale
import re

# pr: scale end

__all__ = (
    "DEFAULT_BUCKET_BYTES",
    "CoverageError",
    "Dest",
    "HolderIndex",
    "LeastLoaded",
    "Move",
    "Plan",
    "PlanCache",
    "Topology",
    "ZeroFill",
    "box_index",
    "first_uncovered",
    "holder_boxes",
    "inputs_fingerprint",
    "landing",
    "landing_order",
    "plan",
    "resolve_aliases",
    "sources_digest",
    "targets_key",
    "uncovered",
    # pr: scale
    "name_order",
    # pr: scale end
    # pr: here
    "forget_indexes",
    # pr: here end
)


class CoverageError(ValueError):
    """A target region no source rank holds."""


# pr: scale
_DIGITS = re.compile(r"(\d+)")


def name_order(name: str) -> Tuple:
    """A tensor name's place in the order plans list moves in: numbers as numbers
    ("experts.2" before "experts.10"), the order a model holds its layers and experts in,
    so that consecutive moves lie back to back on both ends and their copies join
    (``copy_program``). The name itself breaks ties ("x01" and "x1"): a total order."""
    parts = _DIGITS.split(name)
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


# pr: scale end
@dataclass(frozen=True, slots=True)
class Topology:
    """Where ranks live. Ranks on one device exchange over local IPC; on one node, NVLink."""

    device_of: Mapping[int, int] = field(default_factory=dict)
    node_of: Mapping[int, int] = field(default_factory=dict)

    def device(self, rank: int):
        """A rank not listed has a device of its own."""
        return self.device_of.get(rank, ("rank", rank))

    def node(self, rank: int) -> int:
        """A rank not listed is on node 0."""
        return self.node_of.get(rank, 0)

    def distance(self, a: int, b: int) -> int:
        """0 same rank, 1 same device, 2 same node, 3 across nodes."""
        if a == b:
            return 0
        if self.device(a) == self.device(b):
            return 1
        return 2 if self.node(a) == self.node(b) else 3


@dataclass(frozen=True, slots=True)
class Dest:
    """Where a moved region lands: ``param[index][region.translate(delta)]`` on ``rank``;
    ``shape`` is the shape of ``param[index]``. With ``perm`` (``Piece.perm``), parameter dim
    ``e`` takes region dim ``perm[e]``, offset by ``delta[e]``."""

    rank: int
    param: str
    index: Tuple[int, ...]
    delta: Tuple[int, ...]
    shape: Tuple[int, ...]
    perm: Optional[Tuple[int, ...]] = None

    def box(self, region: Box) -> Box:
        if self.perm is None:
            return region.translate(self.delta)
        return Box(
            tuple(region.offsets[q] + d for q, d in zip(self.perm, self.delta)),
            tuple(region.sizes[q] for q in self.perm),
        )


@dataclass(frozen=True, slots=True)
class Move:
    """One region of one HF tensor, read from a holder's buffer, written to ``dests``.

    ``region`` is in global (HF) coordinates, inside the box ``holder`` holds
    (``src_shard``) on rank ``src``. With one dest equal to ``src`` it is a local copy; one
    other dest, a point-to-point send; several, one send to each (the executor runs no
    broadcast subgroups, see ``executor.DataGroup``). Bytes are counted in the destination dtype, which
    is what travels: the sender casts.
    """

    tensor: str
    region: Box
    holder: Holder
    src_dtype: torch.dtype
    dtype: torch.dtype
    dests: Tuple[Dest, ...]
    # The regions as index tuples, worked out once with the move (a plan is cached, and an
    # update then slices tensors with them instead of computing boxes per region): in the
    # holder's buffer, and per dest in ``param[index]`` with the permutation that puts the
    # view's dims back in the region's order (None: already in it).
    src_index: Tuple[slice, ...] = field(init=False, compare=False, repr=False)
    dest_index: Tuple[Tuple[Tuple[slice, ...], Optional[Tuple[int, ...]]], ...] = field(
        init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "src_index", self.src_box().slices())
        object.__setattr__(
            self,
            "dest_index",
            tuple(
                (
                    d.box(self.region).slices(),
                    None
                    if d.perm is None
                    else tuple(sorted(range(len(d.perm)), key=d.perm.__getitem__)),
                )
                for d in self.dests
            ),
        )

    @property
    def src(self) -> int:
        return self.holder.rank

    @property
    def src_shard(self) -> Box:
        return self.holder.box

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.dtype.itemsize

    @property
    def group(self) -> Tuple[int, ...]:
        return (self.src,) + tuple(d.rank for d in self.dests)

    def src_box(self) -> Box:
        """The region in the coordinates of the source rank's local buffer."""
        return self.holder.buffer_box(self.region)


@dataclass(frozen=True, slots=True)
class ZeroFill:
    rank: int
    param: str
    box: Box


@dataclass(frozen=True)
class Plan:
    """The whole job, identical on every rank (``plan``), or one rank's part of it
    (``rank_plan.plan_for_rank``: only the moves it sends or receives, ``round_ids``
    naming its rounds in the order every rank runs them). ``rounds`` run in order; inside
    a round, every send and receive runs as one point-to-point batch.
    ``broadcast_groups``: the rank sets of moves with several receivers (a figure; they
    travel point-to-point).
    ``fingerprint`` is the digest of the inputs it was planned from: planning is
    deterministic, so ranks that agree on it run the same plan."""

    local: Tuple[Move, ...]
    rounds: Tuple[Tuple[Move, ...], ...]
    zero_fills: Tuple[ZeroFill, ...]
    broadcast_groups: Tuple[Tuple[int, ...], ...]
    needed_bytes: Mapping[int, int]
    held_bytes: Mapping[int, int]
    bucket_bytes: int
    fingerprint: str
    round_ids: Tuple[int, ...] = ()
    # what a rank's checks derive from the plan alone (``executor.check_inputs``), made on
    # first use: a plan runs every update of a run
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def lower_bound_bytes(self, rank: int) -> int:
        """Bytes ``rank`` must receive at the least: needed minus already held."""
        return self.needed_bytes.get(rank, 0) - self.held_bytes.get(rank, 0)

    def received_bytes(self, rank: int) -> int:
        return sum(
            m.nbytes
            for rnd in self.rounds
            for m in rnd
            for d in m.dests
            if d.rank == rank
        )

    def local_for(self, rank: int) -> List[Move]:
        return [m for m in self.local if m.src == rank]


class _BoxIndex:
    """Distinct boxes of a tensor with their holding ranks, indexed by start on one dim;
    ``position[(box, rank)]`` is that holder's place in ``SourceTensor.holders``. Built once
    per ``MeshGeometry`` (``box_index``) and shared by every tensor it describes: a rank's
    plan then costs what its own pieces cost, not what the holders of every tensor do."""

    __slots__ = (
        "dim",
        "boxes",
        "starts",
        "max_len",
        "position",
        "ranks_of",
        "_by_rank",
        "_disjoint",
        "_groups",
    )

    def __init__(self, shape: Tuple[int, ...], holders: Iterable[Tuple[int, Box]]):
        by_box: Dict[Box, List[int]] = {}
        self.position: Dict[Tuple[Box, int], int] = {}
        boxes: Dict[
            tuple, Box
        ] = {}  # one Box per region: tuple keys compare faster than dataclasses
        for i, (rank, box) in enumerate(holders):
            sizes = box.sizes
            if sizes and min(sizes) <= 0:
                continue
            box = boxes.setdefault((box.offsets, sizes), box)
            ranks = by_box.get(box)
            if ranks is None:
                ranks = by_box[box] = []
            ranks.append(rank)
            self.position[(box, rank)] = i
        ndim = len(shape)
        # Index the dim along which boxes differ most: shards split it, so few boxes overlap a query.
        self.dim = (
            max(range(ndim), key=lambda d: len({b.offsets[d] for b in by_box}))
            if ndim
            else 0
        )
        items = sorted(
            by_box.items(),
            key=lambda kv: (kv[0].offsets[self.dim], kv[0].offsets) if ndim else (),
        )
        self.boxes = [
            (box, tuple(ranks) if len(ranks) == 1 else tuple(sorted(ranks)))
            for box, ranks in items
        ]
        self.ranks_of: Dict[Box, Tuple[int, ...]] = dict(self.boxes)
        self.starts = [box.offsets[self.dim] if ndim else 0 for box, _ in items]
        self.max_len = (
            max((box.sizes[self.dim] for box, _ in items), default=0) if ndim else 1
        )
        self._by_rank: Optional[Dict[int, List[Tuple[Box, int]]]] = None
        self._disjoint: Optional[bool] = None
        self._groups: Tuple[Optional[Topology], Dict[Box, tuple]] = (None, {})

    # pr: scale
    def boxes_of(self, rank: int) -> List[Box]:
        """The non-empty boxes ``rank`` holds."""
        return [box for box, _ in self.own_of(rank)]

    # pr: scale end
    def own_of(self, rank: int) -> List[Tuple[Box, int]]:
        """(box, position) of every non-empty box ``rank`` holds."""
        if self._by_rank is None:
            by_rank = defaultdict(list)
            for (box, rank_), i in self.position.items():
                by_rank[rank_].append((box, i))
            self._by_rank = dict(by_rank)
        return self._by_rank.get(rank, ())

    def groups(self, box: Box, topology: Topology):
        """Holders of ``box`` grouped by device and node: the closest holders are found with
        two dict lookups instead of one Topology.distance call per holder. Filled on first
        use (most boxes are never asked about), for the topology of the plan being made."""
        seen, cache = self._groups
        if seen is not topology and seen != topology:
            cache = {}
            self._groups = (topology, cache)
        g = cache.get(box)
        if g is None:
            ranks = self.ranks_of[box]
            by_dev, by_node = defaultdict(list), defaultdict(list)
            device_of, node_of = topology.device_of, topology.node_of
            for r in ranks:
                by_dev[device_of.get(r, ("rank", r))].append(r)
                by_node[node_of.get(r, 0)].append(r)
            g = cache[box] = (frozenset(ranks), dict(by_dev), dict(by_node))
        return g

    @property
    def disjoint(self) -> bool:
        """Whether distinct boxes never overlap (every DTensor or Megatron layout): then the part
        of a need a box serves is just their intersection, whoever asks."""
        if self._disjoint is None:
            ends = (
                [
                    s + box.sizes[self.dim]
                    for s, (box, _) in zip(self.starts, self.boxes)
                ]
                if self.starts
                else []
            )
            # Boxes that follow one another on the indexed dim (any shard layout over one
            # mesh dim) are disjoint; otherwise ask the index box by box.
            self._disjoint = (
                bool(self.boxes)
                and self.boxes[0][0].ndim > 0
                and all(s >= e for s, e in zip(self.starts[1:], ends))
            ) or all(len(self.overlapping(box)) == 1 for box, _ in self.boxes)
        return self._disjoint

    def overlapping(self, need: Box) -> List[Tuple[Box, Tuple[int, ...]]]:
        if need.ndim == 0:
            return list(self.boxes)
        d = self.dim
        lo = need.offsets[d]
        hi = lo + need.sizes[d]
        first = bisect.bisect_left(self.starts, lo - self.max_len + 1)
        last = bisect.bisect_left(self.starts, hi)
        no, ns = (
            need.offsets,
            need.sizes,
        )  # overlap test without building the intersection Box
        return [
            (b, r)
            for b, r in self.boxes[first:last]
            if all(
                bo < o + s and o < bo + bs
                for bo, bs, o, s in zip(b.offsets, b.sizes, no, ns)
            )
        ]


def box_index(source: SourceTensor) -> _BoxIndex:
    """The index of ``source``'s holders: its geometry's, shared, when a mesh describes it."""
    holders = source.holders
    if not isinstance(holders, MeshHolders):
        return _BoxIndex(source.shape, ((h.rank, h.box) for h in holders))
    slot = holders.geometry.index
    if not slot:
        slot.append(
            _BoxIndex(
                holders.geometry.shape,
                ((r, box) for r, box, _, _ in holders.geometry.entries),
            )
        )
    return slot[0]


# pr: here
def forget_indexes(sources: SourceLayout) -> None:
    """Drop the holder indexes of ``sources``' geometries (a cold start, for timing)."""
    for source in sources.values():
        if isinstance(source.holders, MeshHolders):
            source.holders.geometry.index.clear()


# pr: here end
def holder_boxes(source: SourceTensor) -> List[Tuple[Box, Tuple[int, ...]]]:
    """The distinct non-empty boxes of ``source`` with the ranks holding each."""
    return box_index(source).boxes


def uncovered(
    source: SourceTensor, ranks: Optional[Collection[int]] = None
) -> Optional[Box]:
    """A region of the tensor that none of its holders (among ``ranks``, default all)
    has, or None when they cover it."""
    remaining = [Box.full(source.shape)]
    for box, holding in holder_boxes(source):
        if ranks is None or any(r in ranks for r in holding):
            remaining = [piece for rem in remaining for piece in rem.subtract(box)]
    return remaining[0] if remaining else None


def first_uncovered(
    sources: SourceLayout, engine_groups: Sequence[Sequence[int]]
) -> Optional[str]:
    """The first tensor that the trainer ranks beside some engine do not hold in full
    (then the engine alone cannot reshard it); None when every engine is covered. Tensors
    a mesh describes are covered or not by their shared geometry alone (a model's tens of
    thousands of tensors have a few dozen), so each geometry is checked once."""
    groups = [set(g) for g in engine_groups]
    by_geometry: Dict[int, bool] = {}
    for name in sorted(sources):
        source = sources[name]
        holders = source.holders
        if not isinstance(holders, MeshHolders):
            if any(uncovered(source, g) for g in groups):
                return name
            continue
        gap = by_geometry.get(id(holders.geometry))
        if gap is None:
            gap = by_geometry[id(holders.geometry)] = any(
                uncovered(source, g) for g in groups
            )
        if gap:
            return name
    return None


class HolderIndex:
    """One tensor's holders: its ``_BoxIndex`` (``dim``, ``boxes``, ``overlapping``,
    ``disjoint``) and the ``Holder`` behind each (box, rank)."""

    __slots__ = ("source", "index", "dim", "boxes")

    def __init__(self, source: SourceTensor):
        self.source, self.index = source, box_index(source)
        self.dim, self.boxes = self.index.dim, self.index.boxes

    @property
    def disjoint(self) -> bool:
        return self.index.disjoint

    def overlapping(self, need: Box) -> List[Tuple[Box, Tuple[int, ...]]]:
        return self.index.overlapping(need)

    def holds(self, box: Box, rank: int) -> bool:
        return (box, rank) in self.index.position

    def own_position(self, need: Box, rank: int) -> Optional[int]:
        """Where in ``source.holders`` this rank's holder is when it holds one box of the
        tensor (any layout over one mesh) and that box contains all of ``need``: a local copy
        with no search. None otherwise; the general search decides then."""
        mine = self.index.own_of(rank)
        if len(mine) != 1:
            return None
        box, position = mine[0]
        return position if box.contains(need) else None

    def holder(self, box: Box, rank: int) -> Holder:
        return self.source.holders[self.index.position[(box, rank)]]

    def closest(self, box: Box, ranks: Tuple[int, ...], rank: int, topology: Topology):
        """(distance, holders at that distance) of ``box`` seen from ``rank``: this rank,
        else holders on its device, else on its node, else all (``Topology.distance``)."""
        if len(ranks) == 1:
            return (
                (0, ranks)
                if ranks[0] == rank
                else (topology.distance(rank, ranks[0]), ranks)
            )
        members, by_dev, by_node = self.index.groups(box, topology)
        if rank in members:
            return 0, (rank,)
        near = by_dev.get(topology.device(rank))
        if near:
            return 1, near
        near = by_node.get(topology.node(rank))
        if near:
            return 2, near
        return 3, ranks


class LeastLoaded:
    """The holder among ``near`` that has sent the fewest bytes so far (ties: lowest rank),
    from a heap per holder group: loads only grow, so an entry whose load is stale is
    refreshed when it reaches the top, and the first fresh top is the minimum."""

    def __init__(self, sent: Mapping[int, int]) -> None:
        self.sent = sent
        self.heaps: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}

    def pick(self, near: Sequence[int]) -> int:
        key = tuple(near)
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = sorted((self.sent.get(r, 0), r) for r in key)
        while True:
            load, rank = heap[0]
            now = self.sent.get(rank, 0)
            if now == load:
                return rank
            heapq.heapreplace(heap, (now, rank))


def plan(
    sources: SourceLayout,
    targets: Mapping[int, Sequence[ParamTarget]],
    topology: Optional[Topology] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    aliases: Optional[Mapping[str, str]] = None,
    fingerprint: str = "",
    local_ranks: Optional[Collection[int]] = None,
) -> Plan:
    """Compute the plan. Deterministic: same inputs, same plan, on every rank.

    ``targets`` maps each rank to its parameters; ``aliases`` maps a source
    name to the target tensor name it carries (tied embeddings). ``fingerprint``:
    the inputs' digest when the caller has it (``PlanCache``), else computed here.
    ``local_ranks``: list local copies for these ranks only (None: all). A rank runs
    only its own, and in an aligned engine they are most of the moves, so each engine
    rank lists its own; every rank's held
    bytes are counted either way, and the rounds are the same.
    """
    with collector_paused():
        fingerprint = fingerprint or inputs_fingerprint(
            sources, targets, topology, bucket_bytes, aliases
        )
        return _plan(
            sources, targets, topology, bucket_bytes, aliases, fingerprint, local_ranks
        )


def _plan(
    sources, targets, topology, bucket_bytes, aliases, fingerprint: str, local_ranks
) -> Plan:
    """``plan``'s steps: assign a source to every element of every piece, rank by rank
    (``_Assignment``), then cut the remote moves into rounds under ``bucket_bytes``."""
    work = _Assignment(resolve_aliases(sources, aliases or {}), topology or Topology())
    for rank in sorted(targets):
        work.assign_rank(
            rank, targets[rank], listed=local_ranks is None or rank in local_ranks
        )
    moves = [
        _move(work.sources[key[0]], key, tuple(dests))
        for key, dests in work.remote.items()
    ]
    rounds = _bucket(moves, bucket_bytes)
    groups = sorted(
        {
            tuple(sorted(set(m.group)))
            for rnd in rounds
            for m in rnd
            if len({d.rank for d in m.dests}) > 1
        }
    )
    return Plan(
        tuple(work.local),
        rounds,
        tuple(work.zero_fills),
        tuple(groups),
        dict(work.needed),
        dict(work.held),
        bucket_bytes,
        fingerprint,
    )


def landing_order(piece: Piece) -> Tuple:
    """Pieces in the order they lie in their parameter (a fused expert weight's experts
    one after another), whatever order the loader recorded them in."""
    return (piece.index, piece.offsets)


class _Assignment:
    """Who sends each element, built piece by piece: local copies (``local``, for the
    listed ranks), remote regions with their destinations (``remote``, keyed by tensor,
    region, holder and dtype so that identical needs share one move), zero fills, and
    per rank the bytes it needs and holds."""

    def __init__(self, sources: SourceLayout, topology: Topology) -> None:
        self.sources, self.topology = sources, topology
        self.index: Dict[str, HolderIndex] = {}
        self.sent: Dict[int, int] = defaultdict(int)
        self.least_loaded = LeastLoaded(self.sent)
        self.needed: Dict[int, int] = {}
        self.held: Dict[int, int] = {}
        self.local: List[Move] = []
        self.remote: Dict[Tuple, List[Dest]] = {}
        self.zero_fills: List[ZeroFill] = []

    def assign_rank(
        self, rank: int, targets: Sequence[ParamTarget], listed: bool
    ) -> None:
        """Every piece of ``rank``'s targets; its local copies are listed only when ``listed``."""
        self.needed[rank] = self.held[rank] = 0
        for target in targets:
            self.zero_fills.extend(
                ZeroFill(rank, target.name, box) for box in target.zeros
            )
            for piece in sorted(target.pieces, key=landing_order):
                self.assign_piece(rank, target, piece, listed)

    def _holders(
        self, piece: Piece, target: ParamTarget, rank: int
    ) -> Tuple[SourceTensor, HolderIndex]:
        source = self.sources.get(piece.tensor)
        if source is None:
            raise CoverageError(
                f"tensor {piece.tensor!r} (for {target.name} on rank {rank}) has no source on any rank"
            )
        holders = self.index.get(piece.tensor)
        if holders is None:
            holders = self.index[piece.tensor] = HolderIndex(source)
        return source, holders

    def assign_piece(
        self, rank: int, target: ParamTarget, piece: Piece, listed: bool
    ) -> None:
        """One piece: a local copy when this rank holds it whole (most pieces when layouts
        align), else ``_cover``."""
        source, holders = self._holders(piece, target, rank)
        nbytes = piece.box.numel * target.dtype.itemsize
        self.needed[rank] += nbytes
        own = holders.own_position(piece.box, rank)
        if own is None:
            self._cover(rank, target, piece, source, holders, listed)
            return
        self.held[rank] += nbytes
        if listed:
            self.local.append(
                Move(
                    piece.tensor,
                    piece.box,
                    source.holders[own],
                    source.dtype,
                    target.dtype,
                    (Dest(rank, *landing(target, piece)),),
                )
            )

    def _cover(
        self,
        rank: int,
        target: ParamTarget,
        piece: Piece,
        source: SourceTensor,
        holders: HolderIndex,
        listed: bool,
    ) -> None:
        """Cover the piece with holder boxes: those on this rank first, then by their closest
        holder, then by position; each takes what it covers of the rest (slab subtraction).
        Among the closest holders of a box the least loaded sends, so DP replicas share the work."""
        itemsize = target.dtype.itemsize
        dest = Dest(rank, *landing(target, piece))
        remaining = [piece.box]
        keyed = [
            (holders.closest(box, ranks, rank, self.topology), box)
            for box, ranks in holders.overlapping(piece.box)
        ]
        keyed.sort(key=lambda k: (k[0][0], k[1].offsets))
        for (_, near), box in keyed:
            next_remaining = []
            for rem in remaining:
                if box.contains(
                    rem
                ):  # the common case: one holder box covers the piece
                    region = rem
                else:
                    region = rem.intersect(box)
                    if region is None:
                        next_remaining.append(rem)
                        continue
                    next_remaining.extend(rem.subtract(box))
                src = near[0] if len(near) == 1 else self.least_loaded.pick(near)
                if src == rank:
                    self.held[rank] += region.numel * itemsize
                    if listed:
                        self.local.append(
                            Move(
                                piece.tensor,
                                region,
                                holders.holder(box, src),
                                source.dtype,
                                target.dtype,
                                (dest,),
                            )
                        )
                else:
                    self.sent[src] += region.numel * itemsize
                    self.remote.setdefault(
                        (piece.tensor, region, holders.holder(box, src), target.dtype),
                        [],
                    ).append(dest)
            remaining = next_remaining
            if not remaining:
                return
        raise CoverageError(
            f"tensor {piece.tensor!r} box {remaining[0]} (for {target.name} on rank {rank}) "
            f"is held by no rank; holders: "
            + ", ".join(f"rank {h.rank} {h.box}" for h in source.holders[:8])
        )


def inputs_fingerprint(
    sources: SourceLayout,
    targets: Mapping[int, Sequence[ParamTarget]],
    topology: Optional[Topology] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    aliases: Optional[Mapping[str, str]] = None,
    targets_digest: str = "",
) -> str:
    """A digest of everything a plan depends on; equal digests give equal plans (``plan`` is
    deterministic), so ranks that agree on it run the same plan. ``targets_digest``, when
    given, stands for ``targets``: a digest that identifies them (the engine's digest of
    its targets, ``LiveLayout.digest``, when ``targets`` are those restricted to the
    sources' names), so a large engine's targets are not hashed again on every update."""
    h = hashlib.sha256()
    h.update(sources_digest(sources).encode())
    if targets_digest:
        h.update(repr((sorted(targets), targets_digest)).encode())
    else:
        for rank in sorted(targets):
            h.update(repr((rank, targets_key(targets[rank]))).encode())
    topology = topology or Topology()
    h.update(
        repr(
            (sorted(topology.device_of.items()), sorted(topology.node_of.items()))
        ).encode()
    )
    h.update(repr((bucket_bytes, sorted((aliases or {}).items()))).encode())
    return h.hexdigest()


def targets_key(targets: Sequence[ParamTarget]) -> list:
    """Everything about ``targets`` a plan depends on, as plain values (for digests)."""
    return [
        (
            t.name,
            t.shape,
            str(t.dtype),
            [
                (p.tensor, p.box.offsets, p.box.sizes, p.index, p.offsets, p.perm)
                for p in t.pieces
            ],
            [(z.offsets, z.sizes) for z in t.zeros],
        )
        for t in targets
    ]


def sources_digest(sources: SourceLayout) -> str:
    """A digest of a source layout: every tensor's name, shape, dtype and holders, the
    holders of a mesh-described tensor by the mesh layout they follow from and their buffer."""
    return hashlib.sha256(
        repr(
            [
                (
                    n,
                    s.shape,
                    str(s.dtype),
                    (_geometry_digest(s.holders.geometry), s.holders.buffer)
                    if isinstance(s.holders, MeshHolders)
                    else [
                        (
                            h.rank,
                            h.box.offsets,
                            h.box.sizes,
                            h.buffer,
                            h.offsets,
                            h.buffer_shape,
                        )
                        for h in s.holders
                    ],
                )
                for n, s in ((n, sources[n]) for n in sorted(sources))
            ]
        ).encode()
    ).hexdigest()


@functools.lru_cache(maxsize=1024)
def _geometry_digest(geometry: MeshGeometry) -> str:
    """One geometry's digest, by its layout: many tensors share a geometry, and every update
    describes them anew (keyed by the shared object, so its layout is not hashed per tensor)."""
    return hashlib.sha256(repr(geometry.layout).encode()).hexdigest()


class PlanCache:
    """Plans by input digest: an unchanged layout (every step of an RL run) is planned once."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: Dict[Tuple[str, Optional[Tuple[int, ...]]], Plan] = {}
        self.misses = 0  # plans made (not found in the cache) so far

    def get(
        self,
        sources: SourceLayout,
        targets: Mapping[int, Sequence[ParamTarget]],
        topology: Optional[Topology] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        aliases: Optional[Mapping[str, str]] = None,
        targets_digest: str = "",
        local_ranks: Optional[Collection[int]] = None,
    ) -> Plan:
        """The plan of these inputs, made on the first call (``targets_digest``: see
        ``inputs_fingerprint``; ``local_ranks``: see ``plan``)."""
        with collector_paused():
            fingerprint = inputs_fingerprint(
                sources, targets, topology, bucket_bytes, aliases, targets_digest
            )
        key = (fingerprint, None if local_ranks is None else tuple(sorted(local_ranks)))
        if key not in self._plans:
            self.misses += 1
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan(
                sources,
                targets,
                topology,
                bucket_bytes,
                aliases,
                fingerprint,
                local_ranks,
            )
        return self._plans[key]


def resolve_aliases(sources: SourceLayout, aliases: Mapping[str, str]) -> SourceLayout:
    """Rename sources sent under an alias (tied ``lm_head.weight``) to the name targets use;
    their holders keep the buffer the shard arrives under. An alias sent alongside its
    target name is redundant and dropped."""
    out = dict(sources)
    for alias, name in aliases.items():
        src = out.pop(alias, None)
        if src is not None and name not in out:
            out[name] = SourceTensor(name, src.shape, src.dtype, src.holders)
    return out


def landing(
    target: ParamTarget, piece: Piece
) -> Tuple[
    str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], Optional[Tuple[int, ...]]
]:
    """Where ``piece`` lands in ``target``, as ``Dest``'s fields after its rank."""
    if piece.perm is None:
        delta = tuple(map(operator.sub, piece.offsets, piece.box.offsets))
    else:
        delta = tuple(
            p - piece.box.offsets[q] for p, q in zip(piece.offsets, piece.perm)
        )
    return (
        target.name,
        piece.index,
        delta,
        tuple(target.shape[len(piece.index) :]),
        piece.perm,
    )


def _move(source: SourceTensor, key: Tuple, dests: Tuple[Dest, ...]) -> Move:
    tensor, region, holder, dtype = key
    return Move(tensor, region, holder, source.dtype, dtype, dests)


def _split(move: Move, max_bytes: int) -> List[Move]:
    """Cut a move along its outer rows so each part moves at most ``max_bytes``."""
    parts = move.region.split_rows(max(1, max_bytes // move.dtype.itemsize))
    if len(parts) == 1:
        return [move]
    return [
        Move(move.tensor, part, move.holder, move.src_dtype, move.dtype, move.dests)
        for part in parts
    ]


def _bucket(moves: List[Move], bucket_bytes: int) -> Tuple[Tuple[Move, ...], ...]:
    """Greedy rounds: a new round starts when a move would push any rank it touches past the cap."""
    rounds: List[List[Move]] = []
    load: Dict[int, int] = defaultdict(int)
    current: List[Move] = []
    for move in moves:
        for part in _split(move, bucket_bytes):
            ranks = set(part.group)
            if current and any(load[r] + part.nbytes > bucket_bytes for r in ranks):
                rounds.append(current)
                current, load = [], defaultdict(int)
            current.append(part)
            for r in ranks:
                load[r] += part.nbytes
    if current:
        rounds.append(current)
    return tuple(tuple(r) for r in rounds)
