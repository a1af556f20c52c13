"""Transfers: a view of one storage written from a view of another (or with one value),
worked out as the entries it adds to the destination's write log.

Every write ``LoadRecorder`` records ends here. Nearly every copy a loader makes is
between two boxes (a narrowed or selected slice of a parameter, a narrowed checkpoint
tensor); those take a fast path (``Transfers.box``) that records exactly what the
general one (``Transfers.write``: refine the views to affine maps, read the source's
entries, write the destination's) would.

Notation (see also ``derive.provenance``):

* a view over a storage's canonical shape ``canon`` is ``x = x0 + cols @ i``:
  ``i`` the iteration index of the transfer (``sizes`` per dim ``j``), ``x`` the
  canonical coordinates (dims ``e``), ``cols[j][e]`` how far ``x[e]`` moves per
  step of ``i[j]``; ``d0``/``dst_cols`` for the destination, ``u0``/``src_cols``
  for the source;
* a *part* is an iteration sub-box (``i0``: its first index, ``sizes``) and what
  it reads; ``x_at`` is the canonical coordinate its first index reads and
  ``span[e]`` how far past it the part reaches along dim ``e``;
* ``sides`` are views as ``derive.view_geometry.refine`` takes them: (storage offset,
  strides, canonical shape) each;
* ``budget``: how many more pieces a view that is no affine map may be cut or
  enumerated into, shared (a one-element list) by the recursion of one transfer.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.derive.provenance import (
    Const,
    Entry,
    Fill,
    Leaf,
    LeafElement,
    LeafRead,
    Matrix,
    Opaque,
    StorageLog,
    Vec,
)
from sglang.srt.weight_sync.derive.view_geometry import (
    BoxCopy,
    NotAffine,
    box_copy,
    refine,
    split_point,
    unit_dim,
    unravel,
)

__all__ = ("Part", "Side", "Transfers")

Side = Tuple[
    int, Vec, Vec
]  # a view in ``refine``'s terms: storage offset, strides, canonical shape


class Part(NamedTuple):
    """An iteration sub-box of a transfer (from ``i0``, ``sizes`` per dim) and what it reads."""

    i0: Vec
    sizes: Vec
    src: Union[Const, Opaque, LeafRead]


def _reach(
    i0: Sequence[int], sizes: Sequence[int], u0: Vec, cols: Sequence[Vec], ndim: int
) -> Tuple[List[int], List[int]]:
    """(``x_at``, ``span``) of a part: the canonical coordinate it reads first, and how far
    past it it reads, per canonical dim."""
    k = len(sizes)
    x_at = [u0[e] + sum(cols[j][e] * i0[j] for j in range(k)) for e in range(ndim)]
    span = [sum(cols[j][e] * (sizes[j] - 1) for j in range(k)) for e in range(ndim)]
    return x_at, span


def _offending_dim(cols: Sequence[Vec], sizes: Sequence[int]) -> Optional[int]:
    """The iteration dim to enumerate when a read is not separable: of those walking several
    canonical dims, or one another dim walks too, the one with the largest step."""
    used: Counter = Counter()
    for j, col in enumerate(cols):
        if sizes[j] > 1:
            for e, step in enumerate(col):
                if step:
                    used[e] += 1
    worst = None
    for j, col in enumerate(cols):
        if sizes[j] <= 1:
            continue
        walked = [e for e, step in enumerate(col) if step]
        if len(walked) > 1 or any(used[e] > 1 for e in walked):
            if worst is None or max(col) > max(cols[worst]):
                worst = j
    return worst


def _preimage(
    entry: Entry,
    i0: Sequence[int],
    sizes: Sequence[int],
    x_at: Sequence[int],
    cols: Sequence[Vec],
) -> Union[None, Tuple[()], Tuple[Vec, Vec]]:
    """The iteration sub-box (``i0``, ``sizes``) reading inside ``entry.box``; () when empty;
    None when the read is not separable (an iteration dim walks two canonical dims, or two
    iteration dims one)."""
    lo, hi = list(i0), [a + s for a, s in zip(i0, sizes)]
    walker: Dict[int, int] = {}  # canonical dim -> the iteration dim walking it
    for j, col in enumerate(cols):
        if sizes[j] <= 1:
            continue
        walked = [e for e, step in enumerate(col) if step]
        if not walked:
            continue
        if len(walked) > 1 or walked[0] in walker:
            return None
        walker[walked[0]] = j
    for e in range(len(entry.box.offsets)):
        b0, b1 = entry.box.offsets[e], entry.box.ends[e]
        j = walker.get(e)
        if j is None:
            if not (b0 <= x_at[e] < b1):
                return ()
            continue
        step = cols[j][e]
        # x = x_at[e] + step * (i - i0[j]) in [b0, b1)
        first = i0[j] + max(0, -((x_at[e] - b0) // step))
        end = i0[j] + (b1 - 1 - x_at[e]) // step + 1
        lo[j], hi[j] = max(lo[j], first), min(hi[j], end)
        if hi[j] <= lo[j]:
            return ()
    return tuple(lo), tuple(h - l for h, l in zip(hi, lo))


def _composed(
    entry: Entry, x_at: Sequence[int], cols: Sequence[Vec]
) -> Union[Const, Opaque, LeafRead]:
    """What a part whose first index reads canonical coordinate ``x_at`` of ``entry`` reads."""
    src = entry.src
    if not isinstance(src, Leaf):
        return src
    moved = src.moved([a - b for a, b in zip(x_at, entry.box.offsets)])
    # steps[r][j] = sum_e L[r][e] * cols[j][e]
    steps: Matrix = tuple(
        tuple(sum(row[e] * col[e] for e in range(len(col))) for col in cols)
        for row in src.L
    )
    return LeafRead(src.name, moved.l0, steps)


class Transfers:
    """Works out transfers into write logs. Owned by one ``LoadRecorder``, so its memo of copy
    geometries lives as long as one derivation (a rank's copies come in a few dozen)."""

    def __init__(self, max_enumeration: int):
        self.max_enumeration = max_enumeration
        self._box_copies: Dict[
            Tuple[Vec, Vec, Vec, Optional[Vec], Optional[Vec]], Optional[BoxCopy]
        ] = {}

    def write(
        self,
        dst_log: StorageLog,
        src_log: Optional[StorageLog],
        sizes: Sequence[int],
        sides: List[Side],
        fixed: Optional[Fill],
    ) -> None:
        """The general path: ``sizes`` elements written through ``sides[0]`` from ``sides[1]``
        of ``src_log``, or with ``fixed``. Raises ``NotAffine`` where a view is no affine map
        and cutting it up would cost more than ``max_enumeration`` pieces."""
        self._split(dst_log, src_log, list(sizes), sides, fixed, [self.max_enumeration])

    def read(
        self,
        log: StorageLog,
        i0: Vec,
        sizes: Sequence[int],
        u0: Vec,
        cols: Sequence[Vec],
    ) -> List[Part]:
        """Parts covering what the view reads of ``log``'s entries."""
        x_at, span = _reach(i0, sizes, u0, cols, len(log.canon))
        out: List[Part] = []
        for held in log.resolved():
            if self._outside(held, x_at, span):
                continue
            if self._within(held, x_at, span):
                out.append(Part(tuple(i0), tuple(sizes), _composed(held, x_at, cols)))
            else:
                out.extend(
                    self._read_entry(held, i0, sizes, u0, cols, [self.max_enumeration])
                )
        return out

    def box(
        self,
        dst_log: StorageLog,
        d_off: int,
        sizes: Vec,
        d_str: Vec,
        src_log: Optional[StorageLog],
        src_geom: Optional[Tuple[int, Vec]],
        fixed: Optional[Fill],
    ) -> bool:
        """The copy nearly every loader makes, at a fraction of the general path's cost: both
        views are boxes of their storages' canonical shapes that stay inside them (nothing
        wraps) and the source region lies inside one recorded entry. Adds exactly the entry
        the general path (``write``) adds; returns False, having added nothing, otherwise.
        ``src_geom`` = (offset, strides) of the source view, iterating ``sizes``."""
        canon = dst_log.canon
        key = (
            canon,
            sizes,
            d_str,
            None if src_log is None else src_log.canon,
            None if src_log is None else src_geom[1],
        )
        try:
            copy = self._box_copies[key]
        except KeyError:
            copy = self._box_copies[key] = box_copy(*key)
        if copy is None:
            return False
        x0 = unravel(d_off, canon)
        for x, span, n in zip(x0, copy.dst_span, canon):
            if x + span >= n:
                return False
        if src_log is None:
            dst_log.add(
                Entry(
                    Box(x0, copy.box_sizes),
                    fixed.as_leaf(len(x0)) if isinstance(fixed, LeafElement) else fixed,
                )
            )
            return True
        u0 = unravel(src_geom[0], src_log.canon)
        u1 = [
            x + span for x, span in zip(u0, copy.src_span)
        ]  # the last coordinate read, per dim
        for x, n in zip(u1, src_log.canon):
            if x >= n:
                return False
        read = None
        for held in src_log.resolved():
            inside = True
            for lo, hi, o, n in zip(u0, u1, held.box.offsets, held.box.sizes):
                if hi < o or lo >= o + n:
                    break  # disjoint from this entry
                inside = inside and o <= lo and hi < o + n
            else:
                if read is not None or not inside:
                    return False  # the read spans several entries: the general path splits it
                read = held
        if read is None:
            return (
                True  # nothing recorded there: the general path writes nothing either
            )
        src = read.src
        if isinstance(src, Leaf):
            moved = src.moved([a - b for a, b in zip(u0, read.box.offsets)])
            src = Leaf(
                src.name,
                moved.l0,
                tuple(
                    tuple(row[f] if f >= 0 else 0 for f in copy.src_dim)
                    for row in src.L
                ),
            )
        dst_log.add(Entry(Box(x0, copy.box_sizes), src))
        return True

    def _split(
        self,
        dst_log: StorageLog,
        src_log: Optional[StorageLog],
        sizes: List[int],
        sides: List[Side],
        fixed: Optional[Fill],
        budget: List[int],
    ) -> None:
        """Refine to affine maps; where a view wraps a canonical dim at a misaligned point,
        cut the iteration space there (head | aligned body | tail) and recurse."""
        try:
            iter_sizes, maps = refine(sizes, sides)
        except NotAffine:
            budget[0] -= 1
            if budget[0] <= 0:
                raise
            k, cut = split_point(sizes, sides)
            for lo, n in ((0, cut), (cut, sizes[k] - cut)):
                sub = list(sizes)
                sub[k] = n
                sub_sides = [(off + lo * st[k], st, canon) for off, st, canon in sides]
                self._split(dst_log, src_log, sub, sub_sides, fixed, budget)
            return
        d0, dst_cols = maps[0]
        origin = (0,) * len(iter_sizes)
        if src_log is not None:
            u0, src_cols = maps[1]
            parts = self.read(src_log, origin, iter_sizes, u0, src_cols)
        else:
            value = (
                fixed.as_read(len(iter_sizes))
                if isinstance(fixed, LeafElement)
                else fixed
            )
            parts = [Part(origin, tuple(iter_sizes), value)]
        for part in parts:
            self._write_part(dst_log, d0, dst_cols, part.i0, part.sizes, part.src)

    @staticmethod
    def _outside(held: Entry, x_at: Sequence[int], span: Sequence[int]) -> bool:
        """The reach (``x_at`` .. ``x_at + span``) misses ``held.box`` on some dim."""
        return any(
            x + s < o or x >= end
            for x, s, o, end in zip(x_at, span, held.box.offsets, held.box.ends)
        )

    @staticmethod
    def _within(held: Entry, x_at: Sequence[int], span: Sequence[int]) -> bool:
        """The reach (``x_at`` .. ``x_at + span``) lies inside ``held.box``."""
        return all(
            o <= x and x + s < end
            for x, s, o, end in zip(x_at, span, held.box.offsets, held.box.ends)
        )

    def _read_entry(
        self,
        held: Entry,
        i0: Sequence[int],
        sizes: Sequence[int],
        u0: Vec,
        cols: Sequence[Vec],
        budget: List[int],
    ) -> List[Part]:
        """The part of the iteration sub-box (``i0``, ``sizes``) that reads inside ``held``;
        where the read is not separable, enumerate the offending iteration dim."""
        x_at, span = _reach(i0, sizes, u0, cols, len(held.box.offsets))
        if self._outside(held, x_at, span):
            return []
        if self._within(held, x_at, span):
            return [Part(tuple(i0), tuple(sizes), _composed(held, x_at, cols))]
        sub = _preimage(held, i0, sizes, x_at, cols)
        if sub is None:
            j = _offending_dim(cols, sizes)
            budget[0] -= sizes[j]
            if budget[0] < 0:
                raise NotAffine("read needs too many pieces")
            out: List[Part] = []
            for step in range(sizes[j]):
                start, one = list(i0), list(sizes)
                start[j] += step
                one[j] = 1
                out.extend(self._read_entry(held, start, one, u0, cols, budget))
            return out
        if not sub:
            return []
        sub_i0, sub_sizes = sub
        sub_x_at, _ = _reach(sub_i0, sub_sizes, u0, cols, len(held.box.offsets))
        return [Part(sub_i0, sub_sizes, _composed(held, sub_x_at, cols))]

    def _write_part(
        self,
        log: StorageLog,
        d0: Vec,
        dst_cols: Sequence[Vec],
        i0: Sequence[int],
        sizes: Sequence[int],
        src: Union[Const, Opaque, LeafRead],
    ) -> None:
        """Record that the part (``i0``, ``sizes``) writes ``src`` at ``d0 + dst_cols @ i``:
        one box where each iteration dim walks its own canonical dim one step at a time,
        else enumerating the first dim that does not."""
        k, ndim = len(sizes), len(log.canon)
        walker: Dict[int, int] = {}  # canonical dim -> the iteration dim walking it
        bad = None
        for j in range(k):
            if sizes[j] <= 1:
                continue
            e = unit_dim(dst_cols[j])
            if e is None or e in walker:
                bad = j
                break
            walker[e] = j
        if bad is not None:
            if sizes[bad] > self.max_enumeration:
                raise NotAffine(f"destination dim of size {sizes[bad]} is not a box")
            for step in range(sizes[bad]):
                start, one = list(i0), list(sizes)
                start[bad] += step
                one[bad] = 1
                self._write_part(
                    log,
                    d0,
                    dst_cols,
                    tuple(start),
                    tuple(one),
                    src.advanced(bad, step) if isinstance(src, LeafRead) else src,
                )
            return
        offsets = tuple(
            d0[e] + sum(dst_cols[j][e] * i0[j] for j in range(k)) for e in range(ndim)
        )
        box_sizes = tuple(sizes[walker[e]] if e in walker else 1 for e in range(ndim))
        recorded = (
            src.onto([walker.get(e, -1) for e in range(ndim)])
            if isinstance(src, LeafRead)
            else src
        )
        log.add(Entry(Box(offsets, box_sizes), recorded))
