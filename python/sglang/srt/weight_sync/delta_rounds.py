"""A delta update's rounds: each region sent as what changed since the last update, exactly.

Used by the weight-sync group of remote engines (``remote.group``: trainer ranks send,
engine ranks receive) and by the trainer-side hop between trainer ranks
(``reshard_delta``: the receiver's base is its own copy of what it received, and every
region lands, an unchanged one as that copy). The plan is the same as a full update's
(``rank_plan``); only what crosses the wire differs. A trainer rank keeps a ``Snapshot``:
the engine-dtype values it last delivered for its own regions, in host memory, valid for
one membership epoch and one plan. In each round
it encodes every region it sends against that snapshot (``delta_codec``: nothing, indices,
a bitmask or the whole region, whichever is fewest bytes; the whole region when it has no
valid base) and sends each receiver one buffer of records (``delta_codec.delta_records``)
through ``executor.exchange_payloads``. An engine rank reads the records, takes the base of
each region from its live parameter (the values the trainer last delivered, unless
something changed them) and decodes into staging of its own that the pause writes as usual
(``executor.Landing``); an unchanged region lands nothing. When the update asks, every
base's digest is checked before the first round (``_check_bases``), so a base that differs
refuses the update before anything lands, however small the staging.

Exact or full: the trainer stages the new values and ``Snapshot.commit`` keeps them only
once every engine answered success; anything else (``Snapshot.drop``) makes the next
update full, and says why. An engine whose base differs from the trainer's digest refuses
the update before writing anything (``DeltaRefusal``).

Block-FP8 engines: the delta is taken after quantization. The blocks a trainer rank holds
whole travel quantized (``fp8_sender``): the snapshot keeps the uint8 buffer it last sent
(e4m3 bytes, then float32 scales) and each update encodes the new buffer against it byte by
byte, after the plan's rounds (``_quantized_rounds``, the same rounds as ``fp8_wire``);
the engine reads its base from its live e4m3 weight and ``weight_scale_inv``
(``fp8_sender.read_quantized``) and lands the result as ``fp8_wire.QuantizedLanding``.
The pieces an engine quantizes from bf16 staging (blocks no trainer rank holds whole: a
shard edge inside a block) are regions like any other at the trainer (snapshot, encoding);
their base on the engine is the bf16 staging it keeps for them between the updates of a
group that runs delta updates (``KeptStaging``: 2 bytes per element of those pieces, host
memory, kept after every successful write, let go on any failure, refusal, full update of
a group without deltas, or when the engine leaves). Every such piece lands in the pause
(an unchanged one as its kept values), so the engine's staging holds whole blocks and
quantizes them as a full update does. The report counts them apart
(``engine_quantized``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.control_plane import GroupRefusal
from sglang.srt.weight_sync.delta_codec import (
    CLASSES,
    DIGEST_BYTES,
    NO_DIGEST,
    RECORD_BYTES,
    SIZE_BYTES,
    Encoded,
    Kind,
    base_digests,
    decode_into,
    decode_many,
    delta_records,
    encode_many,
    read_base_digests,
    read_delta_records,
    region_digest,
)
from sglang.srt.weight_sync.executor import (
    DataGroup,
    Deferred,
    ExecutionStats,
    Landing,
    dest_region,
    exchange_round,
    rank_rounds,
    source_region,
)
from sglang.srt.weight_sync.fp8_sender import (
    QuantizedMove,
    SenderFp8Plan,
    quantize_for_wire,
    read_quantized,
)
from sglang.srt.weight_sync.fp8_wire import QuantizedLanding, quantized_of
from sglang.srt.weight_sync.manifest import EngineManifest
from sglang.srt.weight_sync.planner import Move, Plan
from sglang.srt.weight_sync.protocol import DeliveryError

__all__ = (
    "CLASSES",
    "DeltaFigures",
    "RECEIVER_FIGURES",
    "DeltaRefusal",
    "KeptStaging",
    "Snapshot",
    "delta_summary",
    "engine_quantized",
    "execute_delta",
    "stage_full",
    "tensor_class",
)

# what a sender counts per receiver (then per engine): its records' bytes, a full update's
# bytes for the same regions, the elements changed and compared, then changed and compared
# per class (``CLASSES``)
RECEIVER_FIGURES = ("wire_bytes", "full_bytes", "changed", "elements") + tuple(
    f"{c}_{what}" for c in CLASSES for what in ("changed", "elements")
)


def tensor_class(name: str) -> str:
    """The class of an HF tensor name, for densities per class."""
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if "attn" in name or "attention" in name:
        return "attention"
    if "mlp" in name or "expert" in name:
        return "mlp"
    return "other"


class DeltaRefusal(GroupRefusal):
    """A receiver's base differs from what its sender delivered (a digest mismatch), or
    it cannot decode a region: nothing is written, the next update is full."""


@dataclass
class DeltaFigures:
    """One rank's delta figures for one update (integers, shared among the trainer ranks).
    ``wire_bytes``: the records' bytes (headers included); ``full_bytes``: what a full
    update sends or receives for the same regions; ``changed``/``elements``: per region
    sent (once, however many receivers) or received, per class in ``by_class``;
    ``sent_*``: the wire bytes a sender sent or a receiver received, by what the records
    carry (changes, whole regions, nothing); ``regions_*``: the records by kind;
    ``*staged*``: the same for the pieces a block-FP8 engine quantizes from its staging
    (``engine_quantized``: all their records' bytes, those sent whole, a full update's);
    ``by_receiver``: a sender's ``RECEIVER_FIGURES`` per receiving group rank."""

    wire_bytes: int = 0
    full_bytes: int = 0
    changed: int = 0
    elements: int = 0
    regions_full: int = 0
    regions_delta: int = 0
    regions_unchanged: int = 0
    encode_us: int = 0
    decode_us: int = 0
    digests_checked: int = 0
    sent_delta: int = 0
    sent_full: int = 0
    sent_unchanged: int = 0
    sent_staged: int = 0
    staged_whole: int = 0
    staged_full_bytes: int = 0
    regions_staged: int = 0
    by_class: Dict[str, List[int]] = field(default_factory=dict)
    by_receiver: Dict[int, List[int]] = field(default_factory=dict)
    staged_by_class: Dict[str, int] = field(default_factory=dict)

    def ints(self) -> List[int]:
        """The scalar figures, ``by_class`` and ``staged_by_class`` as one list
        (``from_ints`` reads it back)."""
        out = [getattr(self, name) for name in _scalars()]
        for c in CLASSES:
            out += self.by_class.get(c, [0, 0])
        return out + [self.staged_by_class.get(c, 0) for c in CLASSES]

    def staged(self, tensor: str, wire: int, full: int, whole: bool) -> None:
        """Count a region an engine quantizes from its staging (``engine_quantized``):
        ``wire`` bytes to all its receivers (``whole``: a whole region's record), ``full``
        what a full update sends of it."""
        self.sent_staged += wire
        self.staged_whole += wire if whole else 0
        self.staged_full_bytes += full
        self.regions_staged += 1
        c = tensor_class(tensor)
        self.staged_by_class[c] = self.staged_by_class.get(c, 0) + wire

    def engine_rows(self, engines: Sequence[Sequence[int]]) -> List[int]:
        """``by_receiver`` summed over each engine's group ranks, one ``RECEIVER_FIGURES``
        row per engine, flat (shared among the trainer ranks beside ``ints``)."""
        out: List[int] = []
        for ranks in engines:
            row = [0] * len(RECEIVER_FIGURES)
            for r in ranks:
                for i, v in enumerate(self.by_receiver.get(r, ())):
                    row[i] += v
            out += row
        return out

    def record(self, tensor: str, enc: Encoded, wire: int) -> None:
        """Count one region's record (a sender: to all its receivers, ``wire`` bytes in
        all): its bytes by what it carries, its elements changed and compared, overall and
        in its tensor's class."""
        self.elements += enc.numel
        self.changed += enc.changed
        row = self.by_class.setdefault(tensor_class(tensor), [0, 0])
        row[0] += enc.changed
        row[1] += enc.numel
        if enc.kind == Kind.FULL:
            self.regions_full += 1
            self.sent_full += wire
        elif enc.kind == Kind.UNCHANGED:
            self.regions_unchanged += 1
            self.sent_unchanged += wire
        else:
            self.regions_delta += 1
            self.sent_delta += wire

    def reply_ints(self) -> List[int]:
        """A receiver's ``DELTA_REPLY_FIGURES``, in order (an engine's reply)."""
        out = [self.sent_delta, self.sent_full, self.sent_unchanged]
        out += [self.changed, self.elements]
        for c in CLASSES:
            out += self.by_class.get(c, [0, 0])
        return out

    def received(
        self, receiver: int, tensor: str, wire: int, full: int, changed: int, numel: int
    ) -> None:
        """Count one region's record to ``receiver``."""
        row = self.by_receiver.setdefault(receiver, [0] * len(RECEIVER_FIGURES))
        at = 4 + 2 * CLASSES.index(tensor_class(tensor))
        values = (wire, full, changed, numel, changed, numel)
        for i, v in zip((0, 1, 2, 3, at, at + 1), values):
            row[i] += v

    @staticmethod
    def from_ints(values: List[int]) -> DeltaFigures:
        names = _scalars()
        figures = DeltaFigures(**dict(zip(names, values)))
        rest = values[len(names) :]
        figures.by_class = {
            c: [rest[2 * i], rest[2 * i + 1]] for i, c in enumerate(CLASSES)
        }
        rest = rest[2 * len(CLASSES) :]
        figures.staged_by_class = {c: rest[i] for i, c in enumerate(CLASSES)}
        return figures


