"""The data plane's waits end within their bound without NCCL's watchdog: a polled wait
(``control_plane.poll``, what a NCCL data group uses) aborts its group before it raises,
and a data group whose wait failed is abandoned at once, on every path, and renewed by the
next update. A group's making is bounded too, and numbered so that a rank that missed one
meets its peers again; a new group forgets only the keys of earlier ones.

``poll`` is shown with works that say whether they completed (fakes: gloo's send and receive
works complete only inside ``wait``), the abandon-and-renew path over gloo ranks where a
peer withholds its send. NCCL's own side (the watchdog finding nothing to tear down) needs a
GPU: ``test/gpu/test_nccl_timeout.py``.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist
from held import held
from plan_samples import whole_tensor_plan
from ranks import run_ranks

from sglang.srt.weight_sync import control_plane
from sglang.srt.weight_sync.control_plane import PeerLost, poll
from sglang.srt.weight_sync.executor import DataGroup

# the bound of a group's making in the cases that leave it to one rank
BOUND_S = 2.0


class _Clock:
    """A clock that a sleep moves on: a poll's whole bound in no real time."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class _Work:
    """A work that completes after ``after`` looks (None: never); ``fails``: its wait raises."""

    def __init__(self, after=None, fails=False) -> None:
        self.after, self.fails, self.looks, self.waits, self.log = (
            after,
            fails,
            0,
            [],
            None,
        )

    def is_completed(self) -> bool:
        self.looks += 1
        return self.after is not None and self.looks > self.after

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.log is not None:
            self.log.append("wait")
        if self.fails:
            raise RuntimeError("NCCL communicator was aborted on rank 1")
        return True


def test_a_work_that_never_completes_aborts_the_group_before_the_error():
    clock, work, events = _Clock(), _Work(), []

    def give_up():
        events.append(("aborted", clock.now))

    with pytest.raises(PeerLost) as e:
        poll(work, 5.0, "rank 1: round 3", give_up, clock, clock.sleep)
    assert str(e.value).startswith("rank 1: round 3: a peer did not answer within 5s")
    assert events == [("aborted", 5.0)], "aborted once, when the bound ran out"
    assert work.waits == [], "never work.wait(timeout=...): NCCL's own abort path"
    assert sum(clock.sleeps) == pytest.approx(5.0)
    assert max(clock.sleeps) <= control_plane.POLL_LONGEST_S
    assert clock.sleeps[0] == control_plane.POLL_FIRST_S
    # no pause longer than a share of the time waited before it (a round's end is seen
    # at most that share late)
    waited = 0.0
    for pause in clock.sleeps:
        assert (
            pause
            <= max(control_plane.POLL_FIRST_S, 2 * control_plane.POLL_SHARE * waited)
            + 1e-12
        )
        waited += pause


def test_a_completed_work_is_waited_for_once_without_a_timeout():
    clock, work = _Clock(), _Work(after=3)
    poll(work, 5.0, "p", lambda: pytest.fail("gave up"), clock, clock.sleep)
    assert work.waits == [None], "one plain wait: the current stream joins the work's"
    assert clock.now < 0.01


def test_a_work_that_completed_with_an_error_aborts_the_group_too():
    clock, work, events = _Clock(), _Work(after=0, fails=True), []
    with pytest.raises(PeerLost, match="^p: the transfer failed .*aborted on rank 1"):
        poll(work, 5.0, "p", lambda: events.append("aborted"), clock, clock.sleep)
    assert events == ["aborted"]


class _Group:
    """Stands for a NCCL group: records aborts."""

    def __init__(self) -> None:
        self.log = []

    def abort(self) -> None:
        self.log.append("abort")


def test_a_polled_data_group_is_aborted_and_abandoned_when_its_wait_runs_out(
    monkeypatch,
):
    """A GPU data group polls (``polled`` is the default on CUDA); the wait that runs out
    aborts the group before ``PeerLost`` leaves, and the group is never used again."""
    group = _Group()
    data = DataGroup(group, device=torch.device("cuda", 0), own=False)
    assert data.polled
    assert not DataGroup(None, device=torch.device("cpu")).polled
    monkeypatch.setattr(control_plane, "POLL_LONGEST_S", 0.01)
    work = _Work()
    work.log = group.log
    started = time.monotonic()
    with pytest.raises(PeerLost, match="a peer did not answer within 0.2s"):
        data.wait(work, 0.2, "rank 0: executor round 1 with ranks [1]")
    assert 0.2 <= time.monotonic() - started < 2.0
    assert group.log == ["abort"], "aborted once, before the error left"
    assert data.abandoned and "within 0.2s" in data.lost
    assert not data.warm and not data.connected


