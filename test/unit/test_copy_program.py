"""``copy_program.CopyProgram``: many region copies joined into a few strided ones, the
same bytes written as one copy per region, and only while the tensors lie as they did."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.weight_sync.apply import write_regions
from sglang.srt.weight_sync.copy_program import CopyProgram, FixedShards


def _experts(n_experts: int, rows: int, cols: int, dtype=torch.bfloat16):
    """A MoE layer as a trainer rank's segment holds it (each expert's gate, up, down back to
    back, one tensor each) and the engine's fused parameters they land in: gate and up in
    ``w13[e]``, down in ``w2[e]`` (a column slice: not contiguous there)."""
    seg = torch.arange(n_experts * 3 * rows * cols, dtype=torch.float32).to(dtype)
    tensors, off = [], 0
    for _ in range(n_experts * 3):
        tensors.append(seg[off : off + rows * cols].view(rows, cols))
        off += rows * cols
    w13 = torch.zeros(n_experts, 2 * rows, cols, dtype=dtype)
    w2 = torch.zeros(n_experts, rows, 2 * cols, dtype=dtype)
    dst, src, dst_bases, src_bases = [], [], [], []
    for e in range(n_experts):
        gate, up, down = tensors[3 * e : 3 * e + 3]
        for view, base, t in (
            (w13[e, :rows], w13, gate),
            (w13[e, rows:], w13, up),
            (w2[e, :, cols:], w2, down),
        ):
            dst.append(view)
            dst_bases.append(base)
            src.append(t)
            src_bases.append(t)
    return seg, (w13, w2), dst, src, dst_bases, src_bases


def test_a_moe_layers_experts_become_a_few_copies_with_the_same_bytes():
    seg, params, dst, src, dst_bases, src_bases = _experts(64, 4, 8)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    assert program is not None and program.regions == 3 * 64
    # gate and up of each expert are back to back on both ends and their 64 runs lie
    # evenly: one strided copy; the downs (column slices of w2) lie evenly too: one more
    assert len(program.copies) == 2, [c.sizes for c in program.copies]
    expected = [torch.zeros_like(p) for p in params]
    write_regions(_views_like(dst, params, expected), src)
    assert program.run(dst_bases, src_bases)
    for got, want in zip(params, expected):
        assert torch.equal(got, want)


def _views_like(dst, params, others):
    """``dst``'s views, taken in ``others`` (tensors shaped as ``params``) instead."""
    out = []
    for v in dst:
        for p, o in zip(params, others):
            if v.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                out.append(o.as_strided(v.shape, v.stride(), v.storage_offset()))
    return out


def test_a_new_segment_laid_out_the_same_is_copied_by_the_same_program():
    """Each update maps its segment anew: other storage, same offsets."""
    seg, params, dst, src, dst_bases, src_bases = _experts(8, 2, 4)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    fresh = (seg + 1).clone()
    moved = [
        fresh.as_strided(t.shape, t.stride(), t.storage_offset()) for t in src_bases
    ]
    assert program.run(dst_bases, moved)
    w13, w2 = params
    assert torch.equal(w13[3, :2], moved[9]) and torch.equal(w13[3, 2:], moved[10])
    assert torch.equal(w2[3, :, 4:], moved[11])


def _fixed(src_bases):
    """``src_bases`` as a receiver hands them: by key, in a ``FixedShards``."""
    return FixedShards((f"t{i}", t) for i, t in enumerate(src_bases))


def test_the_same_fixed_shards_are_copied_without_their_tensors():
    """Sources handed as the ``FixedShards`` last found lying right need no look at each."""
    seg, params, dst, src, dst_bases, src_bases = _experts(8, 2, 4)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    shards = _fixed(src_bases)
    assert not program.keeps(shards), "nothing was found lying right yet"
    assert not program.run(dst_bases, None, shards), "no sources and none kept"
    assert program.run(dst_bases, list(shards.values()), shards)
    assert program.keeps(shards)
    assert not program.keeps(_fixed(src_bases)), "an equal mapping is not the same"
    assert not program.keeps(dict(shards)), "a plain dict is never kept"
    seg.add_(1)  # the next update's values, in the same segment
    assert program.run(dst_bases, None, shards)
    w13, w2 = params
    assert torch.equal(w13[3, :2], src_bases[9]) and torch.equal(
        w13[3, 2:], src_bases[10]
    )
    assert torch.equal(w2[3, :, 4:], src_bases[11])
    # the targets are still checked: one moved elsewhere refuses the program, and what it
    # kept is let go
    moved = list(dst_bases)
    moved[0] = w13.clone()
    assert not program.run(moved, list(shards.values()), shards)
    assert not program.keeps(shards)


def test_kept_sources_go_with_their_mapping():
    """A program keeps its sources weakly: the mapping let go, its segment goes."""
    seg, params, dst, src, dst_bases, src_bases = _experts(4, 2, 4)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    shards = _fixed(src_bases)
    assert program.run(dst_bases, list(shards.values()), shards)
    del shards, src_bases, src, seg
    assert program._kept is not None and program._kept[0]() is None
    assert not program.keeps(_fixed([torch.zeros(2, 4)] * 12))


