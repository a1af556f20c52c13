"""The data plane's own group, its warm-up on every rank, and point-to-point fan-out, over
gloo ranks.

What these guard against is NCCL's (a communicator made lazily by a group's first
collective, which every rank must join; an aborted communicator; one communicator per
broadcast rank set): gloo shows the decisions the code takes, counted by wrappers around
``torch.distributed``, not NCCL's failure itself.
"""

import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from held import held
from plan_samples import whole_tensor_plan
from ranks import run_ranks


def _count_collectives():
    """Wrap the collectives the data plane may call in this process; returns the log."""
    log = []
    for name in ("all_reduce", "batch_isend_irecv", "new_group", "broadcast"):
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            if _name == "batch_isend_irecv":  # the group each point-to-point op runs on
                groups = {op.group for op in args[0]}
                group = groups.pop() if len(groups) == 1 else groups
            log.append((_name, group))
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    return log


def _data_group_ranks(rank: int, world: int) -> dict:
    from sglang.srt.weight_sync.control_plane import group_timeout_s
    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S

    data = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 0)
    log = _count_collectives()
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    out = dict(
        own_group=data.group is not dist.group.WORLD,
        ranks=dist.get_process_group_ranks(data.group),
        timeout=group_timeout_s(data.group),
    )
    # update 1: rank 1 alone receives, rank 2 has no move at all
    shards = {"w": full.clone()} if rank == 0 else {}
    params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
    execute(whole_tensor_plan(0, {1}, 3), rank, shards, params, data, timeout_s=60)
    out["first"] = [(n, g is data.group) for n, g in log]
    out["connected_first"] = sorted(data.connected)
    # update 2: ranks 1 and 2 both need it (a "broadcast" move), sent point-to-point
    del log[:]
    params = {"p": torch.zeros(6, 4)} if rank else {}
    alive = [weakref.ref(t) for t in list(shards.values()) + list(params.values())]
    stats = execute(
        whole_tensor_plan(0, {1, 2}, 3), rank, shards, params, data, timeout_s=60
    )
    out["second"] = [(n, g is data.group) for n, g in log]
    out["connected_second"] = sorted(data.connected)
    out["landed"] = all(torch.equal(p, full) for p in params.values())
    out["broadcasts"], out["sent"] = stats.broadcasts, stats.bytes_sent
    del shards, params
    gc.collect()
    out["held_after"] = sum(ref() is not None for ref in alive)
    dist.barrier()
    return out


def test_the_data_plane_runs_on_its_own_group_warmed_up_on_every_rank():
    results = run_ranks(3, _data_group_ranks)
    for rank, r in enumerate(results):
        assert r["own_group"] and r["ranks"] == [0, 1, 2], r
        assert r["timeout"] is not None and r["timeout"] > 7200, r
        # the first update: one warm-up all-reduce on the data group, on every rank,
        # the rank without a move (2) included; on the ranks of the plan's one pair (0 ->
        # 1) a batch that connects them, then the round's batch
        batch = ("batch_isend_irecv", True)
        expected = [("all_reduce", True)] + ([batch, batch] if rank in (0, 1) else [])
        assert r["first"] == expected, (rank, r["first"])
        assert r["connected_first"] == ([(0, 1)] if rank in (0, 1) else []), r
        # the second: no second warm-up, no new group, no broadcast subgroup; the new
        # pair (0 -> 2) is connected first, on its two ranks only
        expected = [batch, batch] if rank in (0, 2) else [batch]
        assert r["second"] == expected, (rank, r["second"])
        assert r["connected_second"] == (
            [(0, 1), (0, 2)] if rank == 0 else [(0, rank)]
        ), r
        assert r["landed"] and r["broadcasts"] == 1, r
        assert r["held_after"] == 0, f"rank {rank} keeps an update's tensors alive"
    assert results[0]["sent"] == 2 * 6 * 4 * 4  # the region once per receiver


