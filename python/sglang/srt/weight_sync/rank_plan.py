"""Plan one rank's part of a transfer, without planning anyone else's.

``planner.plan`` computes the whole world's plan on every rank; fine for one engine
(a few ranks), not for a trainer of hundreds of ranks feeding several engines, where
a rank would pay for millions of moves it takes no part in. Here a rank computes only
the moves it receives and the moves it sends, and both endpoints of a move compute it
identically from the same inputs, with no counter shared across ranks:

* **which region**: distinct holder boxes of a tensor do not overlap (every DTensor or
  Megatron layout), so the part of a needed piece that a box serves is their
  intersection, whoever computes it (overlapping boxes: the receiver's decomposition,
  closest first, as ``planner.plan`` does, recomputed by the sender);
* **who sends**: the receiver itself when it holds the box (a local copy), else among
  the closest holders (same device, then node) one picked by a hash of the receiver
  and the tensor, so DP replicas share the sending without a global load count;
* **when**: every tensor the receivers need has a fixed place in one canonical byte
  order (names sorted with numbers as numbers, ``planner.name_order``; rows in the
  widest dtype involved); a move runs in the round of
  the window of ``bucket_bytes / 2`` bytes its rows fall in (split at window edges).
  A rank so receives at most half the cap (plus a row) per round; the executor casts
  each region it sends once per round, whatever the fan-out, so its send staging is
  at most half the cap too unless receivers need different, overlapping parts of the
  same rows (the simulator reports the staging each rank needs).

Moves are point-to-point (no broadcast subgroups: creating those is collective over
the whole world). A rank's cost is its own pieces and the receivers of the boxes it
holds, found through an index of needs per class of ranks with identical targets (the
trainer ranks beside the same TP rank of replica engines), not through every rank, and
through holder indexes shared by every tensor of one mesh geometry (``MeshHolders``):
the layers of a model repeat a few dozen geometries, each indexed once, so the holders
that a larger world adds are not walked again for every tensor.
"""

from __future__ import annotations

import bisect
import hashlib
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.planner import (
    DEFAULT_BUCKET_BYTES,
    CoverageError,
    Dest,
    HolderIndex,
    Move,
    Plan,
    Topology,
    ZeroFill,
    landing,
    landing_order,
    name_order,
    resolve_aliases,
    sources_digest,
    targets_key,
)
from sglang.srt.weight_sync.source_layout import SourceLayout
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

__all__ = ("Receivers", "plan_for_rank")


@dataclass(frozen=True)
class Receivers:
    """Who needs what, with ranks of identical targets grouped: ``ranks[c]`` all need
    ``classes[c]``. Trainer ranks beside the same TP rank of replica engines form one
    class, so needs are indexed once per class, however many engines there are."""

    classes: Tuple[Tuple[ParamTarget, ...], ...]
    ranks: Tuple[Tuple[int, ...], ...]

    @staticmethod
    def of(targets: Mapping[int, Sequence[ParamTarget]]) -> Receivers:
        """Group a plain rank -> targets mapping by equal targets."""
        by_targets: Dict[Tuple[ParamTarget, ...], List[int]] = {}
        for rank in sorted(targets):
            by_targets.setdefault(tuple(targets[rank]), []).append(rank)
        return Receivers(
            tuple(by_targets), tuple(tuple(r) for r in by_targets.values())
        )

    def of_rank(self, rank: int) -> Tuple[ParamTarget, ...]:
        for targets, ranks in zip(self.classes, self.ranks):
            if rank in ranks:
                return targets
        return ()

    def digest(self) -> str:
        h = hashlib.sha256()
        for targets, ranks in zip(self.classes, self.ranks):
            h.update(repr((ranks, targets_key(targets))).encode())
        return h.hexdigest()


