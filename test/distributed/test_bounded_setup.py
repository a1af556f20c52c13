"""NCCL's set-up that blocks the host (communicator init in the warm-up, a pair's first
connection) runs within the update's bound: ``setup_bound.issue_within`` and
``executor.DataGroup.issue``.

On gloo nothing blocks the host there, so the blocking is NCCL's as the data plane meets it,
stood in for: the call that posts the warm-up's all-reduce blocks (NCCL's bootstrap root
waiting for a rank that never comes) on one rank and fails at once (the rank that cannot
reach the root) on the other. What NCCL itself does there needs GPUs (docs/gpu.md).
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from plan_samples import whole_tensor_plan
from ranks import run_ranks

from sglang.srt.weight_sync.control_plane import PeerLost
from sglang.srt.weight_sync.setup_bound import SetUpStranded, issue_within

BOUND_S = 2.0


def test_a_call_that_returns_in_time_gives_its_result_or_its_error():
    late = []
    assert issue_within(lambda: 7, 5.0, None, lambda: late.append(1)) == 7
    with pytest.raises(ValueError, match="no route"):
        issue_within(_raise, 5.0, None, lambda: late.append(1))
    assert not late


def _raise():
    raise ValueError("no route to the bootstrap root")


def test_a_call_stuck_past_the_bound_is_left_to_its_thread_which_cleans_up_after():
    """The caller hears ``SetUpStranded`` within the bound; the call's thread runs ``late``
    (the owner's abort) once the call comes back, and only then."""
    release, late = threading.Event(), []
    started = time.monotonic()
    with pytest.raises(SetUpStranded, match="did not return within 0.3s"):
        issue_within(lambda: release.wait(30), 0.3, None, lambda: late.append(1))
    assert 0.3 <= time.monotonic() - started < 2.0
    assert not late, "nothing touches the group while the call is inside NCCL"
    release.set()
    deadline = time.monotonic() + 5
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == [1]


def _set_up_never_finished(rank: int, world: int) -> dict:
    """Rank 0's warm-up blocks inside the call that makes the communicator (the bootstrap
    root waiting), rank 1's fails at once (it cannot reach the root): both end within the
    bound, naming the phase, rank 0's group left to the stuck call (aborted when it comes
    back), rank 1's abandoned and destroyed. Then both make a new group and a move lands."""
    from torch.distributed import distributed_c10d

    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S

    data = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 0, 30.0)
    data.polled = True  # as on a GPU: set-up on a thread, waits polled
    real, release = dist.all_reduce, threading.Event()

    def stuck(*args, **kwargs):
        release.wait(60)
        raise RuntimeError("NCCL error: bootstrap: a rank never connected")

    def unreachable(*args, **kwargs):
        raise RuntimeError("NCCL error: bootstrap: connecting to the root failed")

    dist.all_reduce = stuck if rank == 0 else unreachable
    out = {}
    started = time.monotonic()
    try:
        data.warm_up(BOUND_S, f"rank {rank}: executor")
        out["first"] = "warm"
    except RuntimeError as e:
        out["first"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - started
    dist.all_reduce = real
    out["lost"], out["abandoned"] = data.lost, data.abandoned
    out["destroyed"] = data.group not in distributed_c10d._world.pg_map
    stranded = [
        t for t in threading.enumerate() if t.name.startswith("weight-sync set-up")
    ]
    out["stranded"] = len(stranded)
    release.set()
    for t in stranded:
        t.join(10)
    out["stranded_after"] = sum(t.is_alive() for t in stranded)

    renewed = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 1, 30.0)
    plan = whole_tensor_plan(0, {1}, world)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
    execute(plan, rank, {"w": full} if rank == 0 else {}, params, renewed, 30.0)
    out["landed"] = all(torch.equal(p, full) for p in params.values())
    return out


def test_a_communicator_init_that_never_finishes_ends_within_the_bound_everywhere():
    stuck, unreachable = run_ranks(2, _set_up_never_finished)
    assert stuck["first"].startswith("PeerLost: rank 0: executor (warming up"), stuck
    assert "making its communicator" in stuck["first"], stuck
    assert f"did not return within {BOUND_S:g}s" in stuck["first"], stuck
    assert BOUND_S <= stuck["seconds"] < BOUND_S + 2, stuck
    assert stuck["abandoned"] and not stuck["destroyed"], "left to the stuck call"
    assert stuck["stranded"] == 1 and stuck["stranded_after"] == 0, stuck
    assert unreachable["first"].startswith("RuntimeError: NCCL error"), unreachable
    assert unreachable["seconds"] < BOUND_S, "it failed at once, no bound waited"
    assert unreachable["abandoned"] and unreachable["destroyed"], unreachable
    assert unreachable["stranded"] == 0
    for r in (stuck, unreachable):
        assert r["landed"], r


def test_peer_lost_is_what_a_stranded_set_up_raises():
    """The owners' failure paths (a refusal before the commit vote, a failed remote or
    trainer-side update) handle ``PeerLost``: a stranded set-up reaches them as one."""
    from sglang.srt.weight_sync.executor import DataGroup

    data = DataGroup(None, device=torch.device("cpu"), polled=True)
    release = threading.Event()
    with pytest.raises(PeerLost, match="rank 3: connecting.*did not return within"):
        data.issue(lambda: release.wait(30), 0.2, "rank 3: connecting")
    assert data.abandoned and data.lost.startswith("rank 3: connecting")
    release.set()


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
    waited out the next making's bound (the flaky ``never_finishes`` case above)."""
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