def _engine_renews_together(rank: int, world: int) -> dict:
    """The engine's data group, with SGLang's TP state faked as the gloo world."""
    from sglang.srt.weight_sync import engine_update
    from sglang.srt.weight_sync.control_plane import group_timeout_s
    from sglang.srt.weight_sync.sglang_compat import TpState

    engine_update.tp_state = lambda: TpState(rank, world, world, 1, None, None)
    sync = engine_update.EngineWeightSync(rank)
    first = sync.data_group(30.0, sync.agree_on_data_group(30.0))
    again = sync.data_group(30.0, sync.agree_on_data_group(30.0))
    out = dict(
        kept=again is first,
        timeout=group_timeout_s(first.group),
        serving_untouched=first.group is not dist.group.WORLD,
    )
    if rank == 0:  # a failed wait on rank 0 only: it drops its group
        sync.drop_data_group()
    renewed = sync.data_group(30.0, sync.agree_on_data_group(30.0))
    out["renewed"] = renewed is not first
    flag = torch.ones(1)
    dist.all_reduce(flag, group=renewed.group)
    out["sum"] = flag.item()
    dist.barrier()
    return out


def test_the_engine_makes_its_data_group_once_and_anew_on_every_rank_together():
    """A rank that dropped its group after a failed wait makes every TP rank make a new
    one at the next update (one control all-reduce first), so they never diverge."""
    for r in run_ranks(2, _engine_renews_together):
        assert r["kept"] and r["serving_untouched"], r
        assert r["timeout"] > 7200, r
        assert r["renewed"] and r["sum"] == 2.0, r


def _abandoned_groups_leave_nothing(rank: int, world: int) -> dict:
    """50 data groups made, used for one update and abandoned (what the engine does after
    each failed wait); what this process holds afterwards against what it held after one."""

    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S

    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    plan = whole_tensor_plan(0, {1}, world)

    made = iter(range(1000))

    def cycle() -> bool:
        data = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, next(made))
        shards = {"w": full} if rank == 0 else {}
        params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
        execute(plan, rank, shards, params, data, timeout_s=60)
        data.abandon()
        return all(torch.equal(p, full) for p in params.values())

    landed = (
        cycle()
    )  # once first: what a process starts once (the store's threads) is up
    before = held()
    for _ in range(50):
        landed = cycle() and landed
    after = held()
    dist.barrier()
    return dict(before=before, after=after, landed=landed)


def test_abandoned_data_groups_leave_no_thread_or_group_behind():
    """An abandoned data group is aborted and destroyed: 50 of them, each after an update,
    leave this process no more threads (gloo's workers; NCCL's watchdog and heartbeat
    monitor on GPUs) and torch no more process groups than one did."""
    for rank, r in enumerate(run_ranks(3, _abandoned_groups_leave_nothing)):
        assert r["landed"], rank
        assert r["after"] == r["before"], (rank, r)


def _set_up_fails_on_one_rank(rank: int, world: int, where: str) -> dict:
    """The engine's data group made ready before the commit vote (``ready_data_group``),
    with ``where`` (``warm_up`` or ``connect``) raising on rank 1 only, as an NCCL init or
    P2P setup that fails there; then the next update, with SGLang's TP state faked as the
    gloo world."""
    from sglang.srt.weight_sync import control_plane, engine_update
    from sglang.srt.weight_sync.executor import DataGroup, execute
    from sglang.srt.weight_sync.protocol import REFUSED
    from sglang.srt.weight_sync.sglang_compat import TpState

    engine_update.tp_state = lambda: TpState(rank, world, world, 1, None, None)
    sync = engine_update.EngineWeightSync(rank)
    plan = whole_tensor_plan(0, {1}, world)
    owner = control_plane if where == "join_group" else DataGroup
    if rank == 1:
        original = getattr(owner, where)

        def broken(*args, **kwargs):
            # joining: its peers cannot reach it and wait in gloo's connect
            if where == "join_group":
                time.sleep(3.0)
            raise RuntimeError(f"injected {where} failure")

        setattr(owner, where, broken)
    started = time.monotonic()
    first, refusal = sync.ready_data_group(plan, sync.agree_on_data_group(2.0), 2.0)
    out = dict(
        seconds=time.monotonic() - started,
        refused=refusal is not None and refusal.startswith(REFUSED),
        refusal=refusal,
        group=first,
        dropped=sync._data is None,
    )
    if rank == 1:
        setattr(owner, where, original)
    data, again = sync.ready_data_group(plan, sync.agree_on_data_group(30.0), 30.0)
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    shards = {"w": full} if rank == 0 else {}
    params = {"p": torch.zeros(6, 4)} if rank == 1 else {}
    execute(plan, rank, shards, params, data, timeout_s=30)
    out.update(
        second=again,
        renewed=data is not None and data.own,
        landed=all(torch.equal(p, full) for p in params.values()),
        ready_again=sync.ready_data_group(plan, None, 30.0) == (data, None),
    )
    del out["group"]
    dist.barrier()
    return out