def test_fixed_shards_are_read_only():
    shards = _fixed([torch.zeros(2)])
    for change in (
        lambda: shards.__setitem__("t1", torch.zeros(2)),
        lambda: shards.__delitem__("t0"),
        lambda: shards.update(t1=torch.zeros(2)),
        lambda: shards.pop("t0"),
        lambda: shards.popitem(),
        lambda: shards.setdefault("t1", torch.zeros(2)),
        shards.clear,
    ):
        try:
            change()
        except TypeError:
            continue
        raise AssertionError("a FixedShards changed")
    assert list(shards) == ["t0"]


def test_tensors_that_lie_otherwise_are_refused_and_nothing_is_copied():
    seg, params, dst, src, dst_bases, src_bases = _experts(4, 2, 4)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    before = [p.clone() for p in params]
    shifted = list(src_bases)
    shifted[5] = seg[1 : 1 + 8].view(2, 4)  # one shard one element further on
    assert not program.run(dst_bases, shifted)
    two = list(src_bases)
    two[7] = src_bases[7].clone()  # one shard in a storage of its own
    assert not program.run(dst_bases, two)
    assert not program.run(dst_bases[:-1], src_bases[:-1])
    for p, b in zip(params, before):
        assert torch.equal(p, b), "a refused program wrote"


def test_shards_each_in_a_storage_of_its_own_are_read_as_they_are():
    """A trainer rank's shards (each its own storage) packed into one send buffer in the
    engine's dtype: each copy reads its shard itself, no view of it, and a later update's
    shards (other storages, same shapes) are packed by the same program, cast exactly."""
    shapes = [(3, 4), (2, 4), (5,), (1, 4, 2)]

    def shards(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g) for s in shapes]

    flat = torch.zeros(sum(torch.Size(s).numel() for s in shapes), dtype=torch.bfloat16)
    dst, off = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        dst.append(flat[off : off + n].view(s))
        off += n
    first = shards(0)
    program = CopyProgram.compile(dst, first, [flat] * len(dst), first)
    assert program is not None
    assert [c.src_whole for c in program.copies] == [True] * len(shapes)
    later = shards(1)
    assert program.run([flat] * len(dst), later)
    assert torch.equal(flat, torch.cat([t.flatten() for t in later]).bfloat16())
    # a shard that is a view into a larger tensor is read through its view, not whole
    wide = torch.randn(4, 4)
    part = wide[1:3]
    inner = CopyProgram.compile(dst[1:2], [part], [flat], [wide])
    assert inner is not None and not inner.copies[0].src_whole
    assert inner.run([flat], [wide])
    assert torch.equal(dst[1], part.bfloat16())


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    length=st.integers(1, 6),
    src_gap=st.integers(0, 5),
    dst_gap=st.integers(0, 5),
    order=st.randoms(use_true_random=False),
    cast=st.booleans(),
)
def test_any_evenly_or_unevenly_spaced_regions_copy_exactly(
    n, length, src_gap, dst_gap, order, cast
):
    """Regions of ``length`` elements ``src_gap``/``dst_gap`` apart, in any order, some
    dropped: the program writes exactly what one copy per region writes."""
    src_base = torch.randn(n * (length + src_gap) + 3, dtype=torch.float32)
    dtype = torch.bfloat16 if cast else torch.float32
    dst_a = torch.zeros(n * (length + dst_gap) + 3, dtype=dtype)
    dst_b = dst_a.clone()
    idx = [i for i in range(n) if order.random() < 0.8]
    order.shuffle(idx)
    src = [src_base[i * (length + src_gap) :][:length] for i in idx]
    dst_views_a = [dst_a[i * (length + dst_gap) :][:length] for i in idx]
    dst_views_b = [dst_b[i * (length + dst_gap) :][:length] for i in idx]
    program = CopyProgram.compile(
        dst_views_a, src, [dst_a] * len(idx), [src_base] * len(idx)
    )
    assert program is not None
    assert program.run([dst_a] * len(idx), [src_base] * len(idx))
    write_regions(dst_views_b, src)
    assert torch.equal(dst_a, dst_b)
    assert len(program.copies) <= max(1, len(idx))