def _scalars() -> List[str]:
    return [
        f.name
        for f in fields(DeltaFigures)
        if f.name not in ("by_class", "by_receiver", "staged_by_class")
    ]


def _key(move: Move) -> tuple:
    return (move.tensor, move.holder.buffer, move.region, move.dtype)


class Snapshot:
    """A trainer rank's engine-dtype values of its regions as last delivered (``device``:
    host memory by default), for one membership epoch and one plan; for the blocks it
    quantizes for a block-FP8 engine, their e4m3 bytes and scales (``_qkey``)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.epoch: Optional[int] = None
        self.fingerprint: Optional[str] = None
        self.regions: Dict[tuple, torch.Tensor] = {}
        self.pending: Dict[tuple, torch.Tensor] = {}
        self.why_full = "no update delivered yet"

    def bases(
        self, epoch: int, fingerprint: str
    ) -> Tuple[Optional[Mapping[tuple, torch.Tensor]], str]:
        """The regions a delta may apply to in ``epoch`` with the plan ``fingerprint``, or
        None and why the update is full."""
        why = self.why_full_now(epoch)
        if why:
            return None, why
        if self.fingerprint != fingerprint:
            return None, "the plan changed (a new layout, engine or dtype)"
        return self.regions, ""

    def why_full_now(self, epoch: int) -> str:
        """Why an update of ``epoch`` is full before its plan is known ("" when it may be a
        delta)."""
        if self.epoch is None:
            return self.why_full
        if self.epoch != epoch:
            return f"a new membership epoch ({epoch}; delivered in {self.epoch})"
        return ""

    def next_update(self, epoch: int) -> Dict[str, str]:
        """What the next update of ``epoch`` will be after this one's commit or drop, as a
        report says it: ``next`` ("delta" or "full") and ``next_why_full``."""
        why = self.why_full_now(epoch)
        return {"next": "full" if why else "delta", "next_why_full": why}

    def stage(self, move: Move, values: torch.Tensor) -> None:
        self.stage_values(_key(move), values)

    def stage_quantized(self, q: QuantizedMove, values: torch.Tensor) -> None:
        """Stage a sender-quantized block's uint8 buffer (e4m3 bytes, then scales)."""
        self.stage_values(_qkey(q), values)

    def stage_values(self, key: tuple, values: torch.Tensor) -> None:
        """Stage the values delivered for region ``key`` (kept at ``commit``)."""
        self.pending[key] = values.detach().to(self.device, copy=True)

    def commit(self, epoch: int, fingerprint: str) -> None:
        """Every engine answered success: what was staged is what they hold."""
        self.regions.update(self.pending)
        self.pending = {}
        self.epoch, self.fingerprint = epoch, fingerprint

    def unstage(self) -> None:
        """Forget what an update staged and never committed (its bases stay)."""
        self.pending = {}

    def drop(self, why: str) -> None:
        """The update was not answered success everywhere: the next one is full."""
        self.regions, self.pending = {}, {}
        self.epoch = self.fingerprint = None
        self.why_full = why

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.regions.values())


