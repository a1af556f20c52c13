"""Execute: the blocks a sender quantizes (``fp8_sender``), over the executor's payload exchange.

``fp8_sender.sender_quantized`` cuts the whole blocks out of a plan's moves into staged
block-FP8 weights; the executor runs what is left (``executor.execute``) and this runs the
cut blocks, round by round in the plan's order (a subsequence of the rounds every rank
runs): each sender quantizes the regions of its ``QuantizedMove``s of the round with the
reference quantizer (``quantize_for_wire``: e4m3 bytes then float32 scales, from the
region cast to the staged dtype, as the receiver would have quantized it) and sends each
receiver one uint8 buffer, those moves' buffers in round order (``executor.
exchange_payloads``); the receiver cuts it back into moves and lands each straight into
its e4m3 weight and ``weight_scale_inv`` (``land_quantized``), or hands it to its owner
(``QuantizedLanding``, an engine that writes in a pause). Both ends know every size from
the plan; a payload of another size is refused by name.

Which engine weights are block FP8, and their blocks, every member knows alike
(``quantized_targets``): every member derives the same cut.

A colocated engine rank resharding among the engine ranks (``engine_update``) runs its
part through ``ColocatedFp8``: the cut plan into bf16 staging of only the weights with
blocks left, the quantized blocks landed straight into the e4m3 weights and scales, then
the blocks left quantized from staging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.apply import write_quantized
from sglang.srt.weight_sync.executor import (
    DataGroup,
    Deferred,
    ExecutionError,
    ExecutionStats,
    check_inputs,
    exchange_round,
    execute,
    source_region,
)
from sglang.srt.weight_sync.fp8_sender import (
    QuantizedMove,
    SenderFp8Plan,
    land_quantized,
    quantize_for_wire,
    sender_quantized,
)
from sglang.srt.weight_sync.fp8_targets import (
    SCALE_SUFFIX,
    QuantizedParam,
    staging_buffers,
)
from sglang.srt.weight_sync.planner import Plan
from sglang.srt.weight_sync.target_layout import ParamTarget

# isort: split
# pr: scale
from sglang.srt.weight_sync.manifest import EngineManifest

# pr: scale end

__all__ = (
    "ColocatedFp8",
    "QuantizedLanding",
    # pr: scale
    "cut_for_engines",
    "cut_for_groups",
    "quantized_of",
    # pr: scale end
    "quantized_targets",
    "run_quantized",
)


@dataclass(frozen=True)
class QuantizedLanding:
    """Blocks received quantized (``buf``: ``quantize_for_wire``'s bytes of ``quantized``)
    for ``rank``, kept by an owner that writes later (``land_quantized`` then)."""

    buf: torch.Tensor
    quantized: QuantizedMove
    rank: int

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    @property
    def scales(self) -> torch.Tensor:
        """The float32 scales it carries (non-finite where the sender's values were)."""
        return self.buf[self.quantized.move.region.numel :].view(torch.float32)

    def land(self, params: Mapping[str, torch.Tensor]) -> int:
        """Write it into ``params`` (e4m3 weights and their scales); the bytes it held."""
        land_quantized(self.quantized, self.buf, self.rank, params)
        return self.nbytes


def quantized_targets(
    targets: Sequence[ParamTarget], blocks: Mapping[str, Tuple[int, int]]
) -> Tuple[QuantizedParam, ...]:
    """The block-FP8 weights of one TP rank's ``targets`` (staged dtypes), by ``blocks``
    (block-FP8 weight -> its block: the same names on every TP rank): each staged target
    of such a name, with its block."""
    return tuple(
        QuantizedParam(t.name, t.name + SCALE_SUFFIX, t.shape, block, t.dtype)
        for t in targets
        for block in (blocks.get(t.name),)
        if block is not None
    )


# pr: scale
def quantized_of(manifest: EngineManifest, tp_rank: int) -> Tuple[QuantizedParam, ...]:
    """TP rank ``tp_rank``'s block-FP8 weights as its manifest says (``block_fp8``): each
    staged target of that name, with its block."""
    return quantized_targets(manifest.ranks[tp_rank], manifest.block_fp8)


def cut_for_engines(
    plan: Plan,
    engines: Sequence[Tuple[EngineManifest, int]],
    shapes: Mapping[str, Tuple[int, ...]],
) -> Optional[SenderFp8Plan]:
    """``plan`` cut for sender quantization (``sender_quantized``) given every engine's
    manifest and first group rank (``engines``) and the HF tensors' ``shapes``; None when
    no engine has a block-FP8 weight (the plan runs as it is)."""
    quantized: Dict[int, Tuple[QuantizedParam, ...]] = {}
    for manifest, offset in engines:
        if not manifest.block_fp8:
            continue
        for t in range(manifest.parallel.tp_size):
            quantized[offset + t] = quantized_of(manifest, t)
    if not quantized:
        return None
    return sender_quantized(plan, quantized, shapes)


def cut_for_groups(
    plan: Plan,
    manifest: EngineManifest,
    groups: Sequence[Sequence[int]],
    shapes: Mapping[str, Tuple[int, ...]],
) -> Optional[SenderFp8Plan]:
    """``cut_for_engines`` where one engine's TP ranks are received for by any ranks:
    ``groups[j][t]`` needs what TP rank t needs (trainer-side resharding: the trainer rank
    beside each engine rank); None when the engine has no block-FP8 weight."""
    if not manifest.block_fp8:
        return None
    quantized = {
        rank: quantized_of(manifest, t) for g in groups for t, rank in enumerate(g)
    }
    return sender_quantized(plan, quantized, shapes)


# pr: scale end
@dataclass(frozen=True)
class ColocatedFp8:
    """One colocated engine rank's block-FP8 weights in an update resharded among the engine
    ranks: the plan cut for sender quantization (``sender``), the rank's block-FP8 weights
    (``quantized``), the pieces it still quantizes (``left``: blocks no sending rank held
    whole), their bf16 staging (``staged``: only the weights with such pieces) and the live
    e4m3 weights and scales (``fp8_params``). Made before the ranks agree (``of``), run
    after the commit (``run``, then ``quantize_left``)."""

    sender: SenderFp8Plan
    quantized: Tuple[QuantizedParam, ...]
    left: Tuple[ParamTarget, ...]
    staged: Mapping[str, torch.Tensor]
    fp8_params: Mapping[str, torch.Tensor]

    @classmethod
    def of(
        cls,
        sender: SenderFp8Plan,
        rank: int,
        quantized: Sequence[QuantizedParam],
        targets: Sequence[ParamTarget],
        fp8_params: Mapping[str, torch.Tensor],
        device: torch.device,
    ) -> ColocatedFp8:
        """``rank``'s part of ``sender`` given its block-FP8 weights, this update's
        ``targets`` of them (pieces in HF boxes) and its live e4m3 weights and scales."""
        names = {q.weight for q in quantized}
        left = tuple(
            sender.engine_targets([t for t in targets if t.name in names], rank)
        )
        staged_names = {t.name for t in left}
        staged = staging_buffers(
            [q for q in quantized if q.weight in staged_names], device
        )
        return cls(sender, tuple(quantized), left, staged, dict(fp8_params))

    def destinations(
        self, params: Mapping[str, torch.Tensor]
    ) -> Dict[str, torch.Tensor]:
        """What the cut plan writes: ``params`` without the e4m3 weights (a bf16 move into
        one without staging would be a missing parameter, refused by ``check``), plus the
        staging."""
        names = {q.weight for q in self.quantized}
        kept = {n: p for n, p in params.items() if n not in names}
        return {**kept, **self.staged}

    def check(
        self,
        plan: Plan,
        rank: int,
        shards: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> List[str]:
        """``executor.check_inputs`` for both parts: every shard the uncut ``plan`` reads
        (the quantized blocks' too), every region the cut plan writes."""
        return sorted(
            set(check_inputs(plan, rank, shards, None))
            | set(check_inputs(self.sender.plan, rank, shards, params))
        )

    def run(
        self,
        rank: int,
        shards: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
        data: Optional[DataGroup],
        timeout_s: Optional[float],
        checked: bool = False,
    ) -> ExecutionStats:
        """The cut plan into ``params`` (``destinations``), then the quantized blocks
        (``run_quantized``: sent e4m3 and scales, landed in place; a rank's own quantized
        where they lie). Every engine rank calls it together."""
        data = data if data is not None else DataGroup(None)
        stats = execute(
            self.sender.plan,
            rank,
            shards,
            params,
            group=data,
            timeout_s=timeout_s,
            checked=checked,
        )
        run_quantized(
            self.sender, rank, shards, self.fp8_params, data, timeout_s, None, stats
        )
        return stats

    def quantize_left(self) -> int:
        """Quantize the blocks left (met in staging) in place; the e4m3 bytes written."""
        return write_quantized(self.quantized, self.left, self.staged, self.fp8_params)


def run_quantized(
    sender: SenderFp8Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    data: DataGroup,
    timeout_s: Optional[float],
    deferred: Optional[Deferred],
    stats: ExecutionStats,
) -> None:
    """``rank``'s part of ``sender``'s quantized blocks (after ``execute`` ran its plan, every
    rank together): quantize and send what it holds, receive and land what it needs
    (``params``: its e4m3 weights and scales; with ``deferred``: handed over as
    ``QuantizedLanding``s instead). Adds the bytes and operations to ``stats``."""
    phase = f"rank {rank}: sender-quantized blocks"
    # a pair whose every move of the plan came quantized has not met yet: NCCL connects a
    # pair in its first batch, blocking the host, so connect it here, bounded (``connect``)
    data.connect(
        [[q.move for q in rnd] for rnd in sender.quantized], rank, timeout_s, phase
    )
    local = [q for q in sender.local if q.move.src == rank]
    if local:
        _hand(
            [
                QuantizedLanding(_quantize(shards, q, data.device), q, rank)
                for q in local
            ],
            params,
            deferred,
        )
    for number, moves in enumerate(sender.quantized, 1):
        sends = [q for q in moves if q.move.src == rank]
        recvs = [q for q in moves if any(d.rank == rank for d in q.move.dests)]
        if not sends and not recvs:
            continue
        t0 = time.perf_counter()
        outgoing = _payloads(sends, shards, data.device)
        stats.copy_seconds += time.perf_counter() - t0
        if deferred is not None and recvs:
            deferred.reserve(sum(q.nbytes for q in recvs))
        senders = sorted({q.move.src for q in recvs})
        got = exchange_round(
            data, rank, outgoing, senders, timeout_s, f"{phase}, round {number}", stats
        )
        landings: List[QuantizedLanding] = []
        for src, raw in sorted(got.items()):
            landings += _split(raw, [q for q in recvs if q.move.src == src], rank, src)
        _hand(landings, params, deferred)


def _quantize(shards, q: QuantizedMove, device: torch.device) -> torch.Tensor:
    """The sender's end of ``q``: its region, cast to the staged dtype, quantized."""
    region = source_region(shards, q.move).to(device=device, dtype=q.move.dtype)
    return quantize_for_wire(region, q.block)


def _payloads(
    sends: Sequence[QuantizedMove], shards, device: torch.device
) -> Dict[int, torch.Tensor]:
    """Receiver -> one buffer: its moves' quantized regions in round order (a region that
    several ranks need is quantized once)."""
    per: Dict[int, List[torch.Tensor]] = {}
    for q in sends:
        buf = _quantize(shards, q, device)
        for receiver in dict.fromkeys(d.rank for d in q.move.dests):
            per.setdefault(receiver, []).append(buf)
    return {r: torch.cat(bufs) for r, bufs in per.items()}


def _split(
    raw: torch.Tensor, moves: Sequence[QuantizedMove], rank: int, src: int
) -> List[QuantizedLanding]:
    """``raw`` from ``src`` cut back into its moves (the same order as the sender's)."""
    want = sum(q.nbytes for q in moves)
    if raw.numel() != want:
        raise ExecutionError(
            f"rank {rank}: sender-quantized blocks from rank {src}: {raw.numel()} bytes, the "
            f"plan expects {want} (tensors {sorted({q.move.tensor for q in moves})[:4]})"
        )
    out, offset = [], 0
    for q in moves:
        out.append(QuantizedLanding(raw[offset : offset + q.nbytes], q, rank))
        offset += q.nbytes
    return out


def _hand(
    landings: List[QuantizedLanding],
    params: Mapping[str, torch.Tensor],
    deferred: Optional[Deferred],
) -> None:
    """Land now, or hand to the owner that writes later."""
    if not landings:
        return
    if deferred is not None:
        deferred.landed(landings)
        return
    for x in landings:
        x.land(params)
