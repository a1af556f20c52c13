"""Strided views as affine maps onto a storage's canonical shape.

Every storage the load recorder tracks gets a *canonical shape* when it is
created (the contiguous shape of the tensor that allocated it). A strided view
(offset, sizes, strides) of it is then an affine map from the view's iteration
index ``i`` to canonical coordinates ``x = x0 + A @ i``, column ``k`` of ``A``
holding the mixed-radix digits of stride ``k``. That holds when no digit ever
overflows ("carry-free"); when a view dim walks across a canonical dim boundary
(a flattening view), that dim is split into aligned factors until it is.

This is all the view tracking needed: PyTorch's own view ops (narrow, select,
view, reshape, chunk, split, t, transpose, permute, expand, ...) already
computed offset and strides, so no op chain is ever recorded.

``box_copy`` is the common case worked out once per geometry: a copy between two
views that are boxes of their storages' canonical shapes, whatever their offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = (
    "BoxCopy",
    "NotAffine",
    "box_copy",
    "cstrides",
    "matvec",
    "refine",
    "split_point",
    "unit_dim",
    "unravel",
)

Vec = Tuple[int, ...]


class NotAffine(Exception):
    """A view that is not carry-free over its storage's canonical shape and cannot be split to be."""


def cstrides(shape: Sequence[int]) -> Vec:
    """Row-major strides of ``shape``."""
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= max(int(n), 1)
    return tuple(reversed(out))


def unravel(flat: int, shape: Sequence[int]) -> Vec:
    """Digits of ``flat`` in the mixed radix ``shape``; the leading digit absorbs any overflow."""
    digits = []
    for n in reversed(shape[1:]):
        digits.append(flat % n)
        flat //= n
    digits.append(flat)
    return tuple(reversed(digits))


def matvec(a: Sequence[Sequence[int]], v: Sequence[int]) -> List[int]:
    return [sum(x * y for x, y in zip(row, v)) for row in a]


def unit_dim(col: Sequence[int]) -> Optional[int]:
    """The dim ``e`` when ``col`` is the unit vector e_e, else None."""
    nz = [d for d, v in enumerate(col) if v]
    if len(nz) == 1 and col[nz[0]] == 1:
        return nz[0]
    return None


def _digits(offset: int, strides: Sequence[int], canon: Sequence[int]):
    return list(unravel(offset, canon)), [list(unravel(t, canon)) for t in strides]


def _violation(x0, cols, sizes, canon) -> Optional[int]:
    """First canonical dim whose digit can overflow, or None (carry-free)."""
    for e in range(len(canon)):
        if x0[e] + sum((n - 1) * c[e] for n, c in zip(sizes, cols)) >= canon[e]:
            return e
    return None