class KeptStaging:
    """An engine rank's base for the pieces it quantizes from bf16 staging (blocks no
    trainer rank holds whole), for one group membership: each such region's staged-dtype
    values as the last successful update wrote them into its staging, by the same key as
    the trainer's ``Snapshot`` (``_key``), in host memory (``device``).

    Host, not the GPU: it is read once per update (a delta's base, its digest) and costs
    2 bytes per element of the cut blocks beside their 1-byte e4m3 weights, memory the
    engine's KV cache would otherwise have; ``release_memory_occupation`` releases GPU
    memory, which this is not: kept on the GPU it would stay there while the engine gives
    its memory back, and a host copy is untouched by a release and resume.
    Kept only while the group runs delta updates (``UpdateHeader.keep_base``)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.regions: Dict[tuple, torch.Tensor] = {}

    def base(self, move: Move) -> Optional[torch.Tensor]:
        """The values the last update wrote for ``move``'s region, or None."""
        return self.regions.get(_key(move))

    def keep(
        self,
        plan: Plan,
        rank: int,
        params: Mapping[str, torch.Tensor],
        staged: FrozenSet[Tuple[int, str]],
    ) -> None:
        """After the pause wrote every region of ``plan`` on group rank ``rank`` (the
        staging buffers in ``params``), copy out the regions of ``staged`` weights (the
        pieces quantized here): the next delta's bases. What was kept before goes."""
        self.regions = {}
        for mine in rank_rounds(plan, rank):
            for move in mine:
                dests = _my_dests(move, rank)
                if dests and _staged_at(move, rank, staged):
                    region = dest_region(params, dests[0], move)
                    kept = torch.empty(
                        region.shape, dtype=region.dtype, device=self.device
                    )
                    self.regions[_key(move)] = kept.copy_(region)

    def clear(self) -> None:
        """An update failed, was refused or was full without deltas: no base any more."""
        self.regions = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.regions.values())


def engine_quantized(
    engines: Sequence[Tuple[EngineManifest, int]],
) -> FrozenSet[Tuple[int, str]]:
    """(group rank, weight) of every block-FP8 weight of ``engines`` (each its manifest and
    first group rank): the pieces of them that travel in the staged dtype meet and are
    quantized in the engine's staging; their base is what the engine keeps of that staging
    (``KeptStaging``), and the report counts them apart."""
    return frozenset(
        (offset + t, q.weight)
        for manifest, offset in engines
        if manifest.block_fp8
        for t in range(manifest.parallel.tp_size)
        for q in quantized_of(manifest, t)
    )


def _staged(move: Move, staged: FrozenSet[Tuple[int, str]]) -> bool:
    """Whether ``move`` lands in an engine's block-FP8 staging (``engine_quantized``)."""
    return bool(staged) and any((d.rank, d.param) in staged for d in move.dests)


def _staged_at(move: Move, rank: int, staged: FrozenSet[Tuple[int, str]]) -> bool:
    """Whether ``move`` lands in ``rank``'s block-FP8 staging."""
    return bool(staged) and any(
        (d.rank, d.param) in staged for d in move.dests if d.rank == rank
    )


def _qkey(q: QuantizedMove) -> tuple:
    """A sender-quantized region's key in a ``Snapshot`` (its e4m3 bytes and scales)."""
    return (q.move.tensor, q.move.holder.buffer, q.move.region, "e4m3+scales")


def _receivers(move: Move) -> List[int]:
    return list(dict.fromkeys(d.rank for d in move.dests))


