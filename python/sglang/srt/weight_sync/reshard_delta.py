"""Delta updates of the trainer-side hop: trainer ranks send each other only what changed.

In trainer-side mode (``trainer_reshard``) the trainer ranks exchange the pieces each needs
for the engine rank beside it, then hand that engine rank whole parameter-shaped buffers.
Where the trainer ranks sit on several hosts that exchange crosses a network, and one RL
step changes few of the engine's bf16 values. With delta updates each region crosses as
what changed since the last update (``delta_rounds``, ``delta_codec``'s records), and the
engine still receives whole buffers: its parameters are a full update's, whatever it held.

So the delta lives between two trainer ranks, and each keeps, in host memory, per chunk:

- ``sent``: the engine-dtype values (block-FP8: e4m3 bytes and scales) of every region it
  last sent another trainer rank, the base it encodes against (``Snapshot``);
- ``received``: its copy of every region it last received, the base it decodes against.

The protocol, per update (every trainer rank runs each step):

1. ``agree_on_inputs``' one all-reduce carries ``values`` and ``proposals``: whether the
   rank asks for deltas (all or none must), a digest of the update its bases are from and
   of the inputs they were planned for (0: none), and the highest update number it saw.
2. ``begin``: the update is a delta only when every rank holds bases of the same update and
   the same inputs; anything else (a new process, a rank whose last update failed, new
   layouts) makes it full on every rank, and the report says why. Every rank decides from
   the agreed values alone, so all run the same wire format.
3. ``run`` per chunk: a full update runs ``executor.execute`` (and ``run_quantized``) as
   without deltas and stages what it sent and received; a delta runs
   ``delta_rounds.execute_delta`` into the buffers, staging likewise.
4. ``commit`` when the update ended on this rank with the engine's success, else ``drop``:
   the next update's agreement then finds the ranks apart and goes full.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from sglang.srt.weight_sync.control_plane import Agreement
from sglang.srt.weight_sync.delta_rounds import (
    DeltaFigures,
    Snapshot,
    execute_delta,
    stage_full,
)
from sglang.srt.weight_sync.executor import (
    DataGroup,
    Deferred,
    ExecutionError,
    ExecutionStats,
    check_inputs,
    dest_region,
    execute,
    rank_rounds,
    write_landings,
    write_zero_fills,
)
from sglang.srt.weight_sync.fp8_sender import SenderFp8Plan
from sglang.srt.weight_sync.fp8_wire import QuantizedLanding, run_quantized
from sglang.srt.weight_sync.manifest import fingerprint_int
from sglang.srt.weight_sync.planner import Plan

__all__ = ("ReshardDelta", "agreement_values")

# the agreement's proposal (``agree_on_inputs``): the highest update number a rank saw
_NUMBER = "delta update"


def agreement_values(
    delta: Optional[ReshardDelta], inputs: str
) -> Tuple[Dict[str, int], Dict[str, int]]:
    """What this rank puts in the update's agreement (every rank the same names): whether
    it runs deltas, the digest of its bases (0: none, or bases for other ``inputs``), and
    the highest update number it saw."""
    if delta is None:
        return {"delta": 0, "delta base": 0}, {_NUMBER: 0}
    return {"delta": 1, "delta base": delta.base_value(inputs)}, {_NUMBER: delta.number}


@dataclass
class _Chunk:
    """One chunk's bases on this rank: what it sent and what it received."""

    sent: Snapshot
    received: Snapshot


