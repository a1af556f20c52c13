"""Record where every element of every storage comes from while SGLang loads weights.

Used by ``derived_targets`` to learn, from SGLang's own loaders, which checkpoint
elements land where in each parameter of an engine rank.

``LoadRecorder`` is a ``TorchDispatchMode``. Checkpoint tensors are meta tensors
registered as *leaves*; the model is built on the meta device, so nothing is
allocated. Each storage (identified by its StorageImpl) carries a write log of
``Entry``s: a box in the storage's canonical coordinates plus its source, one of

* ``Leaf``: leaf coordinates are ``l0 + L @ (x - box.offsets)`` (an affine map:
  slicing, transposes, broadcasts and unflattened dims all fit);
* ``Const``: a constant (0 for zero padding);
* ``Opaque``: computed by a non-movement op (``deps`` names the leaves read).

View ops need no handling at all: the meta tensors' offsets and strides are the
truth and are read only at the moments that matter. What is handled:
``copy_`` (the one op every loader ends in), ``fill_``/``zero_``, factories
(``zeros``, ``full``, ``empty``), the data-movement ops that allocate
(``clone``/``contiguous``/``_to_copy`` i.e. dtype casts, ``cat``, ``stack``,
``constant_pad_nd``, ``index_select`` with a concrete index, ``.item()`` then
``fill_``), and, conservatively, everything else as ``Opaque``.

Nearly every copy a loader makes is between two boxes (a narrowed or selected slice of a
parameter, a narrowed checkpoint tensor); those take a fast path (``_transfer_box``) that
records exactly what the general refinement would, from a geometry cached per shape.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.view_geometry import NotAffine, cstrides, matvec, refine, split_point, unit_dim, unravel

aten = torch.ops.aten
Vec = Tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Leaf:
    name: str
    l0: Vec
    L: Tuple[Tuple[int, ...], ...]  # rows: leaf dims; columns: dims of the owning coordinates


@dataclass(frozen=True, slots=True)
class Const:
    value: float


@dataclass(frozen=True, slots=True)
class Opaque:
    op: str
    deps: FrozenSet[str]


Source = Union[Leaf, Const, Opaque]


@dataclass(frozen=True, slots=True)
class Entry:
    box: Box
    src: Source

    def restrict(self, sub: Box) -> "Entry":
        if isinstance(self.src, Leaf) and sub.offsets != self.box.offsets:
            delta = [a - b for a, b in zip(sub.offsets, self.box.offsets)]
            l0 = tuple(a + b for a, b in zip(self.src.l0, matvec(self.src.L, delta)))
            return Entry(sub, Leaf(self.src.name, l0, self.src.L))
        return Entry(sub, self.src)


class StorageProv:
    __slots__ = ("canon", "itemsize", "entries", "keep", "_resolved", "kind")

    def __init__(self, canon, itemsize, keep, kind):
        self.canon = tuple(int(c) for c in canon)
        self.itemsize = itemsize
        self.entries: List[Entry] = []
        self.keep = keep  # holds the StorageImpl alive so its id is never reused
        self._resolved: Optional[List[Entry]] = None
        self.kind = kind

    def add(self, entry: Entry):
        if not entry.box.is_empty():
            self.entries.append(entry)
            self._resolved = None

    def resolved(self) -> List[Entry]:
        """Disjoint entries: later writes win (slab subtraction, bucketed on dim 0)."""
        if self._resolved is None:
            self._resolved = _resolve(self.entries)
        return self._resolved


def _resolve(entries: List[Entry]) -> List[Entry]:
    """Later entries win. Boxes are bucketed by their dim-0 range so that the usual case
    (many disjoint writes, e.g. one per expert) costs ~linear time, not quadratic."""
    if len(entries) <= 1:
        return list(entries)
    out: List[Entry] = []
    buckets: Dict[int, List[Box]] = {}
    wide: List[Box] = []  # boxes spanning many dim-0 indices
    WIDE = 8

    def candidates(box: Box):
        if not box.ndim:
            return wide + [b for bs in buckets.values() for b in bs]
        lo, n = box.offsets[0], box.sizes[0]
        if n > WIDE:
            return wide + [b for bs in buckets.values() for b in bs if lo <= b.offsets[0] < lo + n
                           or b.offsets[0] <= lo < b.offsets[0] + b.sizes[0]]
        seen = []
        for i in range(lo, lo + n):
            seen.extend(buckets.get(i, ()))
        return wide + seen

    for e in reversed(entries):
        frags = [e.box]
        for c in candidates(e.box):
            if c.intersect(e.box) is None:
                continue
            nxt = []
            for f in frags:
                nxt.extend(f.subtract(c))
            frags = nxt
            if not frags:
                break
        out.extend(e.restrict(f) for f in frags)
        b = e.box
        if b.ndim and b.sizes[0] <= WIDE:
            for i in range(b.offsets[0], b.offsets[0] + b.sizes[0]):
                buckets.setdefault(i, []).append(b)
        else:
            wide.append(b)
    out.reverse()
    return out


# Scalars handed out by ``.item()`` on tracked tensors: distinct negative integers
# (exact in float64) that a later ``fill_`` maps back to their source element.
_SENTINEL_BASE = -(2**50)


def _bstrides(src: torch.Tensor, shape: Sequence[int]) -> Tuple[int, ...]:
    """Strides of ``src`` broadcast to ``shape`` (0 on broadcast dims)."""
    if src.shape == shape:
        return tuple(src.stride())
    nd, sd = len(shape), src.dim()
    out = []
    for k in range(nd):
        j = k - (nd - sd)
        if j < 0 or (src.shape[j] == 1 and shape[k] != 1):
            out.append(0)
        else:
            out.append(src.stride(j))
    return tuple(out)


def _physical_canon(t: torch.Tensor) -> Tuple[int, ...]:
    """The contiguous shape of a freshly allocated tensor's storage (dims ordered by stride)."""
    n_storage = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    if t.storage_offset() == 0 and t.numel() == n_storage:
        dims = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        shape = [t.shape[d] for d in dims]
        strides = [t.stride(d) for d in dims]
        expect, s = [], 1
        for n in reversed(shape):
            expect.append(s)
            s *= n
        expect.reverse()
        if all(a == b or n == 1 for a, b, n in zip(strides, expect, shape)):
            return tuple(shape) if shape else (1,)
    return (max(n_storage, 1),)