def _my_dests(move: Move, rank: int):
    return tuple(d for d in move.dests if d.rank == rank)


def execute_delta(
    plan: Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    data: DataGroup,
    timeout_s: Optional[float],
    deferred: Optional[Deferred],
    snapshot: Optional[Snapshot],
    epoch: int,
    digest: bool,
    fp8: Optional[SenderFp8Plan] = None,
    staged: FrozenSet[Tuple[int, str]] = frozenset(),
    kept: Optional[KeptStaging] = None,
    received: Optional[Mapping[tuple, torch.Tensor]] = None,
) -> Tuple[ExecutionStats, DeltaFigures, str]:
    """Run ``plan``'s rounds as ``rank`` with delta records (see the module's text): a
    sender encodes against ``snapshot`` (and stages the new values in it), a receiver
    decodes against ``params`` into ``deferred``; then ``fp8``'s sender-quantized blocks
    likewise (``_quantized_rounds``). Moves into block-FP8 staging (``staged``) are
    counted apart; a receiver decodes them against ``kept`` and lands every one.
    ``received``: the receiver keeps its own copies of what it last received, by region
    (a trainer rank in trainer-side mode, ``reshard_delta``): every base is taken from
    them, and every region lands, an unchanged one as its base. Returns
    the executor's figures (bytes as they travelled), the delta figures and why the update
    was full ("" for a delta). ``DeltaRefusal`` after the last round when a base did not
    match or decode."""
    phase = f"rank {rank}: delta executor"
    stats, figures = ExecutionStats(), DeltaFigures()
    data.warm_up(timeout_s, phase)
    rounds = rank_rounds(plan, rank)
    data.connect(rounds, rank, timeout_s, phase)
    bases, why_full = (
        snapshot.bases(epoch, plan.fingerprint) if snapshot else (None, "")
    )
    side = _Side(
        rank, shards, params, data, timeout_s, deferred, staged, kept, received
    )
    problems: List[str] = []
    if digest:  # every base checked before anything lands: the records carry no digest
        problems += _check_bases(rounds, fp8, side, bases, stats, figures)
    # a base that differs lands nothing: the rounds still run, so that every peer's
    # exchanges are answered, and the refusal follows them
    land = not problems
    local = plan.local_for(rank)
    if local and deferred is not None and land:
        deferred.landed(
            [Landing(source_region(shards, m).clone(), m, m.dests[:1]) for m in local]
        )
        stats.bytes_copied_locally += sum(m.nbytes for m in local)
    for number, mine in enumerate(rounds, 1):
        sends = [m for m in mine if m.src == rank]
        recvs = [m for m in mine if _my_dests(m, rank)]
        outgoing = _encode_round(
            sends, shards, bases, snapshot, digest, figures, staged
        )
        if deferred is not None and recvs and land:
            deferred.reserve(sum(m.nbytes for m in recvs))
        senders = sorted({m.src for m in recvs})
        got = exchange_round(
            data, rank, outgoing, senders, timeout_s, f"{phase} round {number}", stats
        )
        stats.rounds += 1
        if recvs and land:
            t0 = time.perf_counter()
            landings = []
            for src, raw in got.items():
                figures.wire_bytes += raw.numel()
                moves = [m for m in recvs if m.src == src]
                figures.full_bytes += sum(m.nbytes for m in moves)
                landings += _decode_from(
                    src, raw, moves, side, digest, problems, figures
                )
            figures.decode_us += int((time.perf_counter() - t0) * 1e6)
            if deferred is not None:
                deferred.landed(landings)
    if fp8 is not None:
        against = (bases, snapshot, digest, land)
        _quantized_rounds(fp8, side, stats, figures, problems, against)
    if problems:
        raise DeltaRefusal(
            f"rank {rank}: the delta update is refused before any write: "
            + "; ".join(problems[:8])
            + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
        )
    return stats, figures, why_full if bases is None else ""


@dataclass(frozen=True)
class _Side:
    """One rank's end of a delta update: its own shards (a sender), its live parameters
    and staging (a receiver), the data group and the bound of its waits; the weights
    block-FP8 engines quantize from staging (``engine_quantized``) and a receiver's base
    of those pieces (``KeptStaging``); ``received``: a receiver's own copies of every
    region it last received (``execute_delta``), its bases instead of its parameters."""

    rank: int
    shards: Mapping[str, torch.Tensor]
    params: Mapping[str, torch.Tensor]
    data: DataGroup
    timeout_s: Optional[float]
    deferred: Optional[Deferred]
    staged: FrozenSet[Tuple[int, str]] = frozenset()
    kept: Optional[KeptStaging] = None
    received: Optional[Mapping[tuple, torch.Tensor]] = None

    def lands_unchanged(self, move: Move) -> bool:
        """Whether an unchanged region lands anyway (as its base): a receiver that keeps
        copies of what it received fills new buffers, and block-FP8 staging is made
        afresh each pause."""
        return self.received is not None or _staged_at(move, self.rank, self.staged)

    def base(self, move: Move, where: str) -> Tuple[Optional[torch.Tensor], str]:
        """What this receiver holds for ``move``'s region (its copy of what it received,
        the kept staging of a piece it quantizes, else its live parameter), or None and
        why it has no base."""
        if self.received is not None:
            return self._received(_key(move), where)
        if _staged_at(move, self.rank, self.staged):
            base = self.kept.base(move) if self.kept is not None else None
            if base is None:
                return None, (
                    f"{where}: no kept block-FP8 staging for it (the last update did not "
                    "keep one here): no base to apply the delta to"
                )
            return base, ""
        base = dest_region(self.params, _my_dests(move, self.rank)[0], move)
        problem = _no_base(base, move, where)
        return (None, problem) if problem else (base, "")

    def quantized_base(
        self, q: QuantizedMove, where: str, problems: List[str]
    ) -> Optional[torch.Tensor]:
        """What this receiver holds for ``q`` (its copy of what it received, else its e4m3
        weight and scales: ``read_quantized``), or None with the problem named."""
        if self.received is not None:
            base, problem = self._received(_qkey(q), where)
            if problem:
                problems.append(problem)
            return base
        try:
            return read_quantized(q, self.rank, self.params)
        except KeyError as e:
            problems.append(f"{where}: no e4m3 weight or scales {e} to apply it to")
            return None

    def _received(self, key: tuple, where: str) -> Tuple[Optional[torch.Tensor], str]:
        base = self.received.get(key)
        if base is None:
            return None, (
                f"{where}: this rank kept no copy of it from the last update: no base "
                "to apply the delta to"
            )
        return base, ""