class _NeedIndex:
    """The pieces of one tensor that any class needs, indexed by start on one dim."""

    __slots__ = ("dim", "needs", "starts", "max_len")

    def __init__(self, dim: int, needs: List[Tuple[int, ParamTarget, Piece]]):
        self.dim = dim
        self.needs = sorted(
            needs, key=lambda n: (n[2].box.offsets[dim] if n[2].box.ndim else 0, n[0])
        )
        self.starts = [
            p.box.offsets[dim] if p.box.ndim else 0 for _, _, p in self.needs
        ]
        self.max_len = max(
            (p.box.sizes[dim] if p.box.ndim else 1 for _, _, p in self.needs), default=0
        )

    def overlapping(self, box: Box) -> List[Tuple[int, ParamTarget, Piece]]:
        if box.ndim == 0:
            return self.needs
        lo, hi = box.offsets[self.dim], box.offsets[self.dim] + box.sizes[self.dim]
        first = bisect.bisect_left(self.starts, lo - self.max_len + 1)
        last = bisect.bisect_left(self.starts, hi)
        bo, bs = box.offsets, box.sizes
        return [
            n
            for n in self.needs[first:last]
            if all(
                o < x + s and x < o + z
                for o, z, x, s in zip(n[2].box.offsets, n[2].box.sizes, bo, bs)
            )
        ]


def _spread(rank: int, salt: int, n: int) -> int:
    """A stable pick in [0, n) that spreads ranks of any stride (multiplicative hashing)."""
    return (((rank + 1) * 2654435761 + salt) & 0xFFFFFFFF) * n >> 32


