"""Many small region copies as a few strided ones, where the regions lie evenly (execute).

A MoE layer's experts are hundreds of regions, and a copy costs a dispatch per region
however small it is. They lie evenly on both ends, though: a trainer rank's shards of one
kind sit a constant step apart in the segment it wrote, and their places in the engine's
fused expert parameter a constant step apart too. ``CopyProgram.compile`` turns one
update's copies (destination and source views, with the tensors they are views of) into:

1. regions contiguous on both ends that lie back to back on both, joined into one;
2. runs of equal length whose starts advance by one constant step on each end, joined into
   one two-dimensional strided copy;
3. every other copy as it was.

Each copy is kept as strides and an offset in the storage of one of the update's tensors
(its *slot*), so the program serves every later update whose tensors lie the same way:
``run`` checks that each tensor still shares storage with its slot's other tensors at the
same offset and strides (a segment mapped anew does), then copies with one view
per joined copy; it returns False, copying nothing, when they do not. Sources handed as
the same ``FixedShards`` it checked last time are known to lie as they did, without a
look at each of them.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import contiguous_strides

__all__ = ("CopyProgram", "FixedShards")

# How many of the next regions of the same length a run may start towards: enough for a
# kind that alternates with a few others (an expert's gate and up between its downs).
_STEPS_TRIED = 4


class FixedShards(dict):
    """Buffers by key that stay the same tensor objects, lying the same way, for as long
    as this mapping lives: a receiver's views of a shared-memory segment it keeps mapped,
    handed every update of an unchanged layout. Read-only (a dict for lookups at C speed);
    ``executor.check_inputs`` and ``CopyProgram.run`` know one they checked before by its
    identity instead of looking at each of its tensors (a MoE model's experts are tens of
    thousands of shards)."""

    __slots__ = ("__weakref__",)

    def _read_only(self, *args, **kwargs):
        raise TypeError("FixedShards is read-only: its tensors are checked by identity")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


def _storage_ptr(t: torch.Tensor) -> int:
    return t.data_ptr() - t.storage_offset() * t.element_size()


@dataclass(frozen=True)
class _Copy:
    """One copy: ``sizes`` elements read at ``src_strides`` from ``src_offset`` of slot
    ``src``'s storage, written at ``dst_strides`` from ``dst_offset`` of slot ``dst``'s."""

    src: int
    dst: int
    sizes: Tuple[int, ...]
    src_strides: Tuple[int, ...]
    dst_strides: Tuple[int, ...]
    src_offset: int
    dst_offset: int
    # it reads all of its source slot's tensor as that lies: ``run`` reads the tensor
    # itself, no view (a trainer's shards, each in a storage of its own, read whole)
    src_whole: bool = False
    # both ends viewed in this wider dtype (their bytes copied as they are, fewer and
    # larger elements: ``_widened``), or None
    wide: Optional[torch.dtype] = None


@dataclass(frozen=True)
class _Where:
    """Where one copy's tensor lies: its slot, its offset in the slot's storage (elements,
    and bytes), its dtype, shape and strides."""

    slot: int
    offset: int
    byte_offset: int
    dtype: torch.dtype
    shape: torch.Size
    strides: Tuple[int, ...]


class CopyProgram:
    """The joined copies of one list of region copies; see the module docstring."""

    def __init__(
        self,
        copies: List[_Copy],
        wheres: List[Tuple[_Where, _Where]],
        regions: int,
    ) -> None:
        self.copies = copies
        # per region copy: its source tensor's, its target tensor's
        self._wheres = wheres
        self.regions = regions
        self._ends = (
            _End.of([ws for ws, _ in wheres]),
            _End.of([wd for _, wd in wheres]),
        )
        # each slot's first tensor in ``run``'s order (a region's source, then its target):
        # (slot, end, its index among that end's distinct tensors)
        firsts: Dict[int, Tuple[int, int, int]] = {}
        for i, pair in enumerate(wheres):
            for e, w in enumerate(pair):
                if w.slot not in firsts:
                    firsts[w.slot] = (w.slot, e, self._ends[e].group[i])
        self._firsts = tuple(firsts.values())
        self._src_slots = frozenset(self._ends[0].slots)
        # the sources last found lying right, when they came as ``FixedShards``: a weak
        # reference to it, and each source slot's tensor (weakly) and start
        self._kept: Optional[tuple] = None

    @classmethod
    def compile(
        cls,
        dst_views: Sequence[torch.Tensor],
        src_views: Sequence[torch.Tensor],
        dst_bases: Sequence[torch.Tensor],
        src_bases: Sequence[torch.Tensor],
    ) -> Optional[CopyProgram]:
        """The program of copying each ``src_views[i]`` into ``dst_views[i]`` (a view of
        ``dst_bases[i]``, as the source is of ``src_bases[i]``); None when a view is not of
        its base's storage or a tensor is not a plain strided one."""
        slots: Dict[tuple, int] = {}
        wheres: List[Tuple[_Where, _Where]] = []
        chunks: List[Tuple[int, int, torch.dtype, torch.dtype, int, int, int]] = []
        others: List[_Copy] = []

        known: Dict[int, _Where] = {}  # one per tensor: ``run`` checks each once

        def where(base: torch.Tensor) -> Optional[_Where]:
            if id(base) in known:
                return known[id(base)]
            if base.layout != torch.strided or type(base) not in _PLAIN:
                return None
            # a slot per storage and dtype: offsets count elements of the dtype
            slot = slots.setdefault((_storage_ptr(base), base.dtype), len(slots))
            offset = base.storage_offset()
            found = known[id(base)] = _Where(
                slot,
                offset,
                offset * base.element_size(),
                base.dtype,
                base.shape,
                base.stride(),
            )
            return found

        for dv, sv, db, sb in zip(dst_views, src_views, dst_bases, src_bases):
            wd, ws = where(db), where(sb)
            if wd is None or ws is None:
                return None
            if _storage_ptr(dv) != _storage_ptr(db) or _storage_ptr(sv) != _storage_ptr(
                sb
            ):
                return None
            wheres.append((ws, wd))
            if dv.shape != sv.shape or dv.dtype != db.dtype or sv.dtype != sb.dtype:
                return None
            if (
                ws.slot == wd.slot
                and dv.storage_offset() == sv.storage_offset()
                and dv.stride() == sv.stride()
                and dv.dtype == sv.dtype
            ):
                continue  # received straight into its place: nothing to copy
            if not dv.numel():
                continue
            if dv.is_contiguous() and sv.is_contiguous():
                chunks.append(
                    (
                        ws.slot,
                        wd.slot,
                        sv.dtype,
                        dv.dtype,
                        sv.storage_offset(),
                        dv.storage_offset(),
                        dv.numel(),
                    )
                )
            else:
                others.append(
                    _Copy(
                        ws.slot,
                        wd.slot,
                        tuple(dv.shape),
                        sv.stride(),
                        dv.stride(),
                        sv.storage_offset(),
                        dv.storage_offset(),
                    )
                )
        flat = [
            _Copy(src, dst, (n,), (1,), (1,), s_off, d_off)
            for src, dst, _, _, s_off, d_off, n in _join_back_to_back(chunks)
        ]
        return cls(
            _widened(_whole_sources(_join_runs(flat + others), wheres), wheres),
            wheres,
            len(wheres),
        )

    def keeps(self, src_from: Optional[Mapping[str, torch.Tensor]]) -> bool:
        """Whether ``src_from`` is the ``FixedShards`` this program last found its sources
        in, lying right: ``run`` then needs no source tensors."""
        kept = self._kept
        return kept is not None and src_from is not None and kept[0]() is src_from

    def run(
        self,
        dst_bases: Sequence[torch.Tensor],
        src_bases: Optional[Sequence[torch.Tensor]],
        src_from: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> bool:
        """Copy, if ``dst_bases``/``src_bases`` (this update's tensors, in the order the
        program was compiled from) lie as they did then; False (nothing copied) if not.
        ``src_from``: the mapping the sources are read from; ``src_bases`` None: the same
        ``FixedShards`` as last time (``keeps``)."""
        if len(dst_bases) != self.regions:
            return False
        tensors: Dict[int, torch.Tensor] = {}
        starts: Dict[int, int] = {}
        if src_bases is None:
            if not self._sources_kept(src_from, starts, tensors):
                return False
            found = self._found(None, dst_bases, starts, tensors)
            if found is None:
                found = _each_lies(
                    self._wheres, ((None, db) for db in dst_bases), starts, tensors
                )
        else:
            self._kept = None
            if len(src_bases) != self.regions:
                return False
            found = self._found(src_bases, dst_bases, starts, tensors)
            if found is None:  # the tensors repeat otherwise than they did: one by one
                found = _each_lies(
                    self._wheres, zip(src_bases, dst_bases), starts, tensors
                )
            if found and isinstance(src_from, FixedShards):
                self._kept = (
                    weakref.ref(src_from),
                    tuple(
                        (slot, weakref.ref(tensors[slot]), starts[slot])
                        for slot in self._src_slots
                    ),
                )
        if not found:
            return False
        views_d, views_s = [], []
        wide: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}

        def at(slot: int, dtype: Optional[torch.dtype]) -> torch.Tensor:
            if dtype is None:
                return tensors[slot]
            found = wide.get((slot, dtype))
            if found is None:
                found = wide[slot, dtype] = tensors[slot].view(dtype)
            return found

        for c in self.copies:
            src = at(c.src, c.wide)
            views_s.append(
                src
                if c.src_whole
                else src.as_strided(c.sizes, c.src_strides, c.src_offset)
            )
            views_d.append(
                at(c.dst, c.wide).as_strided(c.sizes, c.dst_strides, c.dst_offset)
            )
        if views_d:
            torch._foreach_copy_(views_d, views_s)
        return True

    def _sources_kept(
        self,
        src_from: Optional[Mapping[str, torch.Tensor]],
        starts: Dict[int, int],
        tensors: Dict[int, torch.Tensor],
    ) -> bool:
        """``keeps(src_from)``, each source slot's tensor still alive: then ``starts``
        and ``tensors`` have them."""
        if not self.keeps(src_from):
            return False
        for slot, ref, start in self._kept[1]:
            base = ref()
            if base is None:
                return False
            starts[slot], tensors[slot] = start, base
        return True

    def _found(
        self,
        src_bases: Optional[Sequence[torch.Tensor]],
        dst_bases: Sequence[torch.Tensor],
        starts: Dict[int, int],
        tensors: Dict[int, torch.Tensor],
    ) -> Optional[bool]:
        """Whether every tensor lies where ``_lies`` wants it, checked a list at a time
        (each end's distinct tensors read in a few passes, not one call each: a MoE
        layer's experts are thousands of shards); None when a tensor the program met at
        several regions is not the same one at each of them now (``_each_lies`` then).
        ``src_bases`` None: the sources are kept (``_sources_kept``), the targets alone
        are checked."""
        picked: List[Optional[List[torch.Tensor]]] = []
        for end, bases in zip(self._ends, (src_bases, dst_bases)):
            if bases is None:
                picked.append(None)
                continue
            these = end.pick(bases)
            if these is None:
                return None
            if not (
                set(map(type, these)) <= _PLAIN_SET
                and tuple(map(_DTYPE, these)) == end.dtypes
                and tuple(map(_SHAPE, these)) == end.shapes
                and tuple(map(torch.Tensor.stride, these)) == end.strides
            ):
                return False
            picked.append(these)
        for slot, e, k in self._firsts:
            if picked[e] is None or slot in starts:
                continue
            base, w = picked[e][k], self._ends[e].wheres[k]
            if base.storage_offset() != w.offset:
                return False
            starts[slot] = base.data_ptr() - w.byte_offset
            tensors[slot] = base
        return all(
            tuple(
                map(operator.sub, map(torch.Tensor.data_ptr, these), end.byte_offsets)
            )
            == tuple(map(starts.__getitem__, end.slots))
            for end, these in zip(self._ends, picked)
            if these is not None
        )


