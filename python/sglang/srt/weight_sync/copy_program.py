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
per joined copy; it returns False, copying nothing, when they do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import contiguous_strides

__all__ = ("CopyProgram",)

# How many of the next regions of the same length a run may start towards: enough for a
# kind that alternates with a few others (an expert's gate and up between its downs).
_STEPS_TRIED = 4


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
            _whole_sources(_join_runs(flat + others), wheres), wheres, len(wheres)
        )

    def run(
        self,
        dst_bases: Sequence[torch.Tensor],
        src_bases: Sequence[torch.Tensor],
    ) -> bool:
        """Copy, if ``dst_bases``/``src_bases`` (this update's tensors, in the order the
        program was compiled from) lie as they did then; False (nothing copied) if not."""
        if len(dst_bases) != self.regions or len(src_bases) != self.regions:
            return False
        tensors: Dict[int, torch.Tensor] = {}
        starts: Dict[int, int] = {}
        seen: Dict[int, _Where] = {}  # id of a tensor found where it should be -> where
        for (ws, wd), sb, db in zip(self._wheres, src_bases, dst_bases):
            for w, base in ((ws, sb), (wd, db)):
                if seen.get(id(base)) is w:
                    continue
                if not _lies(w, base, starts, tensors):
                    return False
                seen[id(base)] = w
        views_d, views_s = [], []
        for c in self.copies:
            src = tensors[c.src]
            views_s.append(
                src
                if c.src_whole
                else src.as_strided(c.sizes, c.src_strides, c.src_offset)
            )
            views_d.append(
                tensors[c.dst].as_strided(c.sizes, c.dst_strides, c.dst_offset)
            )
        if views_d:
            torch._foreach_copy_(views_d, views_s)
        return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