def _quantized_rounds(
    sender: SenderFp8Plan,
    side: _Side,
    stats: ExecutionStats,
    figures: DeltaFigures,
    problems: List[str],
    against: tuple,
) -> None:
    """``sender``'s quantized blocks as delta records, round by round as ``fp8_wire.
    run_quantized`` runs them: a sender quantizes its regions and encodes each uint8 buffer
    (e4m3 bytes, then scales) against the one it last delivered (``against``: the bases,
    the snapshot to stage in, whether bases were checked, whether to land); a receiver decodes against
    its live e4m3 weights and scales (``read_quantized``) into ``QuantizedLanding``s."""
    bases, snapshot, digest, land = against
    rank, shards, data, deferred = side.rank, side.shards, side.data, side.deferred
    timeout_s = side.timeout_s
    phase = f"rank {rank}: delta of sender-quantized blocks"
    data.connect(
        [[q.move for q in rnd] for rnd in sender.quantized], rank, timeout_s, phase
    )
    local = [q for q in sender.local if q.move.src == rank]
    if local and deferred is not None and land:  # own blocks: copied whole, never sent
        deferred.landed(
            [QuantizedLanding(_quantize(shards, q, data), q, rank) for q in local]
        )
    for number, moves in enumerate(sender.quantized, 1):
        sends = [q for q in moves if q.move.src == rank]
        recvs = [q for q in moves if _my_dests(q.move, rank)]
        if not sends and not recvs:
            continue
        outgoing: Dict[int, torch.Tensor] = {}
        if sends:
            t0 = time.perf_counter()
            news = [_quantize(shards, q, data) for q in sends]
            olds = [bases.get(_qkey(q)) if bases is not None else None for q in sends]
            for q, new in zip(sends, news):
                if snapshot is not None:
                    snapshot.stage_values(_qkey(q), new)
            outgoing = _records(
                [(q.move, q.nbytes) for q in sends], news, olds, digest, figures
            )
            figures.encode_us += int((time.perf_counter() - t0) * 1e6)
        if deferred is not None and recvs and land:
            deferred.reserve(sum(q.nbytes for q in recvs))
        senders = sorted({q.move.src for q in recvs})
        got = exchange_round(
            data, rank, outgoing, senders, timeout_s, f"{phase}, round {number}", stats
        )
        if not recvs or not land:
            continue
        t0 = time.perf_counter()
        landings: List[QuantizedLanding] = []
        for src, raw in sorted(got.items()):
            figures.wire_bytes += raw.numel()
            mine = [q for q in recvs if q.move.src == src]
            figures.full_bytes += sum(q.nbytes for q in mine)
            landings += _decode_quantized(
                src, raw, mine, side, digest, problems, figures
            )
        figures.decode_us += int((time.perf_counter() - t0) * 1e6)
        if deferred is not None:
            deferred.landed(landings)


def _quantize(shards, q: QuantizedMove, data: Optional[DataGroup]) -> torch.Tensor:
    """The sender's end of ``q``: its region in the staged dtype, quantized as the engine
    would (``quantize_for_wire``: e4m3 bytes then float32 scales, one uint8 buffer), on
    ``data``'s device (where ``fp8_wire`` quantizes)."""
    device = data.device if data is not None else None
    region = source_region(shards, q.move).to(device=device, dtype=q.move.dtype)
    return quantize_for_wire(region, q.block)