def _tensors(x) -> List[torch.Tensor]:
    """The tensors in (nested lists, tuples, dicts of) ``x``, in order."""
    out: List[torch.Tensor] = []
    _collect(x, out)
    return out


def _collect(x, out: List[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, out)


def _mixes_meta(tensors: Sequence[torch.Tensor]) -> bool:
    """Floating-point meta and non-meta tensors in one op."""
    meta = other = False
    for t in tensors:
        if t.is_floating_point():
            if t.is_meta:
                meta = True
            else:
                other = True
    return meta and other


_MUT_CACHE: Dict[object, Tuple[Tuple[int, str], ...]] = {}
_PURE_VIEW: Dict[object, bool] = {}


def _mutated_args(func) -> Tuple[Tuple[int, str], ...]:
    """(position, name) of the arguments an op writes (cached per overload)."""
    r = _MUT_CACHE.get(func)
    if r is None:
        r = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write)
        _MUT_CACHE[func] = r
    return r


def _pure_view(func) -> bool:
    """A view op that writes nothing: its output's offset and strides say everything (cached)."""
    r = _PURE_VIEW.get(func)
    if r is None:
        r = _PURE_VIEW[func] = bool(func.is_view) and not _mutated_args(func)
    return r


@lru_cache(maxsize=None)
def _identity(ndim: int) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(int(r == c) for c in range(ndim)) for r in range(ndim))


@dataclass(frozen=True, slots=True)
class _BoxCopy:
    """A copy between two box views of their storages' canonical shapes, whatever their
    offsets: each iteration dim of extent > 1 walks one canonical dim one step at a time (the
    source may broadcast instead), so the write is one box, read from one box."""

    box_sizes: Vec  # the destination box's sizes per canonical dim (1 where no dim walks)
    dst_span: Vec  # per destination canonical dim: how far the copy walks it (extent - 1)
    src_span: Vec  # likewise per source canonical dim; () for a constant source
    src_dim: Vec  # per destination canonical dim: the source canonical dim feeding it (-1: none)


