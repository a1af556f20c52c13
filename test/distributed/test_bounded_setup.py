"""NCCL's set-up that blocks the host (communicator init in the warm-up, a pair's first
connection) runs within the update's bound: ``setup_bound.issue_within`` and
``executor.DataGroup.issue``; a NCCL data group is made with a watchdog that never ends the
process (``nccl_watchdog.data_plane_env``).

On gloo nothing blocks the host there, so the blocking is NCCL's as the data plane meets it,
stood in for: the call that posts the warm-up's all-reduce blocks (NCCL's bootstrap root
waiting for a rank that never comes) on one rank and fails at once (the rank that cannot
reach the root) on the other. What NCCL itself does there needs GPUs (docs/gpu.md).
"""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from plan_samples import whole_tensor_plan
from ranks import run_ranks

from sglang.srt.weight_sync.control_plane import PeerLost
from sglang.srt.weight_sync.nccl_watchdog import (
    DATA_PLANE_ENV,
    data_plane_env,
    watchdog_settings,
)
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


def test_nccl_data_groups_are_made_with_a_watchdog_that_never_ends_the_process(
    monkeypatch,
):
    """Under ``data_plane_env`` a NCCL group reads CleanUpOnly error handling, no dump
    signal, no monitor of its own; the environment is restored after; gloo is untouched."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    assert watchdog_settings().tears_down
    with data_plane_env("cpu:gloo,cuda:nccl") as settings:
        assert not settings.tears_down and not settings.dump_on_timeout
        assert not settings.monitoring
        assert all(os.environ[k] == v for k, v in DATA_PLANE_ENV.items())
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    with data_plane_env("gloo") as settings:
        assert settings is None
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_a_nccl_group_whose_watchdog_would_end_the_process_is_refused_unmade(
    monkeypatch,
):
    """``join_group`` reads the settings a NCCL group would be made with and refuses, before
    making it, a watchdog that would rethrow and end the process on an error it finds
    (TearDown); the process's environment is restored after the refusal."""
    from torch.distributed import distributed_c10d

    from sglang.srt.weight_sync import nccl_watchdog
    from sglang.srt.weight_sync.control_plane import BoundTooLong, join_group

    monkeypatch.setitem(
        nccl_watchdog.DATA_PLANE_ENV, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"
    )
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)

    def never(*args, **kwargs):
        raise AssertionError("the group was made")

    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", never)
    with pytest.raises(BoundTooLong) as e:
        join_group(dist.HashStore(), "weights", 0, 2, "nccl", 60.0)
    assert str(e.value) == (
        "group 'weights': its NCCL watchdog would read TORCH_NCCL_ASYNC_ERROR_HANDLING=3 "
        "and end the process on an error it finds"
    )
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