def stage_full(
    plan: Plan,
    rank: int,
    shards: Mapping[str, torch.Tensor],
    snapshot: Snapshot,
    epoch: int,
    fp8: Optional[SenderFp8Plan] = None,
    staged: FrozenSet[Tuple[int, str]] = frozenset(),
    data: Optional[DataGroup] = None,
) -> Tuple[DeltaFigures, str]:
    """After a full update's rounds (``executor.execute``, then ``fp8_wire.run_quantized``
    for ``fp8``: every byte at its lower bound), the engine-dtype values this rank sent,
    staged in ``snapshot`` (the quantized blocks quantized again, on ``data``'s device as
    ``run_quantized`` did: what the engine holds; the moves into block-FP8 staging,
    ``staged``, as any other, counted apart: the engine keeps their staging); the figures
    of a full update and why it was full."""
    figures = DeltaFigures()
    t0 = time.perf_counter()
    for mine in rank_rounds(plan, rank):
        for move in mine:
            if move.src != rank:
                continue
            snapshot.stage(move, source_region(shards, move).to(move.dtype))
            if _staged(move, staged):
                sent = move.nbytes * len(_receivers(move))
                figures.staged(move.tensor, sent, sent, True)
            _count_full(figures, move, move.nbytes, move.region.numel)
    for q in (q for rnd in (fp8.quantized if fp8 else ()) for q in rnd):
        if q.move.src == rank:
            snapshot.stage_values(_qkey(q), _quantize(shards, q, data))
            _count_full(figures, q.move, q.nbytes, q.nbytes)
    figures.encode_us = int((time.perf_counter() - t0) * 1e6)
    _, why = snapshot.bases(epoch, plan.fingerprint)
    return figures, why or "the trainer sent a full update"


def _count_full(figures: DeltaFigures, move: Move, nbytes: int, numel: int) -> None:
    """Count one region a full update sent whole to each of its receivers."""
    sent = nbytes * len(_receivers(move))
    figures.wire_bytes += sent
    figures.full_bytes += sent
    figures.sent_full += sent
    for receiver in _receivers(move):
        figures.received(receiver, move.tensor, nbytes, nbytes, numel, numel)
    figures.elements += numel
    figures.changed += numel
    figures.regions_full += 1
    row = figures.by_class.setdefault(tensor_class(move.tensor), [0, 0])
    row[0] += numel
    row[1] += numel


def _encode_round(
    sends: List[Move],
    shards,
    bases: Optional[Mapping[tuple, torch.Tensor]],
    snapshot: Optional[Snapshot],
    digest: bool,
    figures: DeltaFigures,
    staged: FrozenSet[Tuple[int, str]] = frozenset(),
) -> Dict[int, torch.Tensor]:
    """The round's records from this rank, one buffer per receiver; the new values staged
    (those of moves into block-FP8 staging too, counted apart: ``engine_quantized``)."""
    if not sends:
        return {}
    t0 = time.perf_counter()
    news = [source_region(shards, m).to(m.dtype).contiguous() for m in sends]
    olds = [bases.get(_key(m)) if bases is not None else None for m in sends]
    for move, new in zip(sends, news):
        if snapshot is not None:
            snapshot.stage(move, new)
    into_staging = [_staged(m, staged) for m in sends]
    out = _records(
        [(m, m.nbytes) for m in sends], news, olds, digest, figures, into_staging
    )
    figures.encode_us += int((time.perf_counter() - t0) * 1e6)
    return out


def _records(
    sends: List[Tuple[Move, int]],
    news: List[torch.Tensor],
    olds: List[Optional[torch.Tensor]],
    digest: bool,
    figures: DeltaFigures,
    into_staging: Optional[List[bool]] = None,
) -> Dict[int, torch.Tensor]:
    """Each region (its move and a full update's bytes of it) encoded against its base,
    as one buffer of records per receiver, counted in ``figures`` (apart too where
    ``into_staging``: pieces an engine quantizes from its staging)."""
    encoded = encode_many(list(zip(olds, news)))
    records: Dict[int, List[Encoded]] = {}
    for i, ((move, full), enc) in enumerate(zip(sends, encoded)):
        receivers = _receivers(move)
        head = _head_bytes(enc, digest)  # its digest, if any, went before the rounds
        for receiver in receivers:
            records.setdefault(receiver, []).append(enc)
            figures.received(
                receiver, move.tensor, head + enc.nbytes, full, enc.changed, enc.numel
            )
        figures.full_bytes += full * len(receivers)
        sent = (head + enc.nbytes) * len(receivers)
        figures.wire_bytes += sent
        figures.record(move.tensor, enc, sent)
        if into_staging is not None and into_staging[i]:
            whole = enc.kind == Kind.FULL
            figures.staged(move.tensor, sent, full * len(receivers), whole)
    return {r: delta_records(recs) for r, recs in records.items()}


def _head_bytes(enc: Encoded, digest: bool) -> int:
    """A record's header bytes (``delta_codec.delta_records``), with its base's digest
    when the update checks them (sent before the rounds, ``base_digests``)."""
    head = RECORD_BYTES + (DIGEST_BYTES if digest else 0)
    return head + (SIZE_BYTES if enc.kind == Kind.GAPS else 0)