def _each_lies(wheres, pairs, starts, tensors) -> bool:
    """``CopyProgram._found``, one region at a time (each of ``pairs``, a region's source
    and target tensor, where ``wheres`` says; a source None is kept, not looked at): any
    tensors in any repetition."""
    seen: Dict[int, _Where] = {}  # id of a tensor found where it should be -> where
    for (ws, wd), (sb, db) in zip(wheres, pairs):
        for w, base in ((ws, sb), (wd, db)):
            if base is None or seen.get(id(base)) is w:
                continue
            if not _lies(w, base, starts, tensors):
                return False
            seen[id(base)] = w
    return True


@dataclass(frozen=True)
class _End:
    """One end (sources or targets) of a program's regions, as ``CopyProgram._found``
    checks it: its distinct tensors (one per ``_Where``: the program met a tensor at
    several regions, a parameter at each of its experts, say) and what each must be."""

    reps: Tuple[int, ...]  # the first region of each distinct tensor
    group: Tuple[int, ...]  # per region, the index of its tensor among ``reps``
    wheres: Tuple[_Where, ...]  # per distinct tensor
    dtypes: Tuple[torch.dtype, ...]
    shapes: Tuple[torch.Size, ...]
    strides: Tuple[Tuple[int, ...], ...]
    byte_offsets: Tuple[int, ...]
    slots: Tuple[int, ...]

    @classmethod
    def of(cls, wheres: Sequence[_Where]) -> _End:
        index: Dict[int, int] = {}
        reps, group, distinct = [], [], []
        for i, w in enumerate(wheres):
            k = index.get(id(w))
            if k is None:
                k = index[id(w)] = len(reps)
                reps.append(i)
                distinct.append(w)
            group.append(k)
        return cls(
            tuple(reps),
            tuple(group),
            tuple(distinct),
            tuple(w.dtype for w in distinct),
            tuple(w.shape for w in distinct),
            tuple(w.strides for w in distinct),
            tuple(w.byte_offset for w in distinct),
            tuple(w.slot for w in distinct),
        )

    def pick(self, bases: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """This update's distinct tensors of this end, or None when a tensor met at
        several regions is not one object at all of them now."""
        if not self.reps:
            return []
        these = (
            [bases[self.reps[0]]]
            if len(self.reps) == 1
            else list(operator.itemgetter(*self.reps)(bases))
        )
        if len(these) < len(bases):
            ids = list(map(id, these))
            if list(map(id, bases)) != list(map(ids.__getitem__, self.group)):
                return None
        return these


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _lies(
    w: _Where,
    base: torch.Tensor,
    starts: Dict[int, int],
    tensors: Dict[int, torch.Tensor],
) -> bool:
    """Whether ``base`` lies where ``w`` says: its dtype, shape and strides, and its data
    at ``w``'s offset from where its slot's storage starts this update. The first of a
    slot's tensors seen names that start (it must lie at its own storage's offset ``w``
    says: the copies are views of its storage); every other is found from it by address,
    which only memory of that storage has."""
    if (
        type(base) not in _PLAIN
        or base.dtype is not w.dtype
        or base.shape != w.shape
        or base.stride() != w.strides
    ):
        return False
    start = base.data_ptr() - w.byte_offset
    known = starts.get(w.slot)
    if known is not None:
        return known == start
    if base.storage_offset() != w.offset:
        return False
    starts[w.slot] = start
    tensors[w.slot] = base
    return True


def _whole_sources(
    copies: List[_Copy], wheres: List[Tuple[_Where, _Where]]
) -> List[_Copy]:
    """``copies``, each marked ``src_whole`` where it reads its source slot's tensor (the
    first of the slot's tensors ``run`` meets, which ``_lies`` checks lies as then) whole:
    in its own shape and strides, or, contiguous, as the flat run of its elements (then
    copied in the tensor's shape, contiguous on both ends: the same bytes)."""
    first: Dict[int, _Where] = {}
    for ws, wd in wheres:  # ``run``'s order: each region's source, then its target
        first.setdefault(ws.slot, ws)
        first.setdefault(wd.slot, wd)
    out = []
    for c in copies:
        w = first[c.src]
        shape = tuple(w.shape)
        if c.src_offset != w.offset:
            out.append(c)
        elif c.sizes == shape and c.src_strides == w.strides:
            out.append(replace(c, src_whole=True))
        elif (
            c.sizes == (math.prod(shape),)
            and c.src_strides == c.dst_strides == (1,)
            and w.strides == contiguous_strides(shape)
        ):
            out.append(
                replace(
                    c,
                    sizes=shape,
                    src_strides=w.strides,
                    dst_strides=w.strides,
                    src_whole=True,
                )
            )
        else:
            out.append(c)
    return out


# What a same-dtype copy's bytes may be read as (``_widened``), widest first.
_WIDER = (torch.int64, torch.int32)


def _widened(copies: List[_Copy], wheres: List[Tuple[_Where, _Where]]) -> List[_Copy]:
    """``copies``, each between tensors of one dtype made a copy of wider elements where
    both ends allow it (``wide``): a bf16 expert region's rows of 64 elements are 16 of
    int64, which torch's CPU copy of short strided rows moves about a third faster. The
    bytes are the same, so the copy is exact. Allowed when both slots' tensors can be
    viewed in the wider dtype (``_viewable``) and the copy's last dimension is contiguous
    on both ends, its length, its other strides and its offsets whole wide elements."""
    first: Dict[int, _Where] = {}
    for ws, wd in wheres:  # ``run``'s order, as ``_whole_sources``'
        first.setdefault(ws.slot, ws)
        first.setdefault(wd.slot, wd)
    out = []
    for c in copies:
        ws, wd = first[c.src], first[c.dst]
        dtype = ws.dtype
        for wide in _WIDER if wd.dtype == dtype and c.sizes else ():
            n = wide.itemsize // dtype.itemsize if not dtype.is_complex else 0
            if n < 2 or wide.itemsize % dtype.itemsize:
                continue
            if not (
                c.sizes[-1] % n == 0
                and c.sizes[-1]
                and c.src_strides[-1] == c.dst_strides[-1] == 1
                and all(x % n == 0 for x in c.src_strides[:-1] + c.dst_strides[:-1])
                and c.src_offset % n == 0
                and c.dst_offset % n == 0
                and _viewable(ws, n)
                and _viewable(wd, n)
            ):
                continue
            out.append(
                replace(
                    c,
                    sizes=(*c.sizes[:-1], c.sizes[-1] // n),
                    src_strides=(*(x // n for x in c.src_strides[:-1]), 1),
                    dst_strides=(*(x // n for x in c.dst_strides[:-1]), 1),
                    src_offset=c.src_offset // n,
                    dst_offset=c.dst_offset // n,
                    wide=wide,
                )
            )
            break
        else:
            out.append(c)
    return out


def _viewable(w: _Where, n: int) -> bool:
    """Whether a tensor lying as ``w`` says views in a dtype ``n`` times as wide
    (``Tensor.view(dtype)``'s conditions)."""
    return (
        len(w.shape) > 0
        and w.strides[-1] == 1
        and w.shape[-1] % n == 0
        and all(x % n == 0 for x in w.strides[:-1])
        and w.offset % n == 0
    )


def _join_back_to_back(chunks):
    """Contiguous regions that follow each other on both ends, as one."""
    chunks = sorted(chunks, key=lambda c: (c[0], c[1], str(c[2]), str(c[3]), c[4]))
    out: List[list] = []
    for c in chunks:
        last = out[-1] if out else None
        if (
            last is not None
            and last[:4] == list(c[:4])
            and last[4] + last[6] == c[4]
            and last[5] + last[6] == c[5]
        ):
            last[6] += c[6]
            continue
        out.append(list(c))
    return out


def _join_runs(copies: List[_Copy]) -> List[_Copy]:
    """Copies of one shape and strides on both ends whose starts advance by one step on
    each end, as one copy with one more (leading) dimension. The plan's regions never
    overlap where they are written, so neither do the joined ones."""
    groups: Dict[tuple, List[_Copy]] = {}
    for c in copies:
        groups.setdefault(
            (c.src, c.dst, c.sizes, c.src_strides, c.dst_strides), []
        ).append(c)
    out: List[_Copy] = []
    for members in groups.values():
        members.sort(key=lambda c: (c.src_offset, c.dst_offset))
        at = {(c.src_offset, c.dst_offset): i for i, c in enumerate(members)}
        taken = [False] * len(members)
        for i, c in enumerate(members):
            if taken[i]:
                continue
            taken[i] = True
            best: List[int] = []
            best_step = (0, 0)
            tried = 0
            for j in range(i + 1, len(members)):
                if tried == _STEPS_TRIED:
                    break
                if taken[j]:
                    continue
                tried += 1
                step = (
                    members[j].src_offset - c.src_offset,
                    members[j].dst_offset - c.dst_offset,
                )
                if step[0] < 0 or step[1] < 1:
                    continue  # as_strided takes no negative stride
                chain, s, d = [], c.src_offset + step[0], c.dst_offset + step[1]
                while (s, d) in at and not taken[at[s, d]]:
                    chain.append(at[s, d])
                    s, d = s + step[0], d + step[1]
                if len(chain) > len(best):
                    best, best_step = chain, step
            for k in best:
                taken[k] = True
            if not best:
                out.append(c)
                continue
            out.append(
                _Copy(
                    c.src,
                    c.dst,
                    (len(best) + 1, *c.sizes),
                    (best_step[0], *c.src_strides),
                    (best_step[1], *c.dst_strides),
                    c.src_offset,
                    c.dst_offset,
                )
            )
    return out