def test_same_dtype_copies_move_wider_elements_and_the_same_bytes():
    """A bf16 MoE layer's copies run as int64 copies (``wide``), 4 elements each; the
    bytes written are those of one copy per region, NaN payloads included."""
    seg, params, dst, src, dst_bases, src_bases = _experts(16, 4, 8)
    seg.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, seg.shape, dtype=torch.int16)
    )  # every bit pattern: NaNs with payloads, infs, subnormals
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    assert [c.wide for c in program.copies] == [torch.int64] * len(program.copies)
    expected = [torch.zeros_like(p) for p in params]
    write_regions(_views_like(dst, params, expected), src)
    assert program.run(dst_bases, src_bases)
    for got, want in zip(params, expected):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.uint8]),
    rows=st.integers(1, 5),
    cols=st.integers(1, 12),
    src_pitch=st.integers(0, 9),
    dst_pitch=st.integers(0, 9),
    src_at=st.integers(0, 9),
    dst_at=st.integers(0, 9),
    n=st.integers(1, 6),
)
def test_any_strided_same_dtype_regions_copy_byte_exactly(
    dtype, rows, cols, src_pitch, dst_pitch, src_at, dst_at, n
):
    """Row blocks ``rows`` x ``cols`` at any pitch and offset, ``n`` of them evenly
    apart on both ends: widened or not (whatever the alignment allows), the program
    writes exactly the bytes one copy per region writes."""
    sp, dp = cols + src_pitch, cols + dst_pitch
    whole = 8  # elements: each end's tensor views as int64 (when the copy allows it)
    src_len = -(-(n * rows * sp + src_at) // whole) * whole
    src_base = torch.randint(0, 256, (src_len * dtype.itemsize,))
    src_base = src_base.to(torch.uint8).view(dtype)
    dst_a = torch.zeros(-(-(n * rows * dp + dst_at + 3) // whole) * whole, dtype=dtype)
    dst_b = dst_a.clone()

    def blocks(base, at, pitch):
        return [
            base.as_strided((rows, cols), (pitch, 1), at + i * rows * pitch)
            for i in range(n)
        ]

    src = blocks(src_base, src_at, sp)
    program = CopyProgram.compile(
        blocks(dst_a, dst_at, dp), src, [dst_a] * n, [src_base] * n
    )
    assert program is not None
    if (dtype, cols % 4, src_pitch % 4, dst_pitch % 4, src_at % 4, dst_at % 4) == (
        torch.bfloat16,
        0,
        0,
        0,
        0,
        0,
    ):
        assert {c.wide for c in program.copies} == {torch.int64}
    assert program.run([dst_a] * n, [src_base] * n)
    write_regions(blocks(dst_b, dst_at, dp), src)
    assert torch.equal(dst_a.view(torch.uint8), dst_b.view(torch.uint8))


def test_tensors_met_at_several_regions_are_checked_however_they_repeat_now():
    """The program checks each end's distinct tensors a list at a time; when a tensor it
    met at several regions comes as several objects (a new view of the same parameter),
    each is checked on its own: same bytes laid out alike copy, others are refused."""
    seg, params, dst, src, dst_bases, src_bases = _experts(8, 2, 4)
    program = CopyProgram.compile(dst, src, dst_bases, src_bases)
    w13, w2 = params
    again = [
        w13.view(w13.shape) if b is w13 and i % 2 else b
        for i, b in enumerate(dst_bases)
    ]
    assert program.run(again, src_bases)
    assert torch.equal(w13[3, :2], src_bases[9]) and torch.equal(
        w2[3, :, 4:], src_bases[11]
    )
    before = [p.clone() for p in params]
    other = [
        torch.zeros_like(w13) if b is w13 and i == 3 else b
        for i, b in enumerate(dst_bases)
    ]
    assert not program.run(other, src_bases)
    for p, b in zip(params, before):
        assert torch.equal(p, b), "a refused program wrote"


def test_check_inputs_knows_the_fixed_shards_it_found_fine():
    """``executor.check_inputs`` looks at no shard of the ``FixedShards`` it found fine
    last time; one with a problem is looked at every time, and named every time."""
    from sglang.srt.weight_sync import executor
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    names = [f"e{i}" for i in range(3)]
    src = {n: MeshSpec.full((4, 3), torch.float32, [0]).describe(n) for n in names}
    pieces = tuple(
        Piece(n, Box((0, 0), (4, 3)), (i,), (0, 0)) for i, n in enumerate(names)
    )
    p = plan(src, {0: [ParamTarget("w", (3, 4, 3), torch.float32, pieces)]})
    params = {"w": torch.zeros(3, 4, 3)}
    shards = FixedShards((n, torch.ones(4, 3)) for n in names)
    assert executor.check_inputs(p, 0, shards, params) == []
    looked = []
    real = executor._check_shards, executor._all_fine
    try:
        executor._check_shards = lambda *a: looked.append("check") or real[0](*a)
        executor._all_fine = lambda *a: looked.append("fine") or real[1](*a)
        assert executor.check_inputs(p, 0, shards, params) == []
        assert looked == [], "the same FixedShards was looked at again"
        assert executor.check_inputs(p, 0, dict(shards), params) == []
        assert looked == ["fine"], "a plain dict is looked at, by identity per shard"
        looked.clear()
        bad = FixedShards(
            (n, torch.ones(2, 3) if n == "e1" else torch.ones(4, 3)) for n in names
        )
        for _ in range(2):
            problems = executor.check_inputs(p, 0, bad, params)
            assert len(problems) == 1 and "tensor 'e1'" in problems[0], problems
        assert looked.count("check") == 2, looked
    finally:
        executor._check_shards, executor._all_fine = real
