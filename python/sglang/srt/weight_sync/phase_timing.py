"""Where an update's seconds go: every rank times each phase of every update, always.

A ``PhaseClock`` lives for one update on one rank (the engine rank's ``ReceivedShards``,
the trainer rank's flow). ``with clock.phase(Phase.APPLY):`` adds the block's wall seconds
to that phase; ``clock.count(Count.ROUNDS, n)`` adds to a counter. The engine ranks' clocks
travel as integers (microseconds and counts) in the all-reduce that already shares the
update's byte figures, so reporting them costs no round trip; they reach the reply
(``phases``: per name, one value per engine TP rank), the trainer's ``UpdateReport`` and
one log line per update and rank. Seconds the phases do not cover are ``other``: on every
rank the phases plus ``other`` are the update's measured wall time.

Nothing here talks to a peer or keeps state beyond a clock's update.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import time
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

__all__ = (
    "Count",
    "Phase",
    "PhaseClock",
    "REPORTED",
    "collector_paused",
    "describe_phases",
    "from_wire",
)


class Phase(str, enum.Enum):
    """The phases of an update, in the order an update runs them."""

    DESCRIBE = "describe"  # sources (trainer); targets, their digest, the provenance check (engine)
    # trainer: hand the payload over; engine: take it from the channel
    DELIVER = "deliver"
    VALIDATE = "validate"  # checks of the payload and the plan's inputs, finite values
    AGREE = "agree"  # agreeing on problems, deliveries and the plan; the commit vote
    PLAN = "plan"  # planning, or finding the plan in the cache (``Count.PLAN_COLD``)
    # rounds of point-to-point moves, waits included (``Count.WAIT_US``)
    EXECUTE = "execute"
    APPLY = "apply"  # copies and casts into parameters (or the parameter buffers)
    REFRESH = "refresh"  # what SGLang derives from parameters
    CONTROL = "control"  # barriers, answers, figures, the request's way to the engine and back
    ENGINE = "engine"  # trainer only: waiting while the engine applies (its phases in the reply)
    OTHER = "other"  # the measured total less every phase above


class Count(str, enum.Enum):
    """Counters a clock keeps beside the phases."""

    ROUNDS = "rounds"  # executor rounds this rank took part in
    # bytes received between ranks plus bytes copied locally
    BYTES_MOVED = "bytes_moved"
    WAIT_US = "wait_us"  # microseconds of EXECUTE spent waiting for peers
    PLAN_COLD = "plan_cold"  # 1 when this update planned (no cached plan), else 0
    # control collectives (and requests) this rank waited on
    ROUND_TRIPS = "round_trips"
    TOTAL_US = "total_us"  # the update's measured wall time on this rank


# What a clock reports, in wire order: the phases (microseconds), then the counters.
REPORTED = tuple(p.value for p in Phase) + tuple(c.value for c in Count)
_TIMED = frozenset(p.value for p in Phase)


class PhaseClock:
    """One rank's phases and counters for one update, from its making on."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: Dict[str, float] = {p.value: 0.0 for p in Phase}
        self.counts: Dict[str, int] = {c.value: 0 for c in Count}
        # the engine's phases as its reply gave them (trainer side; empty without a reply)
        self.engine: Dict[str, List[float]] = {}
        self._open: Optional[str] = None

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Add the block's wall seconds to ``phase``; a phase opened inside another counts
        only for the inner one (its seconds are taken out of the outer)."""
        outer, self._open = self._open, phase.value
        paused = contextlib.nullcontext()
        # pr: scale
        # Python's cyclic garbage collector is paused inside the outermost phase
        # (``collector_paused``): at a MoE model's tens of thousands of tensors the
        # collections an update's allocations trigger took more time than the work (60 % of
        # decoding a payload header)
        if outer is None:
            paused = collector_paused()
        # pr: scale end
        t0 = time.perf_counter()
        try:
            with paused:
                yield
        finally:
            spent = time.perf_counter() - t0
            self.seconds[phase.value] += spent
            if outer is not None:
                self.seconds[outer] -= spent
            self._open = outer

    def add(self, phase: Phase, seconds: float) -> None:
        """Move ``seconds`` measured elsewhere (the executor's copies, say) into ``phase``,
        out of the phase open around them."""
        self.seconds[phase.value] += seconds
        if self._open is not None:
            self.seconds[self._open] -= seconds

    def count(self, counter: Count, n: int = 1) -> None:
        self.counts[counter.value] += int(n)

    def count_execution(self, stats) -> None:
        """Add an executor run's counters (``executor.ExecutionStats``): its rounds, the
        microseconds it waited for peers, the bytes it received and copied locally."""
        self.count(Count.ROUNDS, stats.rounds)
        self.count(Count.WAIT_US, round(stats.wait_seconds * 1e6))
        self.count(Count.BYTES_MOVED, stats.bytes_received + stats.bytes_copied_locally)

    def snapshot(self) -> Dict[str, float]:
        """Phases in seconds and counters by name, as of now: the total is the wall time
        since the clock was made, ``other`` what no phase covered of it."""
        total = time.perf_counter() - self.start
        covered = sum(v for k, v in self.seconds.items() if k != Phase.OTHER.value)
        out: Dict[str, float] = dict(self.seconds)
        out[Phase.OTHER.value] = max(0.0, total - covered)
        out.update((k, float(v)) for k, v in self.counts.items())
        out[Count.TOTAL_US.value] = round(total * 1e6)
        return out

    def to_wire(self) -> List[int]:
        """``snapshot()`` as integers in ``REPORTED`` order (phases in microseconds)."""
        now = self.snapshot()
        return [
            round(now[name] * 1e6) if name in _TIMED else int(now[name])
            for name in REPORTED
        ]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (when it was running), then
    running again. What an update or a plan makes per tensor (targets, pieces, moves,
    shards: millions for a large engine) then dies by its reference counts, or lives on,
    without a collection walking it: none is promoted, so none brings on a full
    collection, which at a MoE model's heap takes most of a second. The young
    generation's collection the pause held back runs as the block ends, in it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        try:
            if gc.get_count()[0] >= gc.get_threshold()[0]:
                gc.collect(0)
        finally:
            gc.enable()


def from_wire(columns: Sequence[Sequence[int]]) -> Dict[str, List[float]]:
    """Per name, one value per rank (seconds for phases), from ``REPORTED`` rows of
    per-rank integers as a collective returns them."""
    out: Dict[str, List[float]] = {}
    for name, values in zip(REPORTED, columns):
        out[name] = [v / 1e6 if name in _TIMED else float(v) for v in values]
    return out


def describe_phases(phases: Mapping[str, float]) -> str:
    """One rank's phases in one line: the total, then every phase that took time, with
    its counters ("execute 0.012 s (2 rounds, wait 0.004 s)")."""
    total = phases.get(Count.TOTAL_US.value, 0.0) / 1e6
    parts = []
    for p in Phase:
        s = phases.get(p.value, 0.0)
        if s < 5e-4 and p not in (Phase.PLAN,):
            continue
        note = ""
        if p == Phase.PLAN:
            note = " (cold)" if phases.get(Count.PLAN_COLD.value) else " (cached)"
        elif p == Phase.EXECUTE:
            note = (
                f" ({int(phases.get(Count.ROUNDS.value, 0))} rounds, wait "
                f"{phases.get(Count.WAIT_US.value, 0.0) / 1e6:.3f} s)"
            )
        elif p == Phase.CONTROL:
            note = f" ({int(phases.get(Count.ROUND_TRIPS.value, 0))} round trips)"
        parts.append(f"{p.value} {s:.3f} s{note}")
    moved = phases.get(Count.BYTES_MOVED.value, 0.0)
    return f"{total:.3f} s: " + ", ".join(parts) + f"; {moved / 2**20:.1f} MiB moved"
