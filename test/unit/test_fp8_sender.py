"""``fp8_sender``: the whole blocks a move carries, the two ends of a quantized move, and
what the receiver still quantizes. The full flow against SGLang's load is in
``test/distributed/test_fp8_update.py``."""

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.fp8_quant import quantize_block_fp8
from sglang.srt.weight_sync.fp8_sender import (
    QuantizedMove,
    SenderFp8Plan,
    land_quantized,
    quantize_for_wire,
    read_quantized,
    whole_blocks,
)
from sglang.srt.weight_sync.planner import Dest, Move
from sglang.srt.weight_sync.source_layout import MeshSpec
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece


def test_whole_blocks_inside_a_region():
    full = (300, 256)
    # rows 86:300 of a 300-row tensor: blocks start at 128; the ragged last block counts
    assert whole_blocks(Box((86, 0), (214, 256)), full) == Box((128, 0), (172, 256))
    # rows 0:171: one whole block row
    assert whole_blocks(Box((0, 0), (171, 256)), full) == Box((0, 0), (128, 256))
    # rows 86:172: no whole block
    assert whole_blocks(Box((86, 0), (86, 256)), full) is None
    # columns cut too; leading (expert) dims kept
    assert whole_blocks(Box((3, 0, 10), (2, 256, 246)), (8, 256, 256)) == Box(
        (3, 0, 128), (2, 256, 128)
    )


def _move(region: Box, shape, delta=(0, 0)) -> Move:
    holder = MeshSpec.full(shape, torch.bfloat16, [0]).describe("w").holders[0]
    dest = Dest(1, "p.weight", (), delta, shape)
    return Move("w", region, holder, torch.bfloat16, torch.bfloat16, (dest,))


def test_a_quantized_move_lands_the_reference_quantizers_bits():
    """Sender and receiver ends of a quantized move: one uint8 buffer of the region's
    e4m3 bytes and its scales, landed at the move's place in the weight and scale grid."""
    x = torch.randn(384, 300, generator=torch.Generator().manual_seed(0)) * 0.02
    x = x.to(torch.bfloat16)
    q = QuantizedMove(_move(Box((128, 0), (256, 300)), (384, 300)))
    assert q.blocks == 2 * 3 and q.nbytes == 256 * 300 + 4 * 6
    buf = quantize_for_wire(x[128:384])
    assert buf.dtype == torch.uint8 and buf.numel() == q.nbytes
    weight = torch.zeros(384, 300, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(3, 3)
    assert land_quantized(q, buf, 1, {"p.weight": weight, "p.weight_scale_inv": scale})
    ref_q, ref_s = quantize_block_fp8(x)
    assert torch.equal(weight[128:].view(torch.uint8), ref_q[128:].view(torch.uint8))
    assert torch.equal(scale[1:], ref_s[1:]) and not scale[0].any()
    # read back (the base a delta of quantized blocks applies to): the same bytes
    params = {"p.weight": weight, "p.weight_scale_inv": scale}
    assert torch.equal(read_quantized(q, 1, params), buf)
    moved = QuantizedMove(_move(Box((0, 0), (256, 300)), (384, 300), (128, 0)))
    assert torch.equal(read_quantized(moved, 1, params), buf)  # its dest's place
    scale[2, 1] = 7.0  # a scale changed behind the sender's back is read as it is now
    got = read_quantized(q, 1, params)
    at = 256 * 300 + 4 * (1 * 3 + 1)
    assert torch.equal(got[at : at + 4].view(torch.float32), torch.tensor([7.0]))
    assert torch.equal(got[:at], buf[:at]) and torch.equal(got[at + 4 :], buf[at + 4 :])


def test_the_receiver_quantizes_the_pieces_less_what_came_quantized():
    piece = Piece("w", Box((0, 0), (512, 256)), (), (128, 0))
    target = ParamTarget("p.weight", (640, 256), torch.bfloat16, (piece,))
    came = QuantizedMove(_move(Box((0, 0), (128, 256)), (640, 256), (128, 0)))
    late = QuantizedMove(_move(Box((384, 0), (128, 256)), (640, 256), (128, 0)))
    sender = SenderFp8Plan(None, ((came,), (late,)), ())
    (left,) = sender.engine_targets([target], 1)
    assert [(p.box, p.offsets) for p in left.pieces] == [
        (Box((128, 0), (256, 256)), (256, 0))
    ]
    assert sender.engine_targets([target], 2) == [target]  # nothing came to rank 2


def test_quantized_blocks_on_the_wire_are_sized_and_checked_by_the_receiver():
    """``fp8_wire``: a payload is cut back into its moves by the sizes both ends plan (another
    size refused, naming the sender), and a NaN in a sender's block reaches the engine's
    staging as a non-finite scale, which refuses the update before any write."""
    import pytest

    from sglang.srt.weight_sync.executor import ExecutionError
    from sglang.srt.weight_sync.fp8_wire import QuantizedLanding, _split
    from sglang.srt.weight_sync.remote.engine import Staging

    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    q = QuantizedMove(_move(Box((0, 0), (128, 256)), (256, 256)))
    r = QuantizedMove(_move(Box((128, 0), (128, 256)), (256, 256)))
    raw = torch.cat([quantize_for_wire(x[:128]), quantize_for_wire(x[128:])])
    first, second = _split(raw, [q, r], 1, 0)
    assert first.quantized is q and torch.equal(first.buf, raw[: q.nbytes])
    assert second.nbytes == r.nbytes
    with pytest.raises(
        ExecutionError, match="from rank 0: 65551 bytes, the plan expects 65552"
    ):
        _split(raw[:-1], [q, r], 1, 0)
    staging = Staging(1 << 20, 1.0, "engine rank 1")
    staging.landed([first])
    assert not staging.nonfinite
    x[5, 200] = float("nan")
    staging.landed([QuantizedLanding(quantize_for_wire(x[:128]), q, 1)])
    assert staging.nonfinite and staging.held == 2 * q.nbytes