def refine(
    sizes: Sequence[int], sides: Sequence[Tuple[int, Sequence[int], Sequence[int]]]
):
    """Carry-free affine maps for several views that share one iteration space.

    ``sides``: per view (storage offset, strides over the iteration dims, canonical shape).
    Returns ``(sizes', [(x0, cols)] per side)``: ``sizes'`` drops unit dims and splits dims
    that wrap across canonical boundaries, identically for every side.
    """
    keep = [k for k, n in enumerate(sizes) if n != 1]
    sizes = [int(sizes[k]) for k in keep]
    strides = [[int(s[1][k]) for k in keep] for s in sides]
    for _ in range(64):
        maps = [_digits(off, st, canon) for (off, _, canon), st in zip(sides, strides)]
        bad = None
        for j, ((x0, cols), (_, _, canon)) in enumerate(zip(maps, sides)):
            e = _violation(x0, cols, sizes, canon)
            if e is not None:
                bad = (j, e)
                break
        if bad is None:
            return sizes, [(tuple(x0), [tuple(c) for c in cols]) for x0, cols in maps]
        j, e = bad
        x0, cols = maps[j]
        canon = sides[j][2]
        # split the iteration dim whose lowest nonzero digit is e and that spans the most of it
        best = None
        for k, c in enumerate(cols):
            low = max((d for d in range(len(canon)) if c[d]), default=None)
            if low == e and (
                best is None
                or (sizes[k] - 1) * c[e] > (sizes[best] - 1) * cols[best][e]
            ):
                best = k
        if best is None:
            raise NotAffine(
                f"view dims {sizes} strides {strides[j]} offset {sides[j][0]} over {tuple(canon)}"
            )
        m = cols[best][e]
        if canon[e] % m or x0[e] >= m:
            raise NotAffine(
                f"misaligned wrap of dim {best} over canonical dim {e} of {tuple(canon)}"
            )
        p = canon[e] // m
        if p <= 1 or sizes[best] % p:
            raise NotAffine(
                f"dim of size {sizes[best]} wraps canonical dim {e} ({canon[e]}) unevenly"
            )
        sizes[best : best + 1] = [sizes[best] // p, p]
        for st in strides:
            st[best : best + 1] = [st[best] * p, st[best]]
    raise NotAffine("refinement did not converge")


def split_point(sizes: Sequence[int], sides) -> Tuple[int, int]:
    """Where to cut an iteration space whose views wrap a canonical dim at a misaligned point:
    at the first wrap, else after the last whole period; failing that, halve the outermost dim."""
    for k in range(len(sizes)):
        if sizes[k] <= 1:
            continue
        for off, st, canon in sides:
            if st[k] == 0:
                continue
            digits = unravel(st[k], canon)
            nz = [e for e, v in enumerate(digits) if v]
            if len(nz) != 1:
                continue
            e = nz[0]
            m = digits[e]
            if canon[e] % m:
                continue
            x0 = unravel(off, canon)[e]
            p = canon[e] // m
            cut = -(-(canon[e] - x0) // m) if x0 >= m else (sizes[k] // p) * p
            if 0 < cut < sizes[k]:
                return k, cut
    k = next(k for k, n in enumerate(sizes) if n > 1)
    return k, sizes[k] // 2


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """A copy between two box views of their storages' canonical shapes, whatever their
    offsets: each iteration dim of extent > 1 walks one canonical dim one step at a time (the
    source may broadcast instead), so the write is one box, read from one box."""

    box_sizes: (
        Vec  # the destination box's sizes per canonical dim (1 where no dim walks)
    )
    dst_span: (
        Vec  # per destination canonical dim: how far the copy walks it (extent - 1)
    )
    src_span: Vec  # likewise per source canonical dim; () for a constant source
    src_dim: Vec  # per destination canonical dim: the source canonical dim feeding it (-1: none)


def _walked_dims(
    canon: Vec, strides: Sequence[int], broadcast: bool
) -> Optional[List[int]]:
    """The canonical dim each stride walks one step at a time (its mixed-radix digits are a unit
    vector; -1 for a broadcast stride where allowed), each at most once; else None."""
    dims: List[int] = []
    for s in strides:
        e = -1 if broadcast and s == 0 else unit_dim(unravel(s, canon))
        if e is None or (e >= 0 and e in dims):
            return None
        dims.append(e)
    return dims


def box_copy(
    dst_canon: Vec,
    sizes: Vec,
    dst_strides: Vec,
    src_canon: Optional[Vec],
    src_strides: Optional[Vec],
) -> Optional[BoxCopy]:
    """The geometry of copying ``sizes`` elements through ``dst_strides`` over ``dst_canon``
    from ``src_strides`` over ``src_canon`` (None: a constant) when both views are boxes,
    else None. Independent of the offsets, so callers memoise it per geometry."""
    keep = [k for k, n in enumerate(sizes) if n != 1]
    dims = _walked_dims(dst_canon, [dst_strides[k] for k in keep], broadcast=False)
    if dims is None:
        return None
    src_dims = None
    if src_canon is not None:
        src_dims = _walked_dims(
            src_canon, [src_strides[k] for k in keep], broadcast=True
        )
        if src_dims is None:
            return None
    box_sizes, src_dim = [1] * len(dst_canon), [-1] * len(dst_canon)
    src_span = [0] * len(src_canon or ())
    for j, (k, e) in enumerate(zip(keep, dims)):
        box_sizes[e] = sizes[k]
        if src_dims is not None and src_dims[j] >= 0:
            src_dim[e] = src_dims[j]
            src_span[src_dims[j]] = sizes[k] - 1
    return BoxCopy(
        tuple(box_sizes),
        tuple(n - 1 for n in box_sizes),
        tuple(src_span),
        tuple(src_dim),
    )
