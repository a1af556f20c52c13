"""Rank functions for test_engine_control_group.py (importable by the forkserver workers)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch.distributed as dist


def engine_control_after_a_lost_wait(rank: int, world: int) -> dict:
    """Rank 0 gives up a vote that rank 1 reaches late; both then make a new control group.

    What gloo does with a wait given up is why the engine keeps its control collectives on
    a group of its own and renews it: the late rank completes the vote with the contribution
    of the rank that gave up (so a vote given up may still let a peer write), then finds no
    one at the closing barrier."""
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.control_plane import PeerLost
    from sglang.srt.weight_sync.sglang_compat import TpState

    engine_update.tp_state = lambda: TpState(
        rank, world, world, 1, dist.group.WORLD, None
    )
    engine_update.GRACE_S = 1.0  # the closing barrier's bound: timeout_s + 1 s here
    request = SimpleNamespace(timeout_s=1.0, update_id="u")
    sync = engine_update.EngineWeightSync(rank)
    sync.renew_control(10.0)
    first = sync.control
    out = dict(own=first.group is not dist.group.WORLD, name=first.name)
    out["warm"] = first.all_equal(1, 30, "warm")
    if rank == 0:
        start = time.monotonic()
        try:
            first.all_equal(7, 1.0, "vote")
            out["vote"] = "passed"
        except PeerLost as e:
            out["vote"] = str(e)
        out["end"] = sync.end(request, False, "failed")
        out["end_s"] = time.monotonic() - start
    else:
        time.sleep(3.0)
        out["vote"] = first.all_equal(
            7, 30, "vote"
        )  # completes with rank 0's stale vote
        out["end"] = sync.end(request, True, "Success")
    out["lost"] = first.lost is not None
    dist.barrier()
    sync.renew_control(10.0)
    out["renewed"] = sync.control is not first
    out["renamed"] = sync.control.name
    out["agree"] = sync.control.all_equal(5, 30, "after")
    sync.control.barrier(30, "closing")
    return out
