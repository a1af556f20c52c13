"""Plan: which 128-blocks of block-FP8 weights their sender quantizes, and what then travels.

A block can be quantized wherever all its elements meet (``fp8_quant``: each block depends
on its own elements only). Where the plan sends a region of an HF tensor that holds whole
blocks from one trainer rank to an engine rank's staged FP8 weight (``fp8_targets``), the
sender can quantize those blocks itself: the wire then carries one e4m3 byte per element
and one float32 scale per block instead of two bf16 bytes per element, and the receiver
writes both straight into its e4m3 weight and ``weight_scale_inv``. Every other element
still travels in the staged dtype and is quantized on the engine rank once its block met
in staging (``apply.write_quantized``). The result is the same bits either way.

``sender_quantized`` is a pure function of the plan: each move into a staged FP8 weight is
cut into the largest box of whole blocks it carries (``whole_blocks``, a ``QuantizedMove``,
in the same round) and the rest (at most four boxes, moves in the staged dtype). What a
receiver still quantizes is ``SenderFp8Plan.engine_targets``: its staged targets' pieces
without the blocks that came quantized. ``quantize_for_wire`` and ``land_quantized`` are
the two ends of one quantized move (one uint8 buffer: the e4m3 bytes, then the scales).

A bucket split (``planner._split``) that cuts a block leaves that block to the receiver:
the bytes are then above the quantized lower bound by those blocks' difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.fp8_quant import BLOCK, FP8_DTYPE, quantize_block_fp8
from sglang.srt.weight_sync.fp8_targets import SCALE_SUFFIX, QuantizedParam
from sglang.srt.weight_sync.planner import Move, Plan
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

__all__ = (
    "QuantizedMove",
    "SenderFp8Plan",
    "land_box",
    "land_quantized",
    "left_to_quantize",
    "quantize_for_wire",
    "read_quantized",
    "sender_quantized",
    "whole_blocks",
)

SCALE_BYTES = 4  # one float32 weight_scale_inv per block


def whole_blocks(
    region: Box, full: Sequence[int], block: Tuple[int, int] = BLOCK
) -> Optional[Box]:
    """The largest box of whole ``block``s of an HF tensor of shape ``full`` inside
    ``region`` (last two dims; a ragged last block counts when ``region`` reaches the
    tensor's end), None when there is none."""
    offsets, sizes = list(region.offsets), list(region.sizes)
    for d, b in zip((-2, -1), block):
        lo = -(-region.offsets[d] // b) * b
        end = region.ends[d]
        hi = end if end == full[d] else end // b * b
        if hi <= lo:
            return None
        offsets[d], sizes[d] = lo, hi - lo
    return Box(tuple(offsets), tuple(sizes))


def _grid(
    box: Box, block: Tuple[int, int]
) -> Tuple[Tuple[int, ...], Tuple[slice, ...]]:
    """The block grid of ``box`` (whole blocks): its shape, and its slices of the scale."""
    lead = box.slices()[:-2]
    spans = [
        (o // b, -(-e // b)) for o, e, b in zip(box.offsets[-2:], box.ends[-2:], block)
    ]
    shape = tuple(box.sizes[:-2]) + tuple(e - o for o, e in spans)
    return shape, lead + tuple(slice(o, e) for o, e in spans)


@dataclass(frozen=True, slots=True)
class QuantizedMove:
    """Whole blocks of one HF tensor that their sender quantizes: ``move`` (its region is
    whole blocks; every dest a staged block-FP8 weight, written as e4m3 with its scale)."""

    move: Move
    block: Tuple[int, int] = BLOCK

    @property
    def blocks(self) -> int:
        return prod(_grid(self.move.region, self.block)[0])

    @property
    def nbytes(self) -> int:
        """What travels: one e4m3 byte per element, one float32 scale per block."""
        return self.move.region.numel + SCALE_BYTES * self.blocks


@dataclass(frozen=True)
class SenderFp8Plan:
    """``plan`` with the blocks its senders quantize cut out of its moves (what is left
    travels in the staged dtype, in the same rounds) and those blocks, round by round
    (``quantized[i]`` travels in round i; ``local`` are a rank's own: copied, not sent)."""

    plan: Plan
    quantized: Tuple[Tuple[QuantizedMove, ...], ...]
    local: Tuple[QuantizedMove, ...]

    def received_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives: the staged dtype's moves and the quantized blocks."""
        return self.plan.received_bytes(rank) + sum(
            q.nbytes
            for rnd in self.quantized
            for q in rnd
            for d in q.move.dests
            if d.rank == rank
        )

    def lower_bound_bytes(self, rank: int) -> int:
        """The least ``rank`` receives with the blocks this plan's moves carry whole sent
        quantized: the plan's lower bound less, per block-FP8 region received quantized, its
        staged bytes over its e4m3 bytes and scales. A bucket split that cuts a block leaves
        it in the staged dtype, here as on the wire."""
        saved = sum(
            q.move.nbytes - q.nbytes
            for rnd in self.quantized
            for q in rnd
            for d in q.move.dests
            if d.rank == rank
        )
        return self.plan.lower_bound_bytes(rank) - saved

    def sent_bytes(self, rank: int) -> int:
        """Bytes ``rank`` sends (one copy per receiver)."""
        moves = [(m.nbytes, m) for rnd in self.plan.rounds for m in rnd] + [
            (q.nbytes, q.move) for rnd in self.quantized for q in rnd
        ]
        return sum(n * len(m.dests) for n, m in moves if m.src == rank)

    def engine_targets(
        self, targets: Sequence[ParamTarget], rank: int
    ) -> List[ParamTarget]:
        """``rank``'s staged FP8 ``targets`` with only the pieces it still quantizes: each
        piece less the blocks that came quantized (whole blocks, so what is left is too)."""
        cut: Dict[Tuple[str, str], List[Box]] = {}
        moves = [q.move for rnd in self.quantized for q in rnd] + [
            q.move for q in self.local
        ]
        for m in moves:
            for d in m.dests:
                if d.rank == rank:
                    cut.setdefault((d.param, m.tensor), []).append(m.region)
        out = []
        for t in targets:
            pieces: List[Piece] = []
            for p in t.pieces:
                left = [p.box]
                for region in cut.get((t.name, p.tensor), ()):
                    left = [rest for box in left for rest in box.subtract(region)]
                pieces += [_sub_piece(p, box) for box in left]
            if pieces:
                out.append(dataclasses.replace(t, pieces=tuple(pieces)))
        return out


def _sub_piece(piece: Piece, box: Box) -> Piece:
    """The part of ``piece`` (not permuted) that carries ``box`` of its HF tensor."""
    offsets = tuple(
        o + (b - s) for o, b, s in zip(piece.offsets, box.offsets, piece.box.offsets)
    )
    return dataclasses.replace(piece, box=box, offsets=offsets)


def sender_quantized(
    plan: Plan,
    quantized: Mapping[int, Sequence[QuantizedParam]],
    shapes: Mapping[str, Tuple[int, ...]],
) -> SenderFp8Plan:
    """Cut the whole blocks out of ``plan``'s moves into staged block-FP8 weights
    (``quantized``: each engine rank's ``fp8_targets.QuantizedParam``s; ``shapes``: the HF
    tensors'). A move qualifies when every dest is such a weight, not permuted, with one
    block size. Pure: the same inputs give the same plan on every rank."""
    blocks = {(rank, q.weight): q.block for rank, qs in quantized.items() for q in qs}

    def cut(m: Move) -> Tuple[Optional[QuantizedMove], List[Move]]:
        sizes = {blocks.get((d.rank, d.param)) for d in m.dests}
        block = sizes.pop() if len(sizes) == 1 else None
        if block is None or any(d.perm is not None for d in m.dests):
            return None, [m]
        inner = whole_blocks(m.region, shapes[m.tensor], block)
        if inner is None:
            return None, [m]
        rest = [dataclasses.replace(m, region=box) for box in m.region.subtract(inner)]
        return QuantizedMove(dataclasses.replace(m, region=inner), block), rest

    rounds, sent = [], []
    for rnd in plan.rounds:
        kept, done = [], []
        for m in rnd:
            q, rest = cut(m)
            kept += rest
            if q is not None:
                done.append(q)
        rounds.append(tuple(kept))
        sent.append(tuple(done))
    local_kept, local_done = [], []
    for m in plan.local:
        q, rest = cut(m)
        local_kept += rest
        if q is not None:
            local_done.append(q)
    fingerprint = hashlib.sha256(f"{plan.fingerprint}/fp8-sender".encode()).hexdigest()
    cut_plan = dataclasses.replace(
        plan, rounds=tuple(rounds), local=tuple(local_kept), fingerprint=fingerprint
    )
    return SenderFp8Plan(cut_plan, tuple(sent), tuple(local_done))


def quantize_for_wire(
    region: torch.Tensor, block: Tuple[int, int] = BLOCK
) -> torch.Tensor:
    """The sender's end: ``region`` (whole blocks, ``[..., n, k]``) quantized by the
    reference quantizer into one uint8 buffer, its e4m3 bytes then its float32 scales."""
    matrices = region.reshape(-1, *region.shape[-2:])
    qs, scales = zip(*(quantize_block_fp8(x, block) for x in matrices))
    return torch.cat(
        [torch.stack(qs).view(torch.uint8).reshape(-1)]
        + [torch.stack(scales).view(torch.uint8).reshape(-1)]
    )


def land_quantized(
    q: QuantizedMove, buf: torch.Tensor, rank: int, params: Mapping[str, torch.Tensor]
) -> int:
    """The receiver's end: write ``buf`` (``quantize_for_wire``'s) into each of ``rank``'s
    e4m3 weights and scales that ``q`` lands in, in place; the e4m3 bytes written."""
    written = 0
    for d in q.move.dests:
        if d.rank != rank:
            continue
        written += land_box(
            buf,
            params[d.param],
            params[d.param + SCALE_SUFFIX],
            d.index,
            d.box(q.move.region),
            q.block,
        )
    return written


def read_quantized(
    q: QuantizedMove, rank: int, params: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``land_quantized`` read backwards: what ``rank``'s first e4m3 weight and scales that
    ``q`` lands in hold now, as one uint8 buffer in ``quantize_for_wire``'s order (a delta
    of quantized blocks applies to it). ``KeyError`` when ``params`` lacks one of them."""
    d = next(d for d in q.move.dests if d.rank == rank)
    box = d.box(q.move.region)
    weight = params[d.param][d.index][box.slices()]
    scales = params[d.param + SCALE_SUFFIX][d.index][_grid(box, q.block)[1]]
    return torch.cat(
        [
            weight.contiguous().view(torch.uint8).reshape(-1),
            scales.contiguous().view(torch.uint8).reshape(-1),
        ]
    )


def land_box(
    buf: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    index: Tuple[int, ...],
    box: Box,
    block: Tuple[int, int] = BLOCK,
) -> int:
    """Write ``buf`` (``quantize_for_wire``'s bytes of the whole blocks ``box`` of
    ``weight[index]``) into the e4m3 ``weight`` and its float32 block ``scale``, in place;
    the e4m3 bytes written."""
    numel = box.numel
    grid, slices = _grid(box, block)
    weight[index][box.slices()].copy_(buf[:numel].view(FP8_DTYPE).reshape(box.sizes))
    scale[index][slices].copy_(buf[numel:].view(torch.float32).reshape(grid))
    return numel


def left_to_quantize(
    target: ParamTarget, landed: Sequence[Tuple[Tuple[int, ...], Box]]
) -> Tuple[Piece, ...]:
    """``target``'s pieces less the ``landed`` (index, box of the parameter) that came
    quantized: what its receiver still quantizes from staging (whole blocks, as both are)."""
    pieces: List[Piece] = []
    for p in target.pieces:
        if p.perm is not None:  # never sent quantized (``sender_quantized``)
            pieces.append(p)
            continue
        dest = p.dest_box()
        left = [dest]
        for index, box in landed:
            if index == p.index:
                left = [rest for b in left for rest in b.subtract(box)]
        if left == [dest]:
            pieces.append(p)
            continue
        for b in left:
            hf = Box(
                tuple(
                    o + (x - d)
                    for o, x, d in zip(p.box.offsets, b.offsets, dest.offsets)
                ),
                b.sizes,
            )
            pieces.append(_sub_piece(p, hf))
    return tuple(pieces)
