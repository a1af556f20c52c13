"""Provenance: what the elements the load recorder tracks are made of.

``LoadRecorder`` keeps, per storage, a write log (``StorageLog``) of ``Entry``s: a
box of the storage's canonical coordinates (``derive.view_geometry``) and what it holds.

Notation (rows and columns of the integer matrices below):

* ``x``: canonical coordinates of a storage; ``e`` indexes its dims;
* ``i``: the iteration index of one transfer (the view dims it walks); ``j`` its dims;
* ``r``: a checkpoint tensor's (leaf's) dims;
* ``l0``: the leaf coordinates read at an origin; ``L[r][e]`` (``Leaf``) and
  ``steps[r][j]`` (``LeafRead``): how far leaf coordinate ``r`` moves per unit step
  of canonical dim ``e`` or iteration dim ``j``.

Recorded sources (what an ``Entry`` holds): ``Leaf``, ``Const``, ``Opaque``. While
a transfer is worked out, a read of a leaf is a ``LeafRead`` (over the iteration
space, not yet over the destination's coordinates), and ``.item()`` of one leaf
element, written somewhere by ``fill_``, is a ``LeafElement``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.derive.view_geometry import matvec

__all__ = (
    "Const",
    "Entry",
    "Fill",
    "Leaf",
    "LeafElement",
    "LeafRead",
    "Matrix",
    "Opaque",
    "Recorded",
    "Source",
    "StorageKind",
    "StorageLog",
    "Vec",
    "identity",
    "resolve",
)

Vec = Tuple[int, ...]
Matrix = Tuple[Vec, ...]  # rows of integers


@lru_cache(maxsize=16)
def identity(ndim: int) -> Matrix:
    """The ``ndim`` x ``ndim`` identity matrix. Memoised process-wide (pure, a few ndims):
    every leaf of a given ndim shares one matrix instead of holding its own."""
    return tuple(tuple(int(r == c) for c in range(ndim)) for r in range(ndim))


@dataclass(frozen=True, slots=True)
class Leaf:
    """Elements of checkpoint tensor ``name``: canonical coordinates ``x`` of the owning box
    hold leaf coordinates ``l0 + L @ (x - box.offsets)`` (an affine map: slices, transposes,
    broadcasts and unflattened dims all fit)."""

    name: str
    l0: Vec
    L: Matrix  # rows: leaf dims; columns: dims of the owning coordinates

    def moved(self, delta: Sequence[int]) -> Leaf:
        """The same map with its origin moved by ``delta`` owning coordinates."""
        return Leaf(
            self.name,
            tuple(a + b for a, b in zip(self.l0, matvec(self.L, delta))),
            self.L,
        )


@dataclass(frozen=True, slots=True)
class Const:
    """A constant (0 for zero padding)."""

    value: float


@dataclass(frozen=True, slots=True)
class Opaque:
    """Computed by a non-movement op ``op`` from the leaves ``deps``."""

    op: str
    deps: FrozenSet[str]


@dataclass(frozen=True, slots=True)
class LeafRead:
    """A leaf read through a transfer: iteration index ``i`` of a part starting at ``i0``
    reads leaf coordinates ``l0 + steps @ (i - i0)``."""

    name: str
    l0: Vec
    steps: Matrix  # rows: leaf dims; columns: iteration dims

    def advanced(self, j: int, n: int) -> LeafRead:
        """The read starting ``n`` steps further along iteration dim ``j``."""
        return LeafRead(
            self.name,
            tuple(a + row[j] * n for a, row in zip(self.l0, self.steps)),
            self.steps,
        )

    def onto(self, dims: Sequence[int]) -> Leaf:
        """The ``Leaf`` it writes when destination canonical dim ``e`` walks iteration dim
        ``dims[e]`` (-1: none)."""
        return Leaf(
            self.name,
            self.l0,
            tuple(tuple(row[j] if j >= 0 else 0 for j in dims) for row in self.steps),
        )


@dataclass(frozen=True, slots=True)
class LeafElement:
    """One element of a leaf, as ``.item()`` handed it out, written everywhere ``fill_`` puts it."""

    name: str
    index: Vec

    def as_leaf(self, ndim: int) -> Leaf:
        """Broadcast over ``ndim`` owning coordinates."""
        return Leaf(self.name, self.index, tuple((0,) * ndim for _ in self.index))

    def as_read(self, ndim: int) -> LeafRead:
        """Broadcast over ``ndim`` iteration dims."""
        return LeafRead(self.name, self.index, tuple((0,) * ndim for _ in self.index))


Recorded = Union[Leaf, Const, Opaque]  # what an entry holds
Fill = Union[Const, Opaque, LeafElement]  # one value written over a whole view
Source = Union[Leaf, Const, Opaque, LeafRead, LeafElement]


@dataclass(frozen=True, slots=True)
class Entry:
    """``box`` (canonical coordinates of a storage) holds ``src``."""

    box: Box
    src: Recorded

    def restrict(self, sub: Box) -> Entry:
        """The part of this entry over ``sub`` (inside ``box``)."""
        if isinstance(self.src, Leaf) and sub.offsets != self.box.offsets:
            return Entry(
                sub,
                self.src.moved([a - b for a, b in zip(sub.offsets, self.box.offsets)]),
            )
        return Entry(sub, self.src)


class StorageKind(str, Enum):
    """Where a tracked storage came from."""

    LEAF = "leaf"  # a checkpoint tensor
    PARAM = "param"  # a parameter or buffer of the model, before loading
    DERIVED = "derived"  # allocated by an op while recording
    UNTRACKED = "untracked"  # allocated outside the recording (a CPU index, a buffer)
    VIEW = "view"  # a view's own coordinates, for ``describe``


class StorageLog:
    """The writes into one storage (its StorageImpl), in order, over its canonical shape
    ``canon``; ``keep`` holds the storage alive so that its id is never reused."""

    __slots__ = ("canon", "itemsize", "entries", "keep", "_resolved", "kind")

    def __init__(
        self, canon: Sequence[int], itemsize: int, keep: object, kind: StorageKind
    ):
        self.canon: Vec = tuple(int(c) for c in canon)
        self.itemsize = itemsize
        self.entries: List[Entry] = []
        self.keep = keep
        self._resolved: Optional[List[Entry]] = None
        self.kind = kind

    def add(self, entry: Entry) -> None:
        if not entry.box.is_empty():
            self.entries.append(entry)
            self._resolved = None

    def resolved(self) -> List[Entry]:
        """Disjoint entries: later writes win."""
        if self._resolved is None:
            self._resolved = resolve(self.entries)
        return self._resolved


_WIDE = 8  # boxes spanning more dim-0 indices than this are not bucketed


def resolve(entries: Sequence[Entry]) -> List[Entry]:
    """Disjoint entries, later ones winning (slab subtraction). Boxes are bucketed by their
    dim-0 range so that the usual case (many disjoint writes, e.g. one per expert) costs about
    linear time, not quadratic."""
    if len(entries) <= 1:
        return list(entries)
    out: List[Entry] = []
    buckets: Dict[int, List[Box]] = {}
    wide: List[Box] = []

    def candidates(box: Box) -> List[Box]:
        """Later boxes that may overlap ``box``."""
        if not box.ndim:
            return wide + [b for bs in buckets.values() for b in bs]
        lo, n = box.offsets[0], box.sizes[0]
        if n > _WIDE:
            return wide + [
                b
                for bs in buckets.values()
                for b in bs
                if lo <= b.offsets[0] < lo + n
                or b.offsets[0] <= lo < b.offsets[0] + b.sizes[0]
            ]
        seen: List[Box] = []
        for i in range(lo, lo + n):
            seen.extend(buckets.get(i, ()))
        return wide + seen

    for entry in reversed(entries):
        frags = [entry.box]
        for later in candidates(entry.box):
            if later.intersect(entry.box) is None:
                continue
            frags = [piece for frag in frags for piece in frag.subtract(later)]
            if not frags:
                break
        out.extend(entry.restrict(frag) for frag in frags)
        box = entry.box
        if box.ndim and box.sizes[0] <= _WIDE:
            for i in range(box.offsets[0], box.offsets[0] + box.sizes[0]):
                buckets.setdefault(i, []).append(box)
        else:
            wide.append(box)
    out.reverse()
    return out
