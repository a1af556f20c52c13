"""Checks on an update's phase timings (``weight_sync.phase_timing``) as tests read them."""

from typing import Dict, List, Mapping

from sglang.srt.weight_sync.phase_timing import Count, Phase

NAMED = [p.value for p in Phase if p != Phase.OTHER]

# What a caller may measure around an update beyond its clock: the call into the flow and
# the return from it, plus being descheduled there. On this 2-core machine running two to
# four trainer ranks beside an engine's schedulers, a rank waits up to a scheduler tick or
# two (10-20 ms) for a core whenever its peers wake, whatever the update does.
OUTSIDE_SLACK_S = 0.025


def check_trainer_breakdown(
    seconds: float, phases: Mapping[str, float], within: float = 0.10
) -> None:
    """A trainer rank's update, measured at ``seconds`` by its caller: its named phases
    cover all but ``within`` of the clock's total, and the clock covers the call, up to
    ``within`` of it or ``OUTSIDE_SLACK_S`` of scheduling, whichever is larger."""
    total = phases[Count.TOTAL_US.value] / 1e6
    named = sum(phases[p] for p in NAMED)
    assert total <= seconds, (phases, seconds)
    assert named >= (1 - within) * total, (
        f"the phases cover {named:.4f} s of the {total:.4f} s their clock ran: {phases}"
    )
    outside = seconds - total
    assert outside <= max(within * seconds, OUTSIDE_SLACK_S), (
        f"the update was measured at {seconds:.4f} s, its clock ran {total:.4f} s: "
        f"{outside:.4f} s outside every phase: {phases}"
    )


def check_engine_breakdown(
    engine: Mapping[str, List[float]], tp: int, waited: float
) -> Dict[str, List[float]]:
    """An engine's phases from its reply: one value per TP rank, each rank's phases adding
    up to its total, which is no longer than the trainer waited for the answer."""
    assert all(len(engine[name]) == tp for name in engine), engine
    for r in range(tp):
        total = engine[Count.TOTAL_US.value][r] / 1e6
        summed = sum(engine[p.value][r] for p in Phase)
        assert abs(summed - total) <= 1e-4 * tp + 1e-5, (r, summed, total)
        assert total <= waited, (r, total, waited)
    return dict(engine)