_BOX_COPIES: Dict[tuple, Optional[_BoxCopy]] = {}


def _walked_dims(canon: Vec, strides: Sequence[int], broadcast: bool) -> Optional[List[int]]:
    """The canonical dim each stride walks one step at a time (its mixed-radix digits are a unit
    vector; -1 for a broadcast stride where allowed), each at most once; else None."""
    dims: List[int] = []
    for s in strides:
        e = -1 if broadcast and s == 0 else unit_dim(unravel(s, canon))
        if e is None or (e >= 0 and e in dims):
            return None
        dims.append(e)
    return dims


def _box_copy(dst_canon: Vec, sizes: Vec, d_str: Vec, src_canon: Optional[Vec], s_str: Optional[Vec]
              ) -> Optional[_BoxCopy]:
    """The copy's geometry when both views are boxes, else None; cached, since a model's
    ~45k copies per rank come in a few dozen geometries."""
    key = (dst_canon, sizes, d_str, src_canon, s_str)
    try:
        return _BOX_COPIES[key]
    except KeyError:
        pass
    keep = [k for k, n in enumerate(sizes) if n != 1]
    dims = _walked_dims(dst_canon, [d_str[k] for k in keep], broadcast=False)
    src_dims = None if src_canon is None else _walked_dims(src_canon, [s_str[k] for k in keep], broadcast=True)
    copy = None
    if dims is not None and (src_canon is None or src_dims is not None):
        box_sizes, src_dim = [1] * len(dst_canon), [-1] * len(dst_canon)
        src_span = [0] * len(src_canon or ())
        for j, (k, e) in enumerate(zip(keep, dims)):
            box_sizes[e] = sizes[k]
            if src_dims is not None and src_dims[j] >= 0:
                src_dim[e] = src_dims[j]
                src_span[src_dims[j]] = sizes[k] - 1
        copy = _BoxCopy(tuple(box_sizes), tuple(n - 1 for n in box_sizes), tuple(src_span), tuple(src_dim))
    _BOX_COPIES[key] = copy
    return copy


_VIEW_FREE_CREATE = {
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
    aten.new_empty_strided.default,
}


