"""Checks on an update's phase timings (``weight_sync.phase_timing``) as tests read them."""

from typing import Dict, List, Mapping

from sglang.srt.weight_sync.phase_timing import Count, Phase

NAMED = [p.value for p in Phase if p != Phase.OTHER]


def check_trainer_breakdown(
    seconds: float, phases: Mapping[str, float], within: float = 0.10
) -> None:
    """The named phases of a trainer rank's update add up to the wall time measured
    around it, within ``within`` of it."""
    named = sum(phases[p] for p in NAMED)
    assert phases[Count.TOTAL_US.value] / 1e6 <= seconds, (phases, seconds)
    assert named >= (1 - within) * seconds, (
        f"the phases cover {named:.4f} s of an update measured at {seconds:.4f} s: {phases}"
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
