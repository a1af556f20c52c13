"""Boxes: rectangular regions of an N-d tensor.

A box is what torch.distributed.checkpoint calls a chunk: per-dimension offsets
and sizes. Every layout in this package (what a trainer rank holds, what an
engine rank needs) is a set of boxes, and every transfer moves one box, so the
geometry lives here once and nowhere else.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod
from typing import List, Optional, Sequence, Tuple

__all__ = ("Box", "contiguous_strides")


@dataclass(frozen=True, slots=True)
class Box:
    """The region ``offsets[d] <= i_d < offsets[d] + sizes[d]`` for every dim d."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def ends(self) -> Tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s <= 0 for s in self.sizes)

    def intersect(self, other: Box) -> Optional[Box]:
        """The common region, or None when the boxes do not overlap."""
        offsets, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offsets), tuple(sizes))

    def contains(self, other: Box) -> bool:
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            if (
                o2 < o1 or o2 + s2 > o1 + s1
            ):  # a loop, not all(genexpr): planners call this per piece
                return False
        return True

    def subtract(self, other: Box) -> List[Box]:
        """``self`` minus ``other`` as at most 2*ndim disjoint boxes (slab decomposition)."""
        inter = self.intersect(other)
        if inter is None:
            return [self]
        pieces: List[Box] = []
        offsets, sizes = list(self.offsets), list(self.sizes)
        for d in range(self.ndim):
            lo, hi = offsets[d], offsets[d] + sizes[d]
            if inter.offsets[d] > lo:
                o, s = list(offsets), list(sizes)
                s[d] = inter.offsets[d] - lo
                pieces.append(Box(tuple(o), tuple(s)))
            if inter.ends[d] < hi:
                o, s = list(offsets), list(sizes)
                o[d], s[d] = inter.ends[d], hi - inter.ends[d]
                pieces.append(Box(tuple(o), tuple(s)))
            offsets[d], sizes[d] = inter.offsets[d], inter.sizes[d]
        return pieces

    def relative_to(self, outer: Box) -> Box:
        """The same region in the coordinates of ``outer`` (whose origin becomes 0)."""
        return Box(
            tuple(o - b for o, b in zip(self.offsets, outer.offsets)), self.sizes
        )

    def translate(self, origin: Sequence[int]) -> Box:
        """The same region moved so that ``origin`` is added to its offsets."""
        return Box(tuple(o + b for o, b in zip(self.offsets, origin)), self.sizes)

    def slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def split_rows(self, max_numel: int) -> List[Box]:
        """Cut along the outermost dim with size > 1 into pieces of at most ``max_numel``
        elements where possible (a single row may still be larger). Used for buckets."""
        if self.numel <= max_numel:
            return [self]
        dim = next((d for d, s in enumerate(self.sizes) if s > 1), None)
        if dim is None:
            return [self]
        row = self.numel // self.sizes[dim]
        if row > max_numel:  # one slice along `dim` is too big: cut deeper
            out = []
            for i in range(self.sizes[dim]):
                o, s = list(self.offsets), list(self.sizes)
                o[dim], s[dim] = self.offsets[dim] + i, 1
                out.extend(Box(tuple(o), tuple(s)).split_rows(max_numel))
            return out
        step = max(1, max_numel // row)
        out = []
        for start in range(0, self.sizes[dim], step):
            o, s = list(self.offsets), list(self.sizes)
            o[dim], s[dim] = (
                self.offsets[dim] + start,
                min(step, self.sizes[dim] - start),
            )
            out.append(Box(tuple(o), tuple(s)))
        return out

    def __str__(self) -> str:
        return (
            "["
            + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes))
            + "]"
        )


def contiguous_strides(sizes: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``sizes`` (a view made by ``as_strided``):
    remembered per shape, as every tensor of every update asks and a model has few."""
    return _contiguous_strides(tuple(sizes))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(sizes: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(sizes):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))