class LoadRecorder(TorchDispatchMode):
    """See the module docstring. Use as ``with LoadRecorder() as rec: model.load_weights(...)``."""

    def __init__(self, max_enumeration: int = 1 << 16):
        super().__init__()
        self.storages: Dict[int, StorageProv] = {}
        self.leaves: Dict[str, torch.Tensor] = {}
        self.sentinels: Dict[float, Source] = {}
        self.opaque_ops = Counter()
        self.not_affine: List[str] = []
        self.max_enumeration = max_enumeration

    # ------------------------------------------------------------------ registry
    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def register(self, t: torch.Tensor, kind: str, canon=None) -> StorageProv:
        p = StorageProv(canon or _physical_canon(t), t.element_size(), t, kind)
        self.storages[self.key(t)] = p
        return p

    def prov(self, t: torch.Tensor) -> StorageProv:
        p = self.storages.get(self.key(t))
        if p is None:  # a storage allocated outside the recording (a CPU index, a buffer)
            p = self.register(t, "untracked", (max(t.untyped_storage().nbytes() // max(t.element_size(), 1), 1),))
            p.add(Entry(Box.full(p.canon), Opaque("untracked", frozenset())))
        return p

    def add_leaf(self, name: str, t: torch.Tensor) -> None:
        p = self.register(t, "leaf", tuple(t.shape) if t.dim() else (1,))
        # a 0-d leaf is stored as shape (1,): its single coordinate maps to nothing
        p.add(Entry(Box((0,) * len(p.canon), p.canon), Leaf(name, (0,) * t.dim(), _identity(t.dim()))))
        self.leaves[name] = t

    def register_module_tensors(self, model: torch.nn.Module) -> None:
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            if self.key(t) not in self.storages:
                self.register(t, "param")

    def deps(self, t: torch.Tensor) -> FrozenSet[str]:
        out = set()
        for e in self.prov(t).entries:
            if isinstance(e.src, Leaf):
                out.add(e.src.name)
            elif isinstance(e.src, Opaque):
                out |= e.src.deps
        return frozenset(out)

    # ------------------------------------------------------------------ reading and writing
    def _read(self, p: StorageProv, i0, sizes, u0, cols, depth=0) -> List[tuple]:
        """Parts (i0, sizes, source-over-iteration) covering what the view reads."""
        k = len(sizes)
        nd = len(p.canon)
        x_at = [u0[e] + sum(cols[j][e] * i0[j] for j in range(k)) for e in range(nd)]
        span = [sum(cols[j][e] * (sizes[j] - 1) for j in range(k)) for e in range(nd)]
        out = []
        for E in p.resolved():
            bo, be = E.box.offsets, E.box.ends
            if any(x_at[e] + span[e] < bo[e] or x_at[e] >= be[e] for e in range(nd)):
                continue
            if all(bo[e] <= x_at[e] and x_at[e] + span[e] < be[e] for e in range(nd)):
                out.append((tuple(i0), tuple(sizes), self._compose(E, x_at, cols)))
                continue
            out.extend(self._read_entry(E, i0, sizes, u0, cols))
        return out

    def _read_entry(self, E, i0, sizes, u0, cols, budget=None):
        """The part of the iteration sub-box (i0, sizes) that reads inside entry E; where the
        read is not separable (two iteration dims on one canonical dim), enumerate the outer one."""
        budget = budget if budget is not None else [self.max_enumeration]
        k, nd = len(sizes), len(E.box.offsets)
        x_at = [u0[e] + sum(cols[j][e] * i0[j] for j in range(k)) for e in range(nd)]
        span = [sum(cols[j][e] * (sizes[j] - 1) for j in range(k)) for e in range(nd)]
        bo, be = E.box.offsets, E.box.ends
        if any(x_at[e] + span[e] < bo[e] or x_at[e] >= be[e] for e in range(nd)):
            return []
        if all(bo[e] <= x_at[e] and x_at[e] + span[e] < be[e] for e in range(nd)):
            return [(tuple(i0), tuple(sizes), self._compose(E, x_at, cols))]
        sub = self._preimage(E, i0, sizes, x_at, cols)
        if sub is None:
            j = self._offending(cols, sizes)
            budget[0] -= sizes[j]
            if budget[0] < 0:
                raise NotAffine("read needs too many pieces")
            out = []
            for v in range(sizes[j]):
                i1 = list(i0)
                i1[j] += v
                s1 = list(sizes)
                s1[j] = 1
                out.extend(self._read_entry(E, i1, s1, u0, cols, budget))
            return out
        if not sub:
            return []
        si0, ssz = sub
        xs = [u0[e] + sum(cols[j][e] * si0[j] for j in range(k)) for e in range(nd)]
        return [(si0, ssz, self._compose(E, xs, cols))]

    @staticmethod
    def _offending(cols, sizes):
        used = Counter()
        for j, c in enumerate(cols):
            if sizes[j] > 1:
                for e, v in enumerate(c):
                    if v:
                        used[e] += 1
        worst = None
        for j, c in enumerate(cols):
            if sizes[j] <= 1:
                continue
            nz = [e for e, v in enumerate(c) if v]
            if len(nz) > 1 or any(used[e] > 1 for e in nz):
                if worst is None or max(c) > max(cols[worst]):
                    worst = j
        return worst

    @staticmethod
    def _preimage(E, i0, sizes, x_at, cols):
        """The iteration sub-box reading inside E.box; [] when empty; None when not separable."""
        nd = len(E.box.offsets)
        lo, hi = list(i0), [a + s for a, s in zip(i0, sizes)]
        touched = {}
        for j, c in enumerate(cols):
            if sizes[j] <= 1:
                continue
            nz = [e for e, v in enumerate(c) if v]
            if not nz:
                continue
            if len(nz) > 1 or nz[0] in touched:
                return None
            touched[nz[0]] = j
        for e in range(nd):
            b0, b1 = E.box.offsets[e], E.box.ends[e]
            j = touched.get(e)
            if j is None:
                if not (b0 <= x_at[e] < b1):
                    return []
                continue
            m = cols[j][e]
            # x = x_at[e] + m * (i - i0[j]) in [b0, b1)
            a = i0[j] + max(0, -((x_at[e] - b0) // m))
            b = i0[j] + (b1 - 1 - x_at[e]) // m + 1
            lo[j], hi[j] = max(lo[j], a), min(hi[j], b)
            if hi[j] <= lo[j]:
                return []
        return tuple(lo), tuple(h - l for h, l in zip(hi, lo))

    @staticmethod
    def _compose(E, x_at, cols):
        """Source of an iteration part whose origin reads canonical coordinate ``x_at``."""
        src = E.src
        if not isinstance(src, Leaf):
            return src
        delta = [a - b for a, b in zip(x_at, E.box.offsets)]
        l0 = tuple(a + b for a, b in zip(src.l0, matvec(src.L, delta)))
        # M[r][j] = sum_e L[r][e] * cols[j][e]
        M = tuple(tuple(sum(row[e] * c[e] for e in range(len(c))) for c in cols) for row in src.L)
        return ("iter", src.name, l0, M)

    def _write(self, p: StorageProv, d0, D, parts) -> None:
        for i0, sizes, src in parts:
            self._write_part(p, d0, D, i0, sizes, src)

    def _write_part(self, p, d0, D, i0, sizes, src, budget=None):
        k, nd = len(sizes), len(p.canon)
        mapped = {}
        bad = None
        for j in range(k):
            if sizes[j] <= 1:
                continue
            e = unit_dim(D[j])
            if e is None or e in mapped:
                bad = j
                break
            mapped[e] = j
        if bad is not None:
            if sizes[bad] > self.max_enumeration:
                raise NotAffine(f"destination dim of size {sizes[bad]} is not a box")
            for v in range(sizes[bad]):
                i1 = list(i0)
                i1[bad] += v
                s1 = list(sizes)
                s1[bad] = 1
                src1 = src
                if isinstance(src, tuple):
                    _, name, l0, M = src
                    src1 = ("iter", name, tuple(a + M[r][bad] * v for r, a in enumerate(l0)), M)
                self._write_part(p, d0, D, tuple(i1), tuple(s1), src1)
            return
        off = tuple(d0[e] + sum(D[j][e] * i0[j] for j in range(k)) for e in range(nd))
        size = tuple(sizes[mapped[e]] if e in mapped else 1 for e in range(nd))
        if isinstance(src, tuple):
            _, name, l0, M = src
            L = tuple(tuple(row[mapped[e]] if e in mapped else 0 for e in range(nd)) for row in M)
            src = Leaf(name, l0, L)
        p.add(Entry(Box(off, size), src))

    def transfer(self, dst: Tuple[int, Vec, Vec], dst_p: StorageProv, src: Optional[torch.Tensor] = None,
                 src_geom: Optional[Tuple[int, Vec]] = None, fixed: Optional[Source] = None) -> None:
        """Write into the view ``dst`` = (offset, sizes, strides) of ``dst_p``: from the view
        ``src_geom`` = (offset, strides) of ``src`` (iterating ``sizes``), or the constant ``fixed``.
        Sizes and strides are tuples (the box fast path caches by them)."""
        d_off, sizes, d_str = dst
        if any(n == 0 for n in sizes):
            return
        src_p = None
        if src is not None:
            src_p = self.prov(src)
            if src_p.itemsize != src.element_size():
                self.not_affine.append("dtype view of a tracked storage")
                self._mark_opaque_geom(dst_p, dst, Opaque("dtype-view", self.deps(src)))
                return
        if self._transfer_box(dst_p, d_off, sizes, d_str, src_p, src_geom, fixed):
            return
        sides = [(d_off, tuple(d_str), dst_p.canon)]
        if src_p is not None:
            sides.append((src_geom[0], tuple(src_geom[1]), src_p.canon))
        budget = [self.max_enumeration]
        try:
            self._transfer_split(dst_p, src_p, list(sizes), sides, fixed, budget)
        except NotAffine as e:
            self.not_affine.append(str(e))
            self._mark_opaque_geom(dst_p, dst, Opaque("not-affine", self.deps(src) if src is not None else frozenset()))

    def _transfer_box(self, dst_p: StorageProv, d_off: int, sizes: Vec, d_str: Vec, src_p: Optional[StorageProv],
                      src_geom, fixed: Optional[Source]) -> bool:
        """The copy nearly every loader makes, at a fraction of the general path's cost: both
        views are boxes of their storages' canonical shapes that stay inside them (nothing
        wraps) and the source region lies inside one recorded entry. Adds exactly the entry
        the general path (``refine``, ``_read``, ``_write``) adds; returns False, having added
        nothing, otherwise. A 671B model's rank makes ~45k such copies."""
        canon = dst_p.canon
        copy = _box_copy(canon, sizes, d_str, None if src_p is None else src_p.canon,
                         None if src_p is None else src_geom[1])
        if copy is None:
            return False
        x0 = unravel(d_off, canon)
        for x, span, n in zip(x0, copy.dst_span, canon):
            if x + span >= n:
                return False
        if src_p is None:
            src = fixed
            if isinstance(src, tuple):  # ("scalar", leaf, element): one leaf element, broadcast
                src = Leaf(src[1], src[2], tuple((0,) * len(x0) for _ in src[2]))
            dst_p.add(Entry(Box(x0, copy.box_sizes), src))
            return True
        u0 = unravel(src_geom[0], src_p.canon)
        u1 = [x + span for x, span in zip(u0, copy.src_span)]  # the last coordinate read, per dim
        for x, n in zip(u1, src_p.canon):
            if x >= n:
                return False
        entry = None
        for E in src_p.resolved():
            inside = True
            for lo, hi, o, n in zip(u0, u1, E.box.offsets, E.box.sizes):
                if hi < o or lo >= o + n:
                    break  # disjoint from E
                inside = inside and o <= lo and hi < o + n
            else:
                if entry is not None or not inside:
                    return False  # the read spans several entries: the general path splits it
                entry = E
        if entry is None:
            return True  # nothing recorded there: the general path writes nothing either
        src = entry.src
        if isinstance(src, Leaf):
            delta = [a - b for a, b in zip(u0, entry.box.offsets)]
            l0 = tuple(a + b for a, b in zip(src.l0, matvec(src.L, delta)))
            src = Leaf(src.name, l0, tuple(tuple(row[f] if f >= 0 else 0 for f in copy.src_dim) for row in src.L))
        dst_p.add(Entry(Box(x0, copy.box_sizes), src))
        return True

    def _transfer_split(self, dst_p, src_p, sizes, sides, fixed, budget):
        """Refine to affine maps; where a view wraps a canonical dim at a misaligned point,
        cut the iteration space there (head | aligned body | tail) and recurse."""
        try:
            maps = refine(sizes, sides)
        except NotAffine:
            budget[0] -= 1
            if budget[0] <= 0:
                raise
            k, cut = split_point(sizes, sides)
            for lo, n in ((0, cut), (cut, sizes[k] - cut)):
                sub = list(sizes)
                sub[k] = n
                sub_sides = [(off + lo * st[k], st, canon) for off, st, canon in sides]
                self._transfer_split(dst_p, src_p, sub, sub_sides, fixed, budget)
            return
        it, ms = maps
        d0, D = ms[0]
        if src_p is not None:
            u0, U = ms[1]
            parts = self._read(src_p, (0,) * len(it), it, u0, U)
        else:
            f = fixed
            if isinstance(f, tuple) and f[0] == "scalar":  # one leaf element, broadcast
                f = ("iter", f[1], f[2], tuple((0,) * len(it) for _ in f[2]))
            parts = [((0,) * len(it), tuple(it), f)]
        self._write(dst_p, d0, D, parts)

    def _mark_opaque_geom(self, p, dst, src):
        d_off, sizes, d_str = dst
        if any(n == 0 for n in sizes):
            return
        try:
            self._transfer_split(p, None, list(sizes), [(d_off, tuple(d_str), p.canon)], src, [self.max_enumeration])
        except NotAffine:  # give up on the whole storage
            p.add(Entry(Box.full(p.canon), src))

    @staticmethod
    def geom(t: torch.Tensor):
        return t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.transfer(self.geom(dst), self.prov(dst), src, (src.storage_offset(), _bstrides(src, dst.shape)))

    def fill(self, dst: torch.Tensor, source: Source) -> None:
        self.transfer(self.geom(dst), self.prov(dst), fixed=source)

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _pure_view(func):
            return func(*args, **kwargs)  # one input, so no device mix; offset and strides say everything
        if func is aten._local_scalar_dense.default:
            return self._item(args[0])
        if func is not aten.copy_.default and _mixes_meta(_tensors((args, kwargs))):
            args, kwargs = self._on_meta(args), {k: self._on_meta(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        try:
            self._track(func, args, kwargs, out)
        except NotAffine as e:
            self.not_affine.append(f"{func}: {e}")
        return out

    def _on_meta(self, x):
        """Meta twins (same provenance) of the real float tensors an op mixes with meta ones:
        a loader's padding made on an explicit device, concatenated with a checkpoint tensor."""
        if isinstance(x, torch.Tensor) and x.device.type != "meta" and x.is_floating_point():
            twin = x.to("meta")  # inside the mode's dispatch: not recorded
            self.register(twin, "derived")
            self.copy(twin, x)
            return twin
        if isinstance(x, (list, tuple)):
            return type(x)(self._on_meta(y) for y in x)
        return x

    def _item(self, t: torch.Tensor):
        parts = self._read(self.prov(t), (), (), unravel(t.storage_offset(), self.prov(t).canon), [])
        src = parts[-1][2] if parts else Opaque("uninitialised", frozenset())
        if isinstance(src, Const):
            value = src.value
        else:
            value = float(_SENTINEL_BASE - len(self.sentinels))
            if isinstance(src, tuple):
                src = ("scalar", src[1], src[2])
            self.sentinels[value] = src
        if t.dtype == torch.bool:
            return bool(value)
        if not t.dtype.is_floating_point and not t.dtype.is_complex:
            return int(value)
        return value

    def _scalar_source(self, value) -> Source:
        if isinstance(value, (int, float)) and float(value) in self.sentinels:
            return self.sentinels[float(value)]
        return Const(float(value))

    def _track(self, func, args, kwargs, out):
        if func is aten.copy_.default:
            self.copy(args[0], args[1])
            return
        if func in (aten.fill_.Scalar, aten.fill_.Tensor):
            v = args[1]
            if isinstance(v, torch.Tensor):
                self.copy(args[0], v)
            else:
                self.fill(args[0], self._scalar_source(v))
            return
        if func is aten.zero_.default:
            self.fill(args[0], Const(0.0))
            return

        mutated = []
        for i, name in _mutated_args(func):
            val = args[i] if i < len(args) else kwargs.get(name)
            mutated.extend(_tensors(val))
        inputs = [t for t in _tensors((args, kwargs))]
        for t in inputs:
            self.prov(t)  # so that views of untracked storages are seen as views
        if mutated:  # an in-place op other than copy_/fill_: the region becomes computed
            deps = frozenset().union(*(self.deps(t) for t in inputs)) if inputs else frozenset()
            self.opaque_ops[func.__name__] += 1
            for t in mutated:
                self._mark_opaque_geom(self.prov(t), self.geom(t), Opaque(func.__name__, deps))
            return

        outs = [t for t in _tensors(out) if self.key(t) not in self.storages]
        if not outs:
            return  # views (or no tensor output): the strides already say everything
        for o in outs:
            self.register(o, "derived")
        o = outs[0]
        if func in (aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default,
                    aten.alias_copy.default, aten.detach_copy.default):
            self.copy(o, args[0])
        elif func is aten.copy.default:
            self.copy(o, args[1])
        elif func is aten.cat.default:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            dim = dim % o.dim()
            off = 0
            for t in args[0]:
                if t.dim() == 1 and t.numel() == 0 and o.dim() != 1:
                    continue  # legacy: cat skips empty 1-D tensors
                n = t.shape[dim]
                sizes = list(o.shape)
                sizes[dim] = n
                self.transfer((o.storage_offset() + off * o.stride(dim), tuple(sizes), tuple(o.stride())),
                              self.prov(o), t, (t.storage_offset(), _bstrides(t, sizes)))
                off += n
        elif func is aten.stack.default:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            dim = dim % o.dim()
            for m, t in enumerate(args[0]):
                sizes = [n for d, n in enumerate(o.shape) if d != dim]
                strides = [s for d, s in enumerate(o.stride()) if d != dim]
                self.transfer((o.storage_offset() + m * o.stride(dim), tuple(sizes), tuple(strides)),
                              self.prov(o), t, (t.storage_offset(), _bstrides(t, sizes)))
        elif func is aten.constant_pad_nd.default:
            x, pad = args[0], list(args[1])
            value = args[2] if len(args) > 2 else kwargs.get("value", 0)
            self.fill(o, self._scalar_source(value))
            d_off, s_off = o.storage_offset(), x.storage_offset()
            sizes = list(x.shape)
            for q in range(len(pad) // 2):
                d = x.dim() - 1 - q
                before, after = pad[2 * q], pad[2 * q + 1]
                if before >= 0:
                    d_off += before * o.stride(d)
                else:
                    s_off += -before * x.stride(d)
                    sizes[d] += before
                if after < 0:
                    sizes[d] += after
            self.transfer((d_off, tuple(sizes), tuple(o.stride())), self.prov(o), x, (s_off, tuple(x.stride())))
        elif func is aten.index_select.default and args[2].device.type != "meta":
            x, dim, index = args
            dim = dim % x.dim()
            sizes = [n for d, n in enumerate(o.shape) if d != dim]
            ds = [s for d, s in enumerate(o.stride()) if d != dim]
            xs = [s for d, s in enumerate(x.stride()) if d != dim]
            for m, j in enumerate(index.tolist()):
                self.transfer((o.storage_offset() + m * o.stride(dim), tuple(sizes), tuple(ds)), self.prov(o), x,
                              (x.storage_offset() + j * x.stride(dim), tuple(xs)))
        elif func in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
            for t in outs:
                self.fill(t, Const(0.0))
        elif func in (aten.ones.default, aten.ones_like.default, aten.new_ones.default):
            for t in outs:
                self.fill(t, Const(1.0))
        elif func in (aten.full.default, aten.full_like.default, aten.new_full.default, aten.scalar_tensor.default):
            value = args[1] if func in (aten.full.default, aten.full_like.default, aten.new_full.default) else args[0]
            for t in outs:
                self.fill(t, self._scalar_source(value))
        elif func in _VIEW_FREE_CREATE:
            pass  # uninitialised
        else:
            deps = frozenset().union(*(self.deps(t) for t in inputs)) if inputs else frozenset()
            self.opaque_ops[func.__name__] += 1
            for t in outs:
                self.prov(t).add(Entry(Box.full(self.prov(t).canon), Opaque(func.__name__, deps)))

    # ------------------------------------------------------------------ results
    def describe(self, t: torch.Tensor) -> List[Entry]:
        """What ``t`` holds, as disjoint entries in ``t``'s own coordinates."""
        shape = tuple(t.shape) if t.dim() else (1,)
        strides = tuple(t.stride()) if t.dim() else (1,)
        src_p = self.prov(t)
        if src_p.canon == shape and t.storage_offset() == 0 and strides == cstrides(shape):
            return src_p.resolved()  # the tensor is its storage, as laid out at allocation
        tmp = StorageProv(shape, t.element_size(), None, "view")
        sides = [(0, cstrides(shape), shape), (t.storage_offset(), strides, src_p.canon)]
        try:
            self._transfer_split(tmp, src_p, list(shape), sides, None, [self.max_enumeration])
        except NotAffine as e:
            tmp.add(Entry(Box.full(shape), Opaque(f"not-affine: {e}", self.deps(t))))
        return tmp.resolved()