def _decode_from(
    src: int,
    raw: torch.Tensor,
    moves: List[Move],
    side: _Side,
    digest: bool,
    problems: List[str],
    figures: DeltaFigures,
) -> List[Landing]:
    """The landings of one sender's records (``moves``: theirs, in the plan's order); a
    problem is named in ``problems`` and its region lands nothing. A piece of block-FP8
    staging lands even unchanged (its kept values): the pause makes that staging afresh
    and quantizes whole blocks from it."""
    rank, params = side.rank, side.params
    who = f"rank {rank}: from rank {src}"
    try:
        records = read_delta_records(
            raw, [(m.region.numel, m.dtype.itemsize) for m in moves], who
        )
    except DeliveryError as e:
        problems.append(str(e))
        return []
    landings, changed = [], []
    for move, enc in zip(moves, records):
        figures.record(move.tensor, enc, _head_bytes(enc, digest) + enc.nbytes)
        dests = _my_dests(move, rank)
        where = _where(rank, move)
        device = dest_region(params, dests[0], move).device
        if enc.kind == Kind.FULL:
            buf = torch.empty(move.region.sizes, dtype=move.dtype, device=device)
            decode_into(enc, buf)
            landings.append(Landing(buf, move, dests))
            continue
        base, problem = side.base(move, where)
        if problem:
            problems.append(problem)
            continue
        if enc.kind == Kind.UNCHANGED:
            if side.lands_unchanged(move):
                old = torch.empty(base.shape, dtype=base.dtype, device=device)
                landings.append(Landing(old.copy_(base), move, dests))
            continue
        changed.append((move, dests, enc, base, device, where))
    # the changed regions decoded together (``decode_many``: a MoE layer's experts are
    # thousands of small records), each onto a copy of its base
    news, errors = decode_many(
        [c[2] for c in changed], [c[3] for c in changed], [c[4] for c in changed]
    )
    for (move, dests, _, _, _, where), new, error in zip(changed, news, errors):
        if error:
            problems.append(f"{where}: {error}")
        else:
            landings.append(Landing(new, move, dests))
    return landings


def _where(rank: int, move: Move, kind: str = "tensor") -> str:
    return f"rank {rank}: {kind} {move.tensor!r} region {move.region}"


def _no_base(base: torch.Tensor, move: Move, where: str) -> str:
    """Why the parameter region ``base`` cannot be the base of ``move``'s delta ("": it can)."""
    if base.dtype == move.dtype:
        return ""
    return (
        f"{where}: the parameter is {base.dtype}, the delta {move.dtype}: no base to "
        "apply it to"
    )


def _applied(enc: Encoded, old: torch.Tensor, where: str, problems: List[str]) -> bool:
    """Decode ``enc`` into ``old`` (a copy of the receiver's base); whether there is
    anything to land (a problem is named instead)."""
    if enc.kind == Kind.UNCHANGED:
        return False
    try:
        decode_into(enc, old)
    except ValueError as e:
        problems.append(f"{where}: {e}")
        return False
    return True


def _decode_quantized(
    src: int,
    raw: torch.Tensor,
    moves: List[QuantizedMove],
    side: _Side,
    digest: bool,
    problems: List[str],
    figures: DeltaFigures,
) -> List[QuantizedLanding]:
    """The landings of one sender's records of quantized blocks (``moves``: theirs, in
    round order), each decoded against what ``side``'s rank holds for it
    (``_Side.quantized_base``: its e4m3 weight and scales, or its copy)."""
    rank = side.rank
    who = f"rank {rank}: sender-quantized blocks from rank {src}"
    try:
        records = read_delta_records(raw, [(q.nbytes, 1) for q in moves], who)
    except DeliveryError as e:
        problems.append(str(e))
        return []
    landings = []
    for q, enc in zip(moves, records):
        figures.record(q.move.tensor, enc, _head_bytes(enc, digest) + enc.nbytes)
        where = _where(rank, q.move, "block-FP8 tensor")
        if enc.kind == Kind.FULL:
            buf = torch.empty(q.nbytes, dtype=torch.uint8, device=raw.device)
            decode_into(enc, buf)
            landings.append(QuantizedLanding(buf, q, rank))
            continue
        base = side.quantized_base(q, where, problems)
        if base is None:
            continue
        if side.received is None:  # a copy read from the e4m3 weight and scales
            old = base
        else:  # this rank's copy: it lands even unchanged, and is never written
            old = base.clone()
            if enc.kind == Kind.UNCHANGED:
                landings.append(QuantizedLanding(old, q, rank))
                continue
        if _applied(enc, old, where, problems):
            landings.append(QuantizedLanding(old, q, rank))
    return landings


def _check_bases(
    rounds: List[List[Move]],
    fp8: Optional[SenderFp8Plan],
    side: _Side,
    bases: Optional[Mapping[tuple, torch.Tensor]],
    stats: ExecutionStats,
    figures: DeltaFigures,
) -> List[str]:
    """The digest round, before the first round of the plan: every sender sends each
    receiver the digest of the base it will encode each region against (``NO_DIGEST``:
    none, the region travels whole), in the plan's order, its sender-quantized blocks
    last; every receiver compares them with its live parameters (the pieces it quantizes
    from staging: with its kept staging). So a base changed behind the trainer's back
    refuses the update before anything lands, even where the staging is smaller than the
    rank's share and the pause writes while later rounds arrive.
    Returns the receiver's problems, naming tensor and region."""
    rank, data, timeout_s = side.rank, side.data, side.timeout_s
    phase = f"rank {rank}: delta base digests"
    moves = [m for mine in rounds for m in mine]
    quantized = [q for rnd in (fp8.quantized if fp8 else ()) for q in rnd]
    if quantized:
        data.connect([[q.move for q in quantized]], rank, timeout_s, phase)
    t0 = time.perf_counter()
    checks: Dict[int, List[int]] = {}
    sent = [(m, _key(m)) for m in moves if m.src == rank]
    sent += [(q.move, _qkey(q)) for q in quantized if q.move.src == rank]
    for move, key in sent:
        base = bases.get(key) if bases is not None else None
        check = region_digest(base) if base is not None else NO_DIGEST
        figures.digests_checked += check != NO_DIGEST
        for receiver in _receivers(move):
            checks.setdefault(receiver, []).append(check)
    figures.encode_us += int((time.perf_counter() - t0) * 1e6)
    mine = [m for m in moves if _my_dests(m, rank)]
    mine_q = [q for q in quantized if _my_dests(q.move, rank)]
    senders = sorted({m.src for m in mine} | {q.move.src for q in mine_q})
    outgoing = {r: base_digests(c, data.device) for r, c in checks.items()}
    got = exchange_round(data, rank, outgoing, senders, timeout_s, phase, stats)
    t0 = time.perf_counter()
    problems: List[str] = []
    for src, raw in sorted(got.items()):
        figures.wire_bytes += raw.numel()
        regions = [m for m in mine if m.src == src]
        blocks = [q for q in mine_q if q.move.src == src]
        try:
            expected = read_base_digests(
                raw, len(regions) + len(blocks), f"rank {rank}: from rank {src}"
            )
        except DeliveryError as e:
            problems.append(str(e))
            continue
        for move, check in zip(regions, expected):
            if check == NO_DIGEST:
                continue
            where = _where(rank, move)
            base, problem = side.base(move, where)
            if problem:
                problems.append(problem)
            else:
                _compare(base.contiguous(), check, where, problems, figures)
        for q, check in zip(blocks, expected[len(regions) :]):
            if check == NO_DIGEST:
                continue
            where = _where(rank, q.move, "block-FP8 tensor")
            old = side.quantized_base(q, where, problems)
            if old is not None:
                _compare(old, check, where, problems, figures)
    figures.decode_us += int((time.perf_counter() - t0) * 1e6)
    return problems