class _Planner:
    """Shared state of one ``plan_for_rank`` call: indexes built lazily per tensor."""

    def __init__(
        self,
        sources: SourceLayout,
        receivers: Receivers,
        topology: Topology,
        bucket_bytes: int,
    ):
        self.sources, self.receivers, self.topology = sources, receivers, topology
        self.window = max(1, bucket_bytes // 2)
        self.holders: Dict[str, HolderIndex] = {}
        self.salt: Dict[str, int] = {}
        self.landing: Dict[
            int, tuple
        ] = {}  # id(piece) -> where it lands; receivers keep every piece alive
        needs: Dict[str, List[Tuple[int, ParamTarget, Piece]]] = defaultdict(list)
        itemsize: Dict[str, int] = {}
        for c, targets in enumerate(receivers.classes):
            for t in targets:
                for p in t.pieces:
                    needs[p.tensor].append((c, t, p))
                    itemsize[p.tensor] = max(
                        itemsize.get(p.tensor, 0), t.dtype.itemsize
                    )
        self.needs_raw = needs
        self.need_index: Dict[str, _NeedIndex] = {}
        # The canonical byte order that numbers rounds: needed tensors by name (numbers
        # as numbers), rows in the widest dtype a row travels or is held in.
        self.base: Dict[str, int] = {}
        self.row_bytes: Dict[str, int] = {}
        offset = 0
        for name in sorted(needs, key=name_order):
            src = sources.get(name)
            if src is None:
                c, t, _ = needs[name][0]
                raise CoverageError(
                    f"tensor {name!r} (for {t.name} on rank {receivers.ranks[c][0]}) "
                    "has no source on any rank"
                )
            size = max(itemsize[name], src.dtype.itemsize)
            for s in src.shape[1:]:
                size *= s
            self.base[name], self.row_bytes[name] = offset, size
            offset += size * (src.shape[0] if src.shape else 1)

    def holder_index(self, tensor: str) -> HolderIndex:
        index = self.holders.get(tensor)
        if index is None:
            index = self.holders[tensor] = HolderIndex(self.sources[tensor])
            self.salt[tensor] = zlib.crc32(tensor.encode())
        return index

    def dest(self, rank: int, target: ParamTarget, piece: Piece) -> Dest:
        """Where ``piece`` lands on ``rank``; the same for every rank of a class, so computed once."""
        where = self.landing.get(id(piece))
        if where is None:
            where = self.landing[id(piece)] = landing(target, piece)
        return Dest(rank, *where)

    def needs_of(self, tensor: str) -> _NeedIndex:
        index = self.need_index.get(tensor)
        if index is None:
            index = self.need_index[tensor] = _NeedIndex(
                self.holder_index(tensor).dim, self.needs_raw[tensor]
            )
        return index

    def sender(
        self, tensor: str, box: Box, ranks: Tuple[int, ...], receiver: int
    ) -> int:
        """The holder of ``box`` that serves ``receiver``: itself, else one of the closest."""
        if len(ranks) == 1:
            return ranks[0]
        if self.holders[tensor].holds(box, receiver):
            return receiver
        _, near = self.holders[tensor].closest(box, ranks, receiver, self.topology)
        return (
            near[0]
            if len(near) == 1
            else near[_spread(receiver, self.salt[tensor], len(near))]
        )

    def served(
        self, target: ParamTarget, piece: Piece, rank: int
    ) -> List[Tuple[Box, Box, int]]:
        """(region, holder box, sender) covering ``piece`` for ``rank``, in a fixed order;
        ``CoverageError`` when some of it is held by no one."""
        holders = self.holder_index(piece.tensor)
        out = []
        if holders.disjoint:
            covered = 0
            for box, ranks in holders.overlapping(piece.box):
                region = (
                    piece.box if box.contains(piece.box) else piece.box.intersect(box)
                )
                covered += region.numel
                out.append((region, box, self.sender(piece.tensor, box, ranks, rank)))
            if covered == piece.box.numel:
                return out
            remaining = [piece.box]
            for _, box, _ in out:
                remaining = [r for rem in remaining for r in rem.subtract(box)]
        else:  # overlapping boxes: closest first, then by position, as planner.plan does
            keyed = sorted(
                (
                    (holders.closest(box, ranks, rank, self.topology)[0], box.offsets),
                    box,
                    ranks,
                )
                for box, ranks in holders.overlapping(piece.box)
            )
            remaining = [piece.box]
            for _, box, ranks in keyed:
                next_remaining = []
                for rem in remaining:
                    region = rem.intersect(box)
                    if region is None:
                        next_remaining.append(rem)
                        continue
                    next_remaining.extend(rem.subtract(box))
                    out.append(
                        (region, box, self.sender(piece.tensor, box, ranks, rank))
                    )
                remaining = next_remaining
            if not remaining:
                return out
        src = self.sources[piece.tensor]
        raise CoverageError(
            f"tensor {piece.tensor!r} box {remaining[0]} (for {target.name} on rank {rank}) is held by no rank; "
            "holders: " + ", ".join(f"rank {h.rank} {h.box}" for h in src.holders[:8])
        )

    def windows(self, move: Move) -> List[Tuple[int, Move]]:
        """The move cut at window edges of the canonical order, with each part's window."""
        region, base, row = (
            move.region,
            self.base[move.tensor],
            self.row_bytes[move.tensor],
        )
        if region.ndim == 0:
            return [(base // self.window, move)]
        start = region.offsets[0]
        end = start + region.sizes[0]
        first = (base + start * row) // self.window
        if first == (base + (end - 1) * row) // self.window:
            return [(first, move)]
        out = []
        while start < end:
            w = (base + start * row) // self.window
            stop = min(end, max(start + 1, -(-((w + 1) * self.window - base) // row)))
            part = (
                region
                if (start, stop) == (region.offsets[0], end)
                else Box(
                    (start,) + region.offsets[1:], (stop - start,) + region.sizes[1:]
                )
            )
            out.append(
                (
                    w,
                    move
                    if part is region
                    else Move(
                        move.tensor,
                        part,
                        move.holder,
                        move.src_dtype,
                        move.dtype,
                        move.dests,
                    ),
                )
            )
            start = stop
        return out


def _order(m: Move) -> tuple:
    """One order for the moves of a round on every rank: gloo and NCCL match the
    point-to-point messages between two ranks in the order they are posted."""
    d = m.dests[0]
    return (
        name_order(m.tensor),
        m.region.offsets,
        m.region.sizes,
        m.src,
        d.rank,
        d.param,
        d.index,
    )


def plan_for_rank(
    sources: SourceLayout,
    receivers: Receivers,
    rank: int,
    topology: Optional[Topology] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    aliases: Optional[Mapping[str, str]] = None,
    fingerprint: str = "",
) -> Plan:
    """The moves ``rank`` sends or receives, with the rounds they run in: for every pair of
    ranks, the same moves in the same rounds as the other endpoint computes. ``fingerprint``
    (default: a digest of the inputs) is the same on every rank, for agreement checks."""
    topology = topology or Topology()
    if aliases:
        sources = resolve_aliases(sources, aliases)
    pl = _Planner(sources, receivers, topology, bucket_bytes)
    needed = held = 0
    local: List[Move] = []
    zero_fills: List[ZeroFill] = []
    remote: Dict[Tuple, List[Dest]] = defaultdict(
        list
    )  # (tensor, region, holder, dtype, receiver) -> dests

    def add(piece: Piece, region: Box, box: Box, src: int, dest: Dest, dtype) -> None:
        holder = pl.holders[piece.tensor].holder(box, src)
        remote[(piece.tensor, region, holder, dtype, dest.rank)].append(dest)

    for target in receivers.of_rank(rank):  # what this rank receives
        zero_fills.extend(ZeroFill(rank, target.name, z) for z in target.zeros)
        for piece in sorted(target.pieces, key=landing_order):
            needed += piece.box.numel * target.dtype.itemsize
            dest = pl.dest(rank, target, piece)
            for region, box, src in pl.served(target, piece, rank):
                if src == rank:
                    held += region.numel * target.dtype.itemsize
                    holder = pl.holders[piece.tensor].holder(box, src)
                    local.append(
                        Move(
                            piece.tensor,
                            region,
                            holder,
                            sources[piece.tensor].dtype,
                            target.dtype,
                            (dest,),
                        )
                    )
                else:
                    add(piece, region, box, src, dest, target.dtype)

    for name in sorted(pl.needs_raw):  # what this rank sends
        holders = pl.holder_index(name)
        mine = holders.index.boxes_of(rank)
        if not mine:
            continue
        needs = pl.needs_of(name)
        for box in mine:  # each once: boxes_of lists a (box, rank) holder once
            ranks = holders.index.ranks_of[box]
            holding = frozenset(ranks)  # they copy it locally (this rank among them)
            for c, target, piece in needs.overlapping(box):
                others = [q for q in receivers.ranks[c] if q not in holding]
                if not others:
                    continue
                if holders.disjoint:
                    region = (
                        piece.box
                        if box.contains(piece.box)
                        else piece.box.intersect(box)
                    )
                    for q in others:
                        if len(ranks) == 1 or pl.sender(name, box, ranks, q) == rank:
                            add(
                                piece,
                                region,
                                box,
                                rank,
                                pl.dest(q, target, piece),
                                target.dtype,
                            )
                else:
                    for q in others:
                        for region, b, src in pl.served(target, piece, q):
                            if src == rank and b == box:
                                add(
                                    piece,
                                    region,
                                    box,
                                    rank,
                                    pl.dest(q, target, piece),
                                    target.dtype,
                                )

    rounds: Dict[int, List[Move]] = defaultdict(list)
    for (tensor, region, holder, dtype, _), dests in remote.items():
        if len(dests) > 1:
            dests.sort(key=lambda d: (d.param, d.index, d.delta, d.perm or ()))
        move = Move(tensor, region, holder, sources[tensor].dtype, dtype, tuple(dests))
        for w, part in pl.windows(move):
            rounds[w].append(part)
    ids = tuple(sorted(rounds))
    if not fingerprint:
        fingerprint = inputs_digest(sources, receivers, topology, bucket_bytes)
    return Plan(
        tuple(local),
        tuple(tuple(sorted(rounds[w], key=_order)) for w in ids),
        tuple(zero_fills),
        (),
        {rank: needed},
        {rank: held},
        bucket_bytes,
        fingerprint,
        ids,
    )


def inputs_digest(
    sources: SourceLayout,
    receivers: Receivers,
    topology: Optional[Topology] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> str:
    """What every rank's ``plan_for_rank`` depends on; equal digests give consistent plans."""
    topology = topology or Topology()
    h = hashlib.sha256()
    for part in (
        sources_digest(sources),
        receivers.digest(),
        repr(
            (
                sorted(topology.device_of.items()),
                sorted(topology.node_of.items()),
                bucket_bytes,
            )
        ),
    ):
        h.update(part.encode())
    return h.hexdigest()
