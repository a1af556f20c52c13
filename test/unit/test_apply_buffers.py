"""Apply's writes of many regions at once and its finite check (``weight_sync.apply``), and
the engine's checks and copies of trainer-side buffers when a fused parameter's HF tensors
arrive in different chunks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.weight_sync import apply
from sglang.srt.weight_sync.apply import nonfinite_tensors, write_regions

# isort: split
# pr: scale
from sglang.srt.weight_sync.apply import copy_buffers, nonfinite_buffers
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece, restrict

# pr: scale end

# pr: scale
# verl batches by HF tensor (``gate_proj`` in one bucket, ``up_proj`` in the next): the
# buffer has the parameter's full shape; only the pieces of this chunk were written, the
# rest is whatever ``torch.empty`` returned.
GATE_UP = ParamTarget(
    "model.layers.0.mlp.gate_up_proj.weight",
    (8, 4),
    torch.bfloat16,
    (
        Piece("model.layers.0.mlp.gate_proj.weight", Box((0, 0), (4, 4)), (), (0, 0)),
        Piece("model.layers.0.mlp.up_proj.weight", Box((0, 0), (4, 4)), (), (4, 0)),
    ),
)


def _up_only():
    """The chunk that carries ``up_proj`` only, its buffer's gate half never written."""
    [target] = restrict([GATE_UP], ["model.layers.0.mlp.up_proj.weight"], {})
    buffer = torch.full((8, 4), float("nan"), dtype=torch.bfloat16)
    buffer[4:] = torch.arange(16, dtype=torch.bfloat16).view(4, 4)
    return target, buffer


def test_unwritten_part_of_a_buffer_is_neither_checked_nor_copied():
    target, buffer = _up_only()
    assert nonfinite_buffers([target], {target.name: buffer}) == []
    param = torch.ones(8, 4, dtype=torch.bfloat16)
    assert copy_buffers({target.name: param}, [target], {target.name: buffer}) == 16 * 2
    assert torch.equal(
        param[:4], torch.ones(4, 4, dtype=torch.bfloat16)
    )  # gate half kept
    assert torch.equal(param[4:], buffer[4:])


def test_nan_or_inf_in_a_delivered_piece_is_found():
    target, buffer = _up_only()
    buffer[6, 1] = float("inf")
    assert nonfinite_buffers([target], {target.name: buffer}) == [target.name]


# pr: scale end
def test_many_regions_are_written_as_one_by_one_casts_would_write_them():
    """``write_regions`` (one multi-tensor copy) writes every region as ``copy_`` would:
    fp32 sources cast to a bf16 fused parameter's strided expert slices, a permuted view,
    and a region received in place left as it is."""
    g = torch.Generator().manual_seed(0)
    param = torch.zeros(7, 8, 4, dtype=torch.bfloat16)
    want = param.clone()
    views, srcs = [], []
    for e in range(6):
        src = torch.randn(4, 4, generator=g)
        views.append(param[e, 4 * (e % 2) : 4 * (e % 2) + 4])
        srcs.append(src)
        want[e, 4 * (e % 2) : 4 * (e % 2) + 4].copy_(src)
    t = torch.randn(4, 3, generator=g)
    views.append(param[6, :3].permute(1, 0))
    srcs.append(t)
    want[6, :3].permute(1, 0).copy_(t)
    in_place = param[5, 0]
    views.append(in_place)
    srcs.append(in_place)
    write_regions(views, srcs)
    assert torch.equal(param, want)


BAD = (float("nan"), float("inf"), float("-inf"))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(
        [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    ),
    sizes=st.lists(st.integers(1, 10000), min_size=1, max_size=12),
    shared=st.booleans(),
    huge=st.booleans(),
    bad=st.lists(st.tuples(st.integers(0, 11), st.floats(0, 1), st.sampled_from(BAD))),
    chunk=st.sampled_from([1, 3000, 1 << 20]),
)
def test_finite_check_names_exactly_the_tensors_holding_nan_or_inf(
    dtype, sizes, shared, huge, bad, chunk
):
    """``nonfinite_tensors`` over tensors small and large (below ``apply._SMALL_RUN``
    elements joined into chunks of ``apply._CHUNK``, each chunk reduced once; one
    reduction each above it), alone or back to back in one storage (read as one run), with
    values whose sums overflow the dtype: it names exactly the tensors holding NaN or inf,
    whatever the chunks' size."""
    kept, apply._CHUNK = apply._CHUNK, chunk
    try:
        check_finite_names(dtype, sizes, shared, huge, bad)
    finally:
        apply._CHUNK = kept


def check_finite_names(dtype, sizes, shared, huge, bad):
    fill = torch.finfo(dtype).max / 2 if huge else 1.0
    if shared:  # views of one storage, back to back: one run
        flat = torch.full((sum(sizes),), fill, dtype=dtype)
        tensors = list(flat.split(sizes))
    else:
        tensors = [torch.full((n,), fill, dtype=dtype) for n in sizes]
    for which, where, value in bad:
        if which < len(tensors):
            t = tensors[which]
            t[min(int(where * t.numel()), t.numel() - 1)] = value
    named = {f"t{i}": t for i, t in enumerate(tensors)}
    expected = [k for k, t in named.items() if not bool(torch.isfinite(t).all())]
    assert nonfinite_tensors(named) == expected