def _withheld_send(rank: int, world: int) -> dict:
    """Engine ranks over gloo (SGLang's TP state faked as the world): rank 0 withholds the
    send rank 1 waits for; rank 1's wait ends within its bound, its data group abandoned and
    destroyed at once; the next update agrees to renew it on both ranks and lands."""
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.executor import execute
    from sglang.srt.weight_sync.sglang_compat import TpState

    engine_update.tp_state = lambda: TpState(rank, world, world, 1, None, None)
    sync = engine_update.EngineWeightSync(rank)
    plan = whole_tensor_plan(0, {1}, world)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    data, refusal = sync.ready_data_group(plan, sync.agree_on_data_group(30.0), 30.0)
    assert refusal is None, refusal
    out = {}
    if rank == 1:
        started = time.monotonic()
        try:
            execute(plan, 1, {}, {"p": torch.zeros(6, 4)}, data, timeout_s=2.0)
            out["first"] = "landed"
        except PeerLost as e:
            out["first"] = str(e)
        out["seconds"] = time.monotonic() - started
        out["abandoned"] = data.abandoned
        out["destroyed"] = data.group not in dist.distributed_c10d._world.pg_map
    else:
        time.sleep(4.0)  # the send is withheld past rank 1's bound
        out["abandoned"] = data.abandoned
    renewed = sync.data_group(30.0, sync.agree_on_data_group(30.0))
    out["renewed"] = renewed is not data and not renewed.abandoned
    renewed, refusal = sync.ready_data_group(plan, None, 30.0)
    assert refusal is None, refusal
    params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
    execute(plan, rank, {"w": full} if rank == 0 else {}, params, renewed, 30.0)
    out["landed"] = all(torch.equal(p, full) for p in params.values())
    dist.barrier()
    return out


def test_a_withheld_send_ends_within_the_bound_and_the_next_update_renews_the_group():
    first, second = run_ranks(2, _withheld_send)
    assert second["first"].startswith("rank 1: executor round 1 with ranks [0]"), second
    assert "within 2s" in second["first"], second
    assert second["seconds"] < 10, second
    assert second["abandoned"] and second["destroyed"], second
    assert not first["abandoned"], "rank 0 did not wait: nothing failed there"
    for r in (first, second):
        assert r["renewed"] and r["landed"], r


def _failed_updates_leave_nothing(rank: int, world: int) -> dict:
    """50 updates whose round runs out (rank 0 withholds its send, rank 1 waits 0.2 s), each
    followed by the renewal every rank agrees to: what this process holds after them against
    what it held after the first."""
    from torch.distributed import distributed_c10d

    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.executor import execute
    from sglang.srt.weight_sync.sglang_compat import TpState

    engine_update.tp_state = lambda: TpState(rank, world, world, 1, None, None)
    sync = engine_update.EngineWeightSync(rank)
    plan = whole_tensor_plan(0, {1}, world)
    store = distributed_c10d._get_default_store()
    failures = 0

    def failed_update() -> None:
        nonlocal failures
        data, refusal = sync.ready_data_group(
            plan, sync.agree_on_data_group(30.0), 30.0
        )
        assert refusal is None, refusal
        if rank == 1:
            try:
                execute(plan, 1, {}, {"p": torch.zeros(6, 4)}, data, timeout_s=0.2)
            except PeerLost:
                failures += 1

    failed_update()
    sync.control.barrier(30.0, "every rank made the first group")
    before, keys_before = held(), sorted(store.list_keys())
    for _ in range(50):
        failed_update()
    sync.control.barrier(30.0, "every rank made the last group")
    after, keys_after = held(), sorted(store.list_keys())
    sync.control.barrier(30.0, "the end")
    return dict(
        before=before,
        after=after,
        failures=failures,
        keys_before=keys_before,
        keys_after=keys_after,
    )


def _numbers_out(keys) -> list:
    """Store keys with the number of the data group, or of the barrier, each belongs to
    taken out, sorted."""
    keys = [re.sub(r"(weight_sync/group/[0-9,]+)/[0-9]+/", r"\1/N/", k) for k in keys]
    return sorted(re.sub(r"(/barrier/[0-9,]+)/[0-9]+/", r"\1/N/", k) for k in keys)


def test_fifty_failed_updates_leave_no_thread_group_or_store_key_behind():
    """Each failed wait abandons its data group at once (aborted, destroyed) and the next
    update makes a new one: after 50 of them the process holds no more threads and torch no
    more groups than after one, and the store holds the same keys but for the live group's
    number (its rendezvous: the previous group's keys go when the next one is made,
    ``control_plane.fresh_group``; the barrier marks, one per rank, replace each other)."""
    results = run_ranks(2, _failed_updates_leave_nothing)
    assert results[1]["failures"] == 51, results[1]
    for rank, r in enumerate(results):
        assert r["after"] == r["before"], (rank, r)
    keys_before, keys_after = results[0]["keys_before"], results[0]["keys_after"]
    assert len(keys_after) == len(keys_before), (keys_before, keys_after)
    assert _numbers_out(keys_after) == _numbers_out(keys_before), (
        keys_before,
        keys_after,
    )
    assert any("weight_sync/group/0,1/50/" in k for k in keys_after), keys_after


def test_a_peer_killed_mid_update_gives_an_error_within_the_bound():
    """Rehearsal on gloo of ``test/gpu/test_peer_killed.py`` (the same scenario,
    ``peer_death.killed_mid_round``): a killed peer, not one withholding its send."""
    from peer_death import BOUND_S, killed_mid_round

    results = run_ranks(2, killed_mid_round, "gloo", may_die=[1])
    r = results[0]
    assert r["first"] != "landed", r
    assert r["first"].startswith(("PeerLost: rank 0: executor round 1", "RuntimeError"))
    assert r["seconds"] < BOUND_S + 5, r
    assert r["abandoned"] and r["destroyed"] and r["alone"], r


