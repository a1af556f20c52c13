"""Rank functions for test_control_plane.py (importable by the forkserver workers)."""

from __future__ import annotations

import torch.distributed as dist

from sglang.srt.weight_sync.control_plane import ControlGroup, PeerLost

NCCL_BACKENDS = ("cpu:gloo,cuda:nccl", "nccl")


def _as_if(group, backend: str):
    """Make ``dist.get_backend`` report ``backend`` for ``group``, as a GPU trainer's mesh
    group reports it (this CPU build has no NCCL to create one with)."""
    real = dist.get_backend
    dist.get_backend = lambda g=None: backend if g is group else real(g)
    return real


def control_over_nccl_backends(rank: int, world: int) -> dict:
    """Over a group whose backend names NCCL, the control group runs on gloo of its own
    over the same ranks, and its collectives and monitored barriers work there."""
    out = {}
    for backend in NCCL_BACKENDS:
        group = dist.new_group(list(range(world)))
        real = _as_if(group, backend)
        try:
            control = ControlGroup(group, f"control-{backend}")
        finally:
            dist.get_backend = real
        own = control.group is not group and real(control.group) == "gloo"
        control.barrier(30, "barrier")
        out[backend] = {
            "own_gloo_group": own,
            "ranks": control.ranks,
            "device": str(control.device),
            "agree": control.all_equal(7, 30, "agree"),
            "disagree": control.all_equal(rank, 30, "disagree"),
            "any": control.any(rank == world - 1, 30, "any"),
        }
    return out


def barrier_names_absent_rank(rank: int, world: int) -> str:
    """The last rank never reaches a barrier of a control group built over an NCCL-named
    group: the others' bounded barrier names it."""
    group = dist.new_group(list(range(world)))
    real = _as_if(group, "cpu:gloo,cuda:nccl")
    try:
        control = ControlGroup(group, "absent")
    finally:
        dist.get_backend = real
    if rank == world - 1:
        return "absent"
    try:
        control.barrier(3, "test barrier")
    except PeerLost as e:
        return str(e)
    return "passed"


def delivered_names(rank: int, world: int) -> dict:
    """``delivered`` over ``world`` gloo ranks, as ``engine_update`` uses it: the digests
    compared in one ``ControlGroup.agree`` pass equal deliveries; trainer rank 2 leaving
    tensor 'b' out, and trainer rank 0 sending an extra 'z', make them unequal, and
    ``explain_delivery`` names both on every rank; ignored names do not count."""
    from sglang.srt.weight_sync.control_plane import PlanDisagreement
    from sglang.srt.weight_sync.delivered import delivery_digest, explain_delivery
    from sglang.srt.weight_sync.delivery import Payload

    def payload(names):
        return Payload("u", rank, {}, {}, {n: None for n in names})

    def agree(delivered, ignored=()):
        digest = delivery_digest(delivered, ignored)
        agreed = control.agree([], {"delivery": digest}, {}, 60, "test agreement")
        if "delivery" in agreed.unequal:
            explain_delivery(control, delivered, 60, f"rank {rank}", ignored)
            return "unequal, not explained"
        return "agreed"

    control = ControlGroup(None, "delivered")
    out = {}
    same = ["a", "b"] + (["x.rotary_emb.inv_freq"] if rank == 1 else [])
    out["same"] = agree(payload(same), ("rotary_emb.inv_freq",))
    differ = ["a"] if rank == 2 else ["a", "b"] + (["z"] if rank == 0 else [])
    try:
        out["differ"] = agree(payload(differ))
    except PlanDisagreement as e:
        out["differ"] = str(e)
    return out


def one_round_trip_agreement(rank: int, world: int) -> dict:
    """``ControlGroup.agree`` over ``world`` gloo ranks: values, flags and the absence of
    problems in one all-reduce; problems cost a second collective, and only then."""
    control = ControlGroup(None, "agree")
    out = {}
    before = control.round_trips
    quiet = control.agree(
        [],
        {"same": 7, "mine": rank},
        {"last": rank == world - 1, "never": False},
        30,
        "a",
    )
    out["quiet"] = (list(quiet.problems), list(quiet.unequal), list(quiet.raised))
    out["quiet_trips"] = control.round_trips - before
    before = control.round_trips
    loud = control.agree(
        [f"rank {rank} is unwell"] if rank == 1 else [],
        {"same": 2**61},
        {},
        30,
        "b",
    )
    out["loud"] = (list(loud.problems), list(loud.unequal))
    out["loud_trips"] = control.round_trips - before
    return out