class _Into(Deferred):
    """Writes each region into the buffers as it arrives (a trainer rank has no pause to
    wait for); keeps the sender-quantized blocks, which go to the engine as regions."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params
        self.landings: List[QuantizedLanding] = []

    def landed(self, landings) -> None:
        plain = [x for x in landings if not isinstance(x, QuantizedLanding)]
        self.landings += [x for x in landings if isinstance(x, QuantizedLanding)]
        if plain:
            write_landings(self.params, plain)


class ReshardDelta:
    """One trainer rank's bases for delta updates of the trainer-side hop, owned by its
    ``TrainerSync`` while its owner asks for deltas. ``digest``: before each delta every
    sender sends the digest of each base it encodes against and the receiver compares it
    with its copy (``delta_rounds``'s digest round): a base that differs refuses the update
    on that rank (``DeltaRefusal``) and the next update is full."""

    def __init__(self, digest: bool = False, device: str = "cpu") -> None:
        self.digest = digest
        self.device = device
        self.number = 0  # the highest update number this rank saw
        self.tag: Optional[int] = None  # the update its committed bases are from
        self.inputs: Optional[str] = None  # the inputs they were planned for
        self._planned: Optional[str] = None  # the running update's inputs (``begin``)
        self.why_full = "no update delivered yet"
        self._chunks: Dict[str, _Chunk] = {}
        self._running: Dict[str, _Chunk] = {}
        self.full = True  # the running update sends every region whole
        self.why = ""  # why it does ("" for a delta)
        self._figures = DeltaFigures()
        self._bytes = [0, 0, 0, 0]  # sent, sent by a full update, received, full

    def base_value(self, inputs: str) -> int:
        """This rank's bases as one agreement value (0: none for ``inputs``)."""
        if self.tag is None or self.inputs != inputs:
            return 0
        return max(1, fingerprint_int(_digest(f"{self.tag}:{self.inputs}")))

    def begin(self, agreed: Agreement, inputs: str) -> None:
        """Decide from the agreement whether this update is a delta (the same on every
        rank: see the module's text) and start it."""
        self.number = agreed.highest[_NUMBER] + 1
        if "delta base" in agreed.unequal:
            why = (
                "the trainer ranks hold bases of different updates (a rank is new, or "
                "its last update failed)"
            )
        elif self.tag is None:
            why = self.why_full
        elif self.inputs != inputs:
            why = "the layouts changed (sources, engines or chunks)"
        else:
            why = ""
        self.full, self.why, self._planned = bool(why), why, inputs
        if self.full:
            self._chunks = {}
        for chunk in self._chunks.values():  # an update that never ended staged these
            chunk.sent.unstage()
            chunk.received.unstage()
        self._running = {}
        self._figures = DeltaFigures()
        self._bytes = [0, 0, 0, 0]

    def run(
        self,
        plan: Plan,
        sender: Optional[SenderFp8Plan],
        rank: int,
        shards: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
        data: DataGroup,
        timeout_s: Optional[float],
        checked: bool = False,
    ) -> Tuple[ExecutionStats, List[QuantizedLanding]]:
        """One chunk (``plan``, with ``sender``'s quantized blocks into a block-FP8
        engine): ``params`` (this rank's buffers and staging) filled exactly as a full
        update fills them; the executor's figures and the quantized blocks received.
        ``checked``: as ``executor.execute``'s (else a shard that does not fit the plan
        raises ``ExecutionError`` on this rank)."""
        run = plan if sender is None else sender.plan
        problems = (
            [] if checked else check_inputs(run, rank, shards, params, data.device)
        )
        if problems:
            raise ExecutionError("; ".join(problems))
        chunk = self._chunks.get(run.fingerprint)
        if chunk is None or self.full:
            chunk = _Chunk(Snapshot(self.device), Snapshot(self.device))
        self._running[run.fingerprint] = chunk
        into = _Into(params)
        if self.full:
            stats = execute(run, rank, shards, params, data, timeout_s, checked=True)
            if sender is not None:
                run_quantized(sender, rank, shards, {}, data, timeout_s, into, stats)
            figures, _ = stage_full(run, rank, shards, chunk.sent, 0, sender, data=data)
        else:
            write_zero_fills(run, rank, params)
            stats, figures, _ = execute_delta(
                run,
                rank,
                shards,
                params,
                data,
                timeout_s,
                into,
                chunk.sent,
                0,
                self.digest,
                sender,
                received=chunk.received.regions,
            )
        t0 = time.perf_counter()
        _stage_received(run, rank, params, into.landings, chunk.received)
        figures.decode_us += int((time.perf_counter() - t0) * 1e6)
        self._add(figures, stats, _full_bytes(run, sender, rank))
        return stats, into.landings

    def commit(self) -> None:
        """The update ended on this rank and the engine applied it: what every chunk
        staged is the next update's bases, for the inputs ``begin`` was given."""
        for fingerprint, chunk in self._running.items():
            chunk.sent.commit(0, fingerprint)
            chunk.received.commit(0, fingerprint)
        self._chunks, self._running = self._running, {}
        self.tag, self.inputs = self.number, self._planned

    def drop(self, why: str) -> None:
        """The update did not end with the engine's success here: no bases, so the next
        agreement finds the ranks apart and the update is full on every rank."""
        self._chunks, self._running = {}, {}
        self.tag = self.inputs = None
        self.why_full = why

    @property
    def kept_bytes(self) -> int:
        """Host memory the bases take: the committed ones, or those the running update
        staged (what it keeps if it commits)."""
        chunks = self._running or self._chunks
        return sum(_nbytes(c.sent) + _nbytes(c.received) for c in chunks.values())

    def summary(self) -> Dict[str, object]:
        """What this rank's report says of the running update's delta (see
        ``UpdateReport.delta``)."""
        f = self._figures
        sent, sent_full, received, received_full = self._bytes
        return {
            "mode": "full" if self.full else "delta",
            "why_full": self.why,
            "digest_checked": self.digest and not self.full,
            "bytes_sent": sent,
            "full_bytes_sent": sent_full,
            "bytes_received": received,
            "full_bytes_received": received_full,
            "density": f.changed / f.elements if f.elements else 0.0,
            "density_by_class": {
                c: changed / total
                for c, (changed, total) in sorted(f.by_class.items())
                if total
            },
            "regions": {
                "full": f.regions_full,
                "delta": f.regions_delta,
                "unchanged": f.regions_unchanged,
            },
            "encode_seconds": f.encode_us / 1e6,
            "decode_seconds": f.decode_us / 1e6,
            "kept_bytes": self.kept_bytes,
        }

    def _add(
        self, figures: DeltaFigures, stats: ExecutionStats, full: Tuple[int, int]
    ) -> None:
        merged = [a + b for a, b in zip(self._figures.ints(), figures.ints())]
        self._figures = DeltaFigures.from_ints(merged)
        self._bytes[0] += stats.bytes_sent
        self._bytes[1] += full[0]
        self._bytes[2] += stats.bytes_received
        self._bytes[3] += full[1]


def _nbytes(snapshot: Snapshot) -> int:
    """A snapshot's regions with what is staged over them, in bytes."""
    regions = {**snapshot.regions, **snapshot.pending}
    return sum(t.numel() * t.element_size() for t in regions.values())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _stage_received(
    plan: Plan,
    rank: int,
    params: Mapping[str, torch.Tensor],
    quantized: List[QuantizedLanding],
    into: Snapshot,
) -> None:
    """Copy what this rank received from other ranks out of its buffers (and the
    sender-quantized blocks as received) into ``into``: the next delta's bases."""
    for mine in rank_rounds(plan, rank):
        for move in mine:
            if move.src == rank:
                continue
            for dest in move.dests:
                if dest.rank == rank:
                    into.stage(move, dest_region(params, dest, move))
                    break
    for x in quantized:
        if x.quantized.move.src != rank:
            into.stage_quantized(x.quantized, x.buf)


def _full_bytes(
    plan: Plan, sender: Optional[SenderFp8Plan], rank: int
) -> Tuple[int, int]:
    """What a full update of this chunk sends and receives on ``rank`` (between ranks)."""
    sent = received = 0
    for mine in rank_rounds(plan, rank):
        for move in mine:
            receivers = {d.rank for d in move.dests}
            if move.src == rank:
                sent += move.nbytes * len(receivers - {rank})
            elif rank in receivers:
                received += move.nbytes
    for q in (q for rnd in (sender.quantized if sender else ()) for q in rnd):
        receivers = {d.rank for d in q.move.dests}
        if q.move.src == rank:
            sent += q.nbytes * len(receivers - {rank})
        elif rank in receivers:
            received += q.nbytes
    return sent, received