# pr: scale
def _one_rank_missed_a_making(rank: int, world: int) -> dict:
    """Rank 0 makes the trainer's data group alone (its peer failed before it got there):
    its making runs out its bound. Then both ranks agree, as ``agree_on_inputs`` does, that
    one lacks a group and on its number (the highest proposal), make it together and a move
    lands; the store keeps the keys of that group only. A count kept per rank or in the
    store would have rank 0 one group ahead from then on: every later making would meet a
    peer under another name and run out its bound."""
    from sglang.srt.weight_sync.control_plane import _store
    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.trainer_flow import TrainerSync

    sync, out = TrainerSync(), {}
    if rank == 0:
        started = time.monotonic()
        try:
            sync.ready_data(0, BOUND_S)
            out["alone"] = "made"
        except Exception as e:  # noqa: BLE001 - what a lone making raises is asserted
            out["alone"] = f"{type(e).__name__}: {e}"
        out["alone_s"] = time.monotonic() - started
    dist.barrier()
    agreed = sync.world.agree(
        [],
        {},
        {"no data group": sync.lacks_data},
        30.0,
        f"rank {rank}: agreeing on the data group",
        {"data group number": DataGroup.number_proposal(None, sync.data_groups_made)},
    )
    out["raised"] = agreed.raised
    number = agreed.highest["data group number"]
    out["number"] = number
    data = sync.ready_data(number, 30.0)
    plan = whole_tensor_plan(0, {1}, world)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
    execute(plan, rank, {"w": full} if rank == 0 else {}, params, data, 30.0)
    out["landed"] = all(torch.equal(p, full) for p in params.values())
    dist.barrier()
    out["groups_in_store"] = sorted(
        {
            k.split("/")[3]
            for k in _store().list_keys()
            if k.startswith("weight_sync/group/")
        }
    )
    return out


def test_a_rank_that_missed_a_making_takes_its_peers_number_next():
    ahead, behind = run_ranks(2, _one_rank_missed_a_making)
    assert ahead["alone"] != "made", ahead
    assert ahead["alone_s"] < BOUND_S + 5, ahead
    assert ahead["raised"] == behind["raised"] == ("no data group",)
    assert ahead["number"] == behind["number"] == 1, (ahead, behind)
    assert ahead["landed"] and behind["landed"]
    assert ahead["groups_in_store"] == behind["groups_in_store"] == ["1"], ahead


# pr: scale end
def _control_group_alone(rank: int, world: int) -> dict:
    """Rank 0 makes an engine-style control group (a gloo group of its own) that rank 1
    never makes: ``PeerLost`` within its set-up bound, not gloo's hours-long group timeout."""
    from sglang.srt.weight_sync.control_plane import ControlGroup

    out = {}
    if rank == 0:
        started = time.monotonic()
        try:
            ControlGroup(None, "engine-0", own=True, setup_s=BOUND_S)
            out["made"] = "made"
        except PeerLost as e:
            out["made"] = str(e)
        out["seconds"] = time.monotonic() - started
    dist.barrier()
    return out


def test_a_control_group_a_rank_never_makes_is_peer_lost_within_its_bound():
    alone, _ = run_ranks(2, _control_group_alone)
    assert alone["made"].startswith(
        "making the control group 'engine-0' over ranks [0, 1]: a rank never came within "
        f"{BOUND_S:g}s"
    ), alone
    assert alone["seconds"] < BOUND_S + 3, alone


def test_a_made_group_forgets_earlier_groups_keys_never_a_later_ones():
    """Once group ``n`` is made, each rank deletes the keys groups before it left. A peer
    whose first use of group ``n`` failed at once (an unreachable NCCL root) is already
    writing its address for group ``n + 1`` while a slower rank is still here: deleting
    every other number's keys, as this did, took that address away, and both ranks then
    waited out the next making's bound (a case of a communicator init that never
    finishes, ``test_bounded_setup.py``, flaked so)."""
    from sglang.srt.weight_sync.control_plane import forget_keys

    store = dist.HashStore()
    prefix = "weight_sync/group/0,1"
    for key in ("0/rank_0", "0/rank_1", "1/rank_0", "2/rank_1", "10/rank_0", "x"):
        store.set(f"{prefix}/{key}", "addr")
    store.set("weight_sync/group/0,1,2/0/rank_0", "another group's")
    assert forget_keys(store, prefix, below=1) == 2
    assert sorted(store.list_keys()) == sorted(
        [
            f"{prefix}/1/rank_0",
            f"{prefix}/2/rank_1",
            f"{prefix}/10/rank_0",
            f"{prefix}/x",
            "weight_sync/group/0,1,2/0/rank_0",
        ]
    )
    assert forget_keys(store, prefix) == 4  # a rendezvous every rank left: all of it
    assert store.list_keys() == ["weight_sync/group/0,1,2/0/rank_0"]