@pytest.mark.parametrize("where", ["warm_up", "connect", "join_group"])
def test_a_set_up_failing_on_one_rank_is_a_refusal_and_the_group_renewed(where):
    """A data group whose warm-up or connection fails on one engine rank (an NCCL
    communicator or P2P setup that fails there), or that one rank never makes (its peers
    wait in gloo's connect: within the update's bound, not the group's timeout of hours), is
    a refusal on every rank before the commit vote (``REFUSED``, nothing written, never
    ``mixed``), naming the rank; every rank drops the group, and the next update makes a
    new one and lands."""
    results = run_ranks(3, _set_up_fails_on_one_rank, where)
    for rank, r in enumerate(results):
        assert r["refused"] and r["dropped"], (rank, r)
        assert "engine rank 1" in r["refusal"], r["refusal"]
        assert f"injected {where} failure" in r["refusal"], r["refusal"]
        assert r["seconds"] < 15, r
        assert r["second"] is None and r["renewed"] and r["landed"], (rank, r)
        assert r["ready_again"], "a group set up for the plan costs no agreement"


def _packed_ranks(rank: int, world: int) -> dict:
    """Rank 0 holds 64 small fp32 tensors and one of 1 MiB; rank 1 needs them all, half
    in bf16, one landing in the right half of a wider parameter (not contiguous there)."""
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.executor import PACK_BELOW, DataGroup, execute
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    g = torch.Generator().manual_seed(7)
    full = {f"e{i}": torch.randn(6, 4, generator=g) for i in range(64)}
    full["big"] = torch.randn(PACK_BELOW // 4, generator=g)
    sources = {
        n: MeshSpec.full(tuple(t.shape), torch.float32, [0]).describe(n)
        for n, t in full.items()
    }
    targets = [
        ParamTarget(
            f"p{i}",
            (6, 4),
            torch.bfloat16 if i % 2 else torch.float32,
            (Piece(f"e{i}", Box((0, 0), (6, 4)), (), (0, 0)),),
        )
        for i in range(1, 64)
    ]
    targets.append(
        ParamTarget(
            "wide",
            (6, 8),
            torch.float32,
            (Piece("e0", Box((0, 0), (6, 4)), (), (0, 4)),),
        )
    )
    targets.append(
        ParamTarget(
            "big",
            (PACK_BELOW // 4,),
            torch.float32,
            (Piece("big", Box((0,), (PACK_BELOW // 4,)), (), (0,)),),
        )
    )
    the_plan = plan(sources, {0: [], 1: targets})
    data = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 0)
    shards = dict(full) if rank == 0 else {}
    params = (
        {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in targets} if rank else {}
    )
    stats = execute(the_plan, rank, shards, params, data, timeout_s=60)
    exact = rank == 0 or (
        all(
            torch.equal(params[f"p{i}"], full[f"e{i}"].to(params[f"p{i}"].dtype))
            for i in range(1, 64)
        )
        and torch.equal(params["wide"][:, 4:], full["e0"])
        and not params["wide"][:, :4].any()
        and torch.equal(params["big"], full["big"])
    )
    dist.barrier()
    return dict(
        p2p=stats.p2p_ops,
        rounds=len(the_plan.rounds),
        exact=exact,
        sent=stats.bytes_sent,
        received=stats.bytes_received,
    )


def test_small_moves_between_two_ranks_travel_in_one_transfer():
    """The round's 64 small regions from rank 0 to rank 1 go as one packed transfer beside
    the large one (2 point-to-point ops on each end, not 65), in mixed engine dtypes, and
    land bit-exact, the non-contiguous one too; the byte counts are the payload's."""
    sender, receiver = run_ranks(2, _packed_ranks)
    assert sender["rounds"] == 1, sender
    assert sender["p2p"] == receiver["p2p"] == 2, (sender, receiver)
    assert receiver["exact"], receiver
    # p1..p63: 32 in bf16 (odd), 31 in fp32; e0 in fp32 ("wide"); the big one, 256 KiB
    payload = 32 * 6 * 4 * 2 + 31 * 6 * 4 * 4 + 6 * 4 * 4 + (256 << 10)
    assert sender["sent"] == receiver["received"] == payload, (sender, receiver)


# pr: remote
def _cast_moves(rank: int, world: int, pack_casts: bool) -> dict:
    """Rank 0 holds eight fp32 tensors of 512 KiB (each above ``PACK_BELOW`` in bf16 too)
    and one bf16 tensor as large; rank 1 stages every region (a remote engine's
    ``Deferred``) and needs them all in bf16, then writes them."""
    from sglang.srt.weight_sync.box import Box
    from sglang.srt.weight_sync.executor import (
        PACK_BELOW,
        DataGroup,
        Deferred,
        execute,
        write_landings,
    )
    from sglang.srt.weight_sync.planner import plan
    from sglang.srt.weight_sync.protocol import DATA_GROUP_TIMEOUT_S
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.target_layout import ParamTarget, Piece

    n = PACK_BELOW // 2
    g = torch.Generator().manual_seed(11)
    full = {f"e{i}": torch.randn(n, generator=g) for i in range(8)}
    full["same"] = torch.randn(n, generator=g).to(torch.bfloat16)
    sources = {
        name: MeshSpec.full((n,), t.dtype, [0]).describe(name)
        for name, t in full.items()
    }
    targets = [
        ParamTarget(
            name, (n,), torch.bfloat16, (Piece(name, Box((0,), (n,)), (), (0,)),)
        )
        for name in full
    ]
    the_plan = plan(sources, {0: [], 1: targets})
    data = DataGroup.over_ranks_of(None, DATA_GROUP_TIMEOUT_S, 0)
    shards = dict(full) if rank == 0 else {}
    params = {t.name: torch.zeros(n, dtype=torch.bfloat16) for t in targets}
    landed = []
    staging = type("Collect", (Deferred,), {"landed": lambda _, xs: landed.extend(xs)})
    stats = execute(
        the_plan,
        rank,
        shards,
        params if rank else {},
        data,
        timeout_s=60,
        deferred=staging() if rank else None,
        pack_casts=pack_casts,
    )
    write_landings(params, landed)
    exact = rank == 0 or all(
        torch.equal(params[name], t.to(torch.bfloat16)) for name, t in full.items()
    )
    dist.barrier()
    return dict(p2p=stats.p2p_ops, exact=exact, sent=stats.bytes_sent)


@pytest.mark.parametrize("pack_casts", [False, True])
def test_regions_a_sender_casts_travel_in_one_pack_to_a_staging_receiver(pack_casts):
    """With ``pack_casts`` (a remote group: every engine rank stages what it receives), the
    eight regions rank 0 casts to bf16 travel in one transfer whatever their size, beside
    the one it sends as it is (2 operations on each end, not 9); every region lands
    bit-exact and the bytes are the payload's either way."""
    sender, receiver = run_ranks(2, _cast_moves, pack_casts)
    assert sender["p2p"] == receiver["p2p"] == (2 if pack_casts else 9), (
        sender,
        receiver,
    )
    assert receiver["exact"], receiver
    assert sender["sent"] == 9 * (256 << 10), sender


# pr: remote end