def _compare(
    base: torch.Tensor,
    check: int,
    where: str,
    problems: List[str],
    figures: DeltaFigures,
) -> None:
    """Name a base whose digest is not the one the trainer expects."""
    figures.digests_checked += 1
    if region_digest(base) != check:
        problems.append(
            f"{where}: digest mismatch: the parameter differs from what the trainer "
            "last delivered (changed behind its back)"
        )


def delta_summary(
    per_rank: List[DeltaFigures],
    why_full: str,
    digest: bool,
    engines: Optional[Mapping[str, List[int]]] = None,
) -> Dict[str, object]:
    """What a trainer's report says of a delta update (``per_rank``: every trainer rank's
    figures; ``engines``: each engine's ``RECEIVER_FIGURES`` row, summed over the trainer
    ranks): full or delta and why, bytes on the wire against a full update's per rank and
    by what the records carry, seconds encoding per rank, the density of the changes
    overall and per tensor class, and per engine what it received."""
    elements = sum(f.elements for f in per_rank)
    by_class = {}
    for c in CLASSES:
        changed = sum(f.by_class.get(c, [0, 0])[0] for f in per_rank)
        total = sum(f.by_class.get(c, [0, 0])[1] for f in per_rank)
        if total:
            by_class[c] = changed / total
    return {
        "mode": "full" if why_full else "delta",
        "why_full": why_full,
        "digest_checked": digest,
        "wire_bytes": [f.wire_bytes for f in per_rank],
        "full_bytes": [f.full_bytes for f in per_rank],
        "sent_as": {
            "delta": [f.sent_delta for f in per_rank],
            "full": [f.sent_full for f in per_rank],
            "unchanged": [f.sent_unchanged for f in per_rank],
        },
        "encode_seconds": [f.encode_us / 1e6 for f in per_rank],
        "density": sum(f.changed for f in per_rank) / elements if elements else 0.0,
        "density_by_class": by_class,
        "regions": {
            "full": sum(f.regions_full for f in per_rank),
            "delta": sum(f.regions_delta for f in per_rank),
            "unchanged": sum(f.regions_unchanged for f in per_rank),
        },
        "engines": {
            name: _engine_summary(row) for name, row in (engines or {}).items()
        },
        "engine_quantized": _staged_summary(per_rank, why_full),
    }


def _staged_summary(per_rank: List[DeltaFigures], why_full: str) -> Dict[str, object]:
    """What an update sent of the pieces block-FP8 engines quantize from their staging
    (``engine_quantized``: blocks no trainer rank holds whole): bytes per trainer rank,
    those sent whole, a full update's bytes of them, regions, bytes per tensor class, and
    why they went whole ("" for a delta against the engines' kept staging; {} when the
    update had none)."""
    regions = sum(f.regions_staged for f in per_rank)
    if not regions:
        return {}
    by_class = {c: sum(f.staged_by_class.get(c, 0) for f in per_rank) for c in CLASSES}
    return {
        "bytes": [f.sent_staged for f in per_rank],
        "bytes_whole": [f.staged_whole for f in per_rank],
        "full_bytes": [f.staged_full_bytes for f in per_rank],
        "regions": regions,
        "bytes_by_class": {c: n for c, n in by_class.items() if n},
        "why": f"the update was full ({why_full}): the engines keep their bf16 staging of "
        "these pieces from it as the next delta's base"
        if why_full
        else "",
    }


def _engine_summary(row: List[int]) -> Dict[str, object]:
    """One engine's ``RECEIVER_FIGURES`` row as a report gives it: the bytes of the records
    it received against a full update's, the density of what it received, per class."""
    wire, full, changed, elements = row[:4]
    by_class = {
        c: row[4 + 2 * i] / row[5 + 2 * i]
        for i, c in enumerate(CLASSES)
        if row[5 + 2 * i]
    }
    return {
        "wire_bytes": wire,
        "full_bytes": full,
        "density": changed / elements if elements else 0.0,
        "density_by_class": by_class,
    }
