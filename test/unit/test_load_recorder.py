"""The load recorder alone (no SGLang): random view chains and the allocating ops loaders use,
replayed on real index-encoded tensors and on meta tensors under ``LoadRecorder``.

Every element the recorder says comes from a checkpoint element (a piece, possibly permuted),
a zero or another constant must equal what the real ops produced; every element it does not
claim must have been computed by arithmetic or never written. And the box fast path for
copies (``Transfers.box``) must add exactly the entries the general path adds, on every case.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from benchmark.weight_sync.hand_rules import reference_param  # noqa: E402
from sglang.srt.weight_sync.box import Box  # noqa: E402
from sglang.srt.weight_sync.derive.derived_targets import (  # noqa: E402
    entries_to_target,
)
from sglang.srt.weight_sync.derive.load_recorder import (  # noqa: E402
    Const,
    Entry,
    Leaf,
    LoadRecorder,
    Opaque,
)

CASES = 1500


class Twin:
    """One tensor twice: real (index-encoded float64, outside the recorder) and meta (under it)."""

    def __init__(self, real: torch.Tensor, meta: torch.Tensor):
        self.real, self.meta = real, meta

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.real.shape)

    def dim(self) -> int:
        return self.real.dim()

    def numel(self) -> int:
        return self.real.numel()

    def apply(self, name: str, *args, **kwargs):
        real_args = [a.real if isinstance(a, Twin) else a for a in args]
        meta_args = [a.meta if isinstance(a, Twin) else a for a in args]
        with _disable_current_modes():
            r = getattr(self.real, name)(*real_args, **kwargs)
        m = getattr(self.meta, name)(*meta_args, **kwargs)
        if isinstance(r, (tuple, list)):
            return [Twin(x, y) for x, y in zip(r, m)]
        return Twin(r, m) if isinstance(r, torch.Tensor) else r

    def __getitem__(self, index) -> Twin:
        with _disable_current_modes():
            r = self.real[index]
        return Twin(r, self.meta[index])


def _real(fn, *args, **kwargs):
    with _disable_current_modes():
        return fn(*args, **kwargs)


def _twin_op(fn, twins: List[Twin], *args) -> Twin:
    return Twin(
        _real(fn, [t.real for t in twins], *args), fn([t.meta for t in twins], *args)
    )


def random_view(rng: random.Random, t: Twin) -> Twin:
    """A random chain of view ops: narrow, select, transpose, unsqueeze, flatten, unflatten, steps, chunk."""
    for _ in range(rng.randint(0, 3)):
        if t.dim() == 0:
            break
        op = rng.choice(
            (
                "narrow",
                "select",
                "transpose",
                "unsqueeze",
                "flatten",
                "unflatten",
                "step",
                "chunk",
            )
        )
        d = rng.randrange(t.dim())
        n = t.shape[d]
        if op == "narrow" and n > 1:
            a = rng.randrange(n)
            t = t.apply("narrow", d, a, rng.randint(1, n - a))
        elif op == "select" and t.dim() > 1:
            t = t.apply("select", d, rng.randrange(n))
        elif op == "transpose" and t.dim() > 1:
            t = t.apply("transpose", d, rng.randrange(t.dim()))
        elif op == "unsqueeze":
            t = t.apply("unsqueeze", rng.randrange(t.dim() + 1))
        elif op == "flatten" and d + 1 < t.dim():
            flat = t.real.flatten(d, d + 1)
            if (
                flat._base is not None and flat.data_ptr() == t.real.data_ptr()
            ):  # only where it is a view
                t = t.apply("flatten", d, d + 1)
        elif op == "unflatten" and n > 2 and n % 2 == 0:
            t = t.apply("unflatten", d, (2, n // 2))
        elif op == "step" and n > 2:
            index = [slice(None)] * t.dim()
            index[d] = slice(rng.randrange(2), None, 2)
            t = t[tuple(index)]
        elif op == "chunk" and n >= 2:
            t = rng.choice(t.apply("chunk", 2, d))
    return t


def _shaped_like(flat: Twin, dst: Twin) -> Twin:
    """``flat``'s leading elements in ``dst``'s shape, or its first element broadcast."""
    if flat.numel() < dst.numel():
        return flat[0:1].apply("expand", dst.shape) if dst.dim() else flat[0]
    return flat[0 : dst.numel()].apply("reshape", dst.shape) if dst.dim() else flat[0]


def _leaf_rows(rng: random.Random, leaves: Dict[str, Twin], rows: int, dst: Twin):
    """``rows`` rows of ``dst``'s trailing shape taken from a random leaf, or None."""
    need = rows * (dst.numel() // max(dst.shape[0], 1))
    flat = leaves[rng.choice(sorted(leaves))].apply("reshape", (-1,))
    if flat.numel() < need:
        return None
    return flat[0:need].apply("reshape", (rows,) + dst.shape[1:])


def one_case(rng: random.Random, fast: bool):
    """Random loader-like writes into one parameter; returns (recorder entries, target, real
    parameter, leaves, mask of computed elements, fast-path copies taken)."""
    rec = LoadRecorder()
    taken = [0]
    general_only = rec.transfers.box

    def box_path(*args):
        done = fast and general_only(*args)
        taken[0] += done
        return done

    rec.transfers.box = box_path
    leaves, start = {}, 1
    for i in range(3):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        real = (
            torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + start
        ).reshape(shape)
        start += real.numel()
        meta = torch.empty(shape, dtype=torch.float64, device="meta")
        rec.add_leaf(f"w{i}", meta)
        leaves[f"w{i}"] = Twin(real, meta)
    shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
    p = Twin(
        torch.full(shape, -1.0, dtype=torch.float64),
        torch.empty(shape, dtype=torch.float64, device="meta"),
    )
    rec.register(p.meta, "param")
    computed = torch.zeros(shape, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(rng.randint(1, 4)):
            dst = random_view(rng, p)
            kind = rng.choice(
                (
                    "copy",
                    "copy",
                    "copy",
                    "cast",
                    "cat",
                    "stack",
                    "fill",
                    "zero",
                    "item",
                    "arith",
                    "pad",
                    "index_select",
                )
            )
            src = random_view(rng, leaves[rng.choice(sorted(leaves))])
            with rec:
                if kind in ("copy", "cast") and src.numel():
                    x = _shaped_like(src.apply("reshape", (-1,)), dst)
                    if kind == "cast":
                        x = (
                            x.apply("to", torch.float32)
                            .apply("contiguous")
                            .apply("to", torch.float64)
                        )
                    dst.apply("copy_", x)
                elif kind == "cat" and dst.dim() and dst.shape[0]:
                    a = rng.randint(0, dst.shape[0])
                    parts = [
                        _leaf_rows(rng, leaves, rows, dst)
                        for rows in (a, dst.shape[0] - a)
                    ]
                    if all(q is not None for q in parts):
                        dst.apply("copy_", _twin_op(torch.cat, parts))
                elif kind == "stack" and dst.dim() and dst.shape[0] <= 3:
                    rows = [
                        _leaf_rows(rng, leaves, 1, dst) for _ in range(dst.shape[0])
                    ]
                    if all(q is not None for q in rows):
                        dst.apply("copy_", _twin_op(torch.stack, [q[0] for q in rows]))
                elif kind == "fill":
                    dst.apply("fill_", 7.0)
                elif kind == "zero":
                    dst.apply("zero_")
                elif kind == "item" and src.numel():
                    one = src.apply("reshape", (-1,))[0]
                    _real(dst.real.fill_, _real(one.real.item))
                    dst.meta.fill_(one.meta.item())
                elif kind == "arith":
                    dst.apply("mul_", 2.0)
                    computed |= _written_by(p, dst)
                elif kind == "pad" and dst.dim() and dst.shape[-1] >= 2:
                    last = dst.shape[-1]
                    flat = src.apply("reshape", (-1,))
                    rows = dst.numel() // last
                    if flat.numel() >= rows * (last - 1):
                        x = flat[0 : rows * (last - 1)].apply(
                            "reshape", dst.shape[:-1] + (last - 1,)
                        )
                        pad = torch.nn.functional.pad
                        dst.apply(
                            "copy_",
                            Twin(_real(pad, x.real, (1, 0)), pad(x.meta, (1, 0))),
                        )
                elif kind == "index_select" and src.dim() and dst.dim():
                    index = torch.tensor(
                        [rng.randrange(src.shape[0]) for _ in range(dst.shape[0])]
                    )
                    y = src.apply("index_select", 0, index).apply("reshape", (-1,))
                    if y.numel() >= dst.numel():
                        dst.apply(
                            "copy_", y[0 : dst.numel()].apply("reshape", dst.shape)
                        )
    return rec.describe(p.meta), p, leaves, computed, taken[0]


def _written_by(p: Twin, view: Twin) -> torch.Tensor:
    """Which elements of ``p`` the view ``view`` covers."""
    with _disable_current_modes():
        marker = torch.zeros(p.shape, dtype=torch.float64)
        mark = marker.as_strided(
            view.real.shape, view.real.stride(), view.real.storage_offset()
        )
        mark.fill_(1.0)
        return marker.bool()


def _claims_match(
    entries: List[Entry], p: Twin, leaves: Dict[str, Twin], computed: torch.Tensor
) -> str:
    """'' when every claimed element equals the real result, else what differs."""
    target, _, _ = entries_to_target("p", p.meta, entries)
    full = {n: t.real for n, t in leaves.items()}
    expected = reference_param(target, full)
    claimed = torch.zeros(p.shape, dtype=torch.bool)
    for piece in target.pieces:
        claimed[piece.index][piece.dest_box().slices()] = True
    for z in target.zeros:
        claimed[z.slices()] = True
    refused = torch.zeros(
        p.shape, dtype=torch.bool
    )  # recorded, but an update refuses the tensor
    for e in entries:
        if isinstance(e.src, Const) and e.src.value != 0.0:
            expected[e.box.slices()] = e.src.value
            claimed[e.box.slices()] = True
        if isinstance(e.src, Opaque) and e.src.op == "mul_":
            region = torch.zeros(p.shape, dtype=torch.bool)
            region[e.box.slices()] = True
            if (region & ~computed).any():
                return f"computed region {e.box} beyond the elements arithmetic wrote"
        if entries_to_target("p", p.meta, [e])[2]:
            refused[e.box.slices()] = True
    real = p.real
    if not torch.equal(real[claimed], expected[claimed]):
        return f"claimed elements differ: real {real.tolist()}, recorded {expected.tolist()}"
    if not bool(((~claimed) <= (computed | refused | (real == -1.0))).all()):
        return f"elements neither claimed, computed, refused nor unwritten: {real.tolist()}, {entries}"
    return ""


@pytest.mark.parametrize("seed", range(3))
def test_recorded_elements_equal_real_ops(seed):
    rng = random.Random(seed)
    failures, fast_copies = [], 0
    for case in range(CASES // 3):
        state = rng.getstate()
        entries, p, leaves, computed, taken = one_case(rng, fast=True)
        fast_copies += taken
        problem = _claims_match(entries, p, leaves, computed)
        if problem:
            failures.append(f"case {case}: {problem}")
        rng.setstate(state)
        general, *_ = one_case(rng, fast=False)
        if general != entries:
            failures.append(
                f"case {case}: the box fast path recorded {entries}, the general path {general}"
            )
    assert not failures, "\n".join(failures[:5])
    assert fast_copies > CASES // 6, f"the box fast path was taken {fast_copies} times"


def test_factories_record_their_fill_value():
    """``full``, ``new_full`` (whose value is its third argument) and ``scalar_tensor`` record
    their fill value; an ``.item()`` of a leaf element becomes that element, broadcast."""
    rec = LoadRecorder()
    leaf = torch.empty(3, dtype=torch.float64, device="meta")
    rec.add_leaf("w", leaf)
    with rec:
        assert rec.describe(torch.full((2,), 3.0, device="meta")) == [
            Entry(Box((0,), (2,)), Const(3.0))
        ]
        assert rec.describe(leaf.new_full((2,), 5.0)) == [
            Entry(Box((0,), (2,)), Const(5.0))
        ]
        assert rec.describe(torch.scalar_tensor(4.0, device="meta")) == [
            Entry(Box((0,), (1,)), Const(4.0))
        ]
        assert rec.describe(leaf.new_full((2,), leaf[1].item())) == [
            Entry(Box((0,), (2,)), Leaf("w", (1,), ((0,),)))
        ]
