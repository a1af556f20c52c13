"""Phase timings (``weight_sync.phase_timing``): every second of an update lands in one
phase or in ``other``, the clock travels as integers through a collective and back, and
one line says where the time went."""

import time

import pytest

from sglang.srt.weight_sync.phase_timing import (
    REPORTED,
    Count,
    Phase,
    PhaseClock,
    describe_phases,
    from_wire,
)


def test_nested_phases_count_once_and_the_rest_is_other():
    clock = PhaseClock()
    t0 = time.perf_counter()
    with clock.phase(Phase.EXECUTE):
        time.sleep(0.02)
        with clock.phase(Phase.CONTROL):  # a wait inside execute counts as control only
            time.sleep(0.03)
        clock.add(Phase.APPLY, 0.01)  # measured elsewhere inside execute
    outer = time.perf_counter() - t0
    time.sleep(0.02)
    now = clock.snapshot()
    assert now[Phase.APPLY.value] == 0.01 and now[Phase.CONTROL.value] >= 0.03
    assert now[Phase.EXECUTE.value] >= 0.01
    inside = sum(now[p.value] for p in (Phase.EXECUTE, Phase.CONTROL, Phase.APPLY))
    assert inside == pytest.approx(outer, abs=1e-3)
    assert now[Phase.OTHER.value] >= 0.02
    total = now[Count.TOTAL_US.value] / 1e6
    phases = sum(now[p.value] for p in Phase)
    assert phases == pytest.approx(
        total, abs=2e-6
    )  # other closes the gap, nothing more


def test_clocks_travel_as_integers_per_rank_and_come_back_as_seconds():
    clocks = [PhaseClock(), PhaseClock()]
    for i, clock in enumerate(clocks):
        clock.add(Phase.DELIVER, 0.25 * (i + 1))
        clock.count(Count.ROUNDS, 3 + i)
        clock.count(Count.PLAN_COLD)
    wires = [c.to_wire() for c in clocks]
    assert all(type(v) is int for w in wires for v in w) and len(wires[0]) == len(
        REPORTED
    )
    columns = [
        list(col) for col in zip(*wires)
    ]  # what the figures' all-reduce hands back
    back = from_wire(columns)
    assert back[Phase.DELIVER.value] == [0.25, 0.5]
    assert back[Count.ROUNDS.value] == [3.0, 4.0] and back[Count.PLAN_COLD.value] == [
        1.0,
        1.0,
    ]
    assert set(back) == set(REPORTED)


def test_one_line_names_the_phases_that_took_time():
    clock = PhaseClock()
    clock.add(Phase.EXECUTE, 0.012)
    clock.count(Count.ROUNDS, 2)
    clock.count(Count.WAIT_US, 4000)
    clock.count(Count.ROUND_TRIPS, 2)
    clock.add(Phase.CONTROL, 0.003)
    line = describe_phases(clock.snapshot())
    assert "execute 0.012 s (2 rounds, wait 0.004 s)" in line
    assert "control 0.003 s (2 round trips)" in line
    assert "plan 0.000 s (cached)" in line and "apply" not in line


# pr: scale
def test_the_collector_is_paused_inside_phases_and_restored_after():
    """Inside the outermost phase no collection runs (an inner phase does not end the pause);
    after it, the collector is as it was, also when the phase raised, and a caller that had
    it off keeps it off."""
    import gc

    clock = PhaseClock()
    assert gc.isenabled()
    with clock.phase(Phase.VALIDATE):
        assert not gc.isenabled()
        with clock.phase(Phase.PLAN):
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with clock.phase(Phase.APPLY):
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with clock.phase(Phase.APPLY):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collection_a_phase_held_back_runs_inside_it():
    """Objects a phase allocated past the young generation's threshold are collected as the
    phase ends, in its time: the next allocation after it triggers no collection outside
    every phase (the trainer's named phases must cover its update, ``phase_checks``)."""
    import gc

    collections = []

    def seen(stage, info):
        if stage == "start":
            collections.append(clock._open)

    clock = PhaseClock()
    held = []
    gc.collect()
    gc.callbacks.append(seen)
    try:
        with clock.phase(Phase.DESCRIBE):
            held.extend([i] for i in range(3 * gc.get_threshold()[0]))
            assert collections == []
        assert collections == [Phase.DESCRIBE.value]
        assert gc.get_count()[0] < gc.get_threshold()[0]
    finally:
        gc.callbacks.remove(seen)


# pr: scale end
