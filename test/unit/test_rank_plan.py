"""Rank-local planning (``rank_plan.plan_for_rank``) on random shapes and layouts.

Every rank plans alone. The plans must fit together into one global plan: each move
is computed identically, in the same round, by its sender and its receiver, and no
rank plans a move it takes no part in; replaying the union on index-encoded tensors
writes every destination element exactly once with the right data from a rank that
holds it; each rank receives exactly (needed - held) bytes, checked independently;
no rank receives more than half the cap (plus a row) in a round.
"""

from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given, settings
from plan_properties import check_plan, covers, scenarios
from torch.distributed.tensor.placement_types import Replicate, Shard

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.planner import (
    CoverageError,
    Plan,
    Topology,
    box_index,
    name_order,
    plan,
)
from sglang.srt.weight_sync.rank_plan import Receivers, plan_for_rank
from sglang.srt.weight_sync.source_layout import SourceTensor, describe_mesh
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece


def _key(m):
    return (m.tensor, m.region, m.holder, m.dtype, m.dests)


def union(plans, bucket):
    """The global plan the rank-local plans restrict; asserts they agree on every move."""
    seen = defaultdict(set)  # (move key, round id) -> ranks that planned it
    for rank, p in plans.items():
        assert len(p.round_ids) == len(p.rounds) and list(p.round_ids) == sorted(
            set(p.round_ids)
        )
        for m in p.local:
            assert m.src == rank and [d.rank for d in m.dests] == [rank]
        for rid, rnd in zip(p.round_ids, p.rounds):
            for m in rnd:
                assert rank in m.group, (
                    f"rank {rank} planned a move it takes no part in: {m}"
                )
                assert len({d.rank for d in m.dests}) == 1 and m.src not in {
                    d.rank for d in m.dests
                }
                seen[(_key(m), rid)].add(rank)
    by_round = defaultdict(list)
    for (key, rid), ranks in seen.items():
        assert ranks == {key[2].rank, key[4][0].rank}, (
            f"move planned by {ranks} only: {key}"
        )
        by_round[rid].append(key)
    moves = {
        (_key(m), rid): m
        for p in plans.values()
        for rid, rnd in zip(p.round_ids, p.rounds)
        for m in rnd
    }
    rounds = tuple(
        tuple(moves[(k, rid)] for k in sorted(keys, key=repr))
        for rid, keys in sorted(by_round.items())
    )
    return Plan(
        tuple(m for p in plans.values() for m in p.local),
        rounds,
        tuple(z for p in plans.values() for z in p.zero_fills),
        (),
        {r: p.needed_bytes[r] for r, p in plans.items()},
        {r: p.held_bytes[r] for r, p in plans.items()},
        bucket,
        "",
    )


def check_cap(plans, bucket, row_max):
    for rank, p in plans.items():
        for rnd in p.rounds:
            received = sum(m.nbytes for m in rnd for d in m.dests if d.rank == rank)
            assert received <= bucket // 2 + row_max, (
                f"rank {rank} receives {received} in a round"
            )


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_local_plans_restrict_one_consistent_global_plan(case):
    sources, fulls, targets, bucket = case
    receivers = Receivers.of(targets)
    if not covers(sources, targets):
        with pytest.raises(CoverageError, match=r"tensor 't\d' box .* on rank \d+"):
            for rank in targets:
                plan_for_rank(sources, receivers, rank, bucket_bytes=bucket)
        return
    plans = {
        rank: plan_for_rank(sources, receivers, rank, bucket_bytes=bucket)
        for rank in targets
    }
    assert len({p.fingerprint for p in plans.values()}) == 1
    whole = union(plans, bucket)
    check_plan(whole, sources, fulls, targets)
    check_cap(plans, bucket, 7 * 7 * 4)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_same_plans_from_any_grouping_of_ranks(case):
    """Classes are an index, not an input: one class per rank plans the same moves."""
    sources, _, targets, bucket = case
    if not covers(sources, targets):
        return
    grouped = Receivers.of(targets)
    single = Receivers(
        tuple(tuple(targets[r]) for r in sorted(targets)),
        tuple((r,) for r in sorted(targets)),
    )
    for rank in targets:
        a = plan_for_rank(sources, grouped, rank, bucket_bytes=bucket)
        b = plan_for_rank(sources, single, rank, bucket_bytes=bucket)
        assert (a.local, a.rounds, a.round_ids, a.zero_fills) == (
            b.local,
            b.rounds,
            b.round_ids,
            b.zero_fills,
        )


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_mesh_described_and_listed_holders_plan_alike(case):
    """Tensors a mesh describes share one holder index per geometry (``MeshHolders``); the
    same holders listed one by one are indexed per tensor. Both must plan the same moves."""
    sources, _, targets, bucket = case
    if not covers(sources, targets):
        return
    listed = {
        n: SourceTensor(n, s.shape, s.dtype, tuple(s.holders))
        for n, s in sources.items()
    }
    receivers = Receivers.of(targets)
    for rank in targets:
        a = plan_for_rank(sources, receivers, rank, bucket_bytes=bucket)
        b = plan_for_rank(listed, receivers, rank, bucket_bytes=bucket)
        assert (a.local, a.rounds, a.round_ids, a.zero_fills) == (
            b.local,
            b.rounds,
            b.round_ids,
            b.zero_fills,
        )
    whole, whole_listed = (
        plan(sources, targets, bucket_bytes=bucket),
        plan(listed, targets, bucket_bytes=bucket),
    )
    assert (whole.local, whole.rounds) == (whole_listed.local, whole_listed.rounds)


def test_tensors_of_one_geometry_share_one_holder_index():
    """Sixty layers' tensors of one shape on one mesh: one geometry, indexed once, each
    tensor's holders still under its own buffer name; another shape or mesh, another."""
    mesh, places = [[0, 1, 2, 3], [4, 5, 6, 7]], (Replicate(), Shard(0))
    layers = {
        f"l{i}.w": describe_mesh(f"l{i}.w", (64, 16), torch.bfloat16, mesh, places)
        for i in range(60)
    }
    assert len({id(box_index(s)) for s in layers.values()}) == 1
    assert len({id(s.holders.geometry) for s in layers.values()}) == 1
    assert [h.buffer for h in layers["l7.w"].holders] == ["l7.w"] * 8
    other_shape = describe_mesh("x", (64, 8), torch.bfloat16, mesh, places)
    other_mesh = describe_mesh(
        "y", (64, 16), torch.bfloat16, [[0, 1, 2, 3], [4, 5, 7, 6]], places
    )
    assert (
        len({id(box_index(s)) for s in (layers["l0.w"], other_shape, other_mesh)}) == 3
    )
    need = {
        r: [
            ParamTarget(
                f"p{i}",
                (32, 16),
                torch.bfloat16,
                (Piece(f"l{i}.w", Box((32 * (r % 2), 0), (32, 16)), (), (0, 0)),),
            )
            for i in range(60)
        ]
        for r in range(8)
    }
    p = plan_for_rank(layers, Receivers.of(need), 1)
    moves = [m for rnd in p.rounds for m in rnd]
    assert {m.holder.buffer for m in moves} == set(layers) and p.received_bytes(
        1
    ) == p.lower_bound_bytes(1)


def _replicated(world_holders, receivers, shape=(4, 4)):
    src = {"w": describe_mesh("w", shape, torch.float32, world_holders, (Replicate(),))}
    need = {
        r: [
            ParamTarget(
                "p", shape, torch.float32, (Piece("w", Box.full(shape), (), (0, 0)),)
            )
        ]
        for r in receivers
    }
    return src, need


def test_replicas_share_the_sending():
    """Eight ranks need a tensor that four DP replicas hold across nodes: every replica serves some."""
    src, need = _replicated([0, 1, 2, 3], range(4, 12))
    receivers = Receivers.of(need)
    sends = Counter(
        m.src
        for r in range(4, 12)
        for rnd in plan_for_rank(src, receivers, r).rounds
        for m in rnd
    )
    assert set(sends) == {0, 1, 2, 3} and sum(sends.values()) == 8


def test_closest_replica_sends():
    src, need = _replicated([0, 1], [2, 3])
    topology = Topology(node_of={0: 0, 1: 1, 2: 1, 3: 0})
    receivers = Receivers.of(need)
    for rank, expect in ((2, 1), (3, 0)):
        (rnd,) = plan_for_rank(src, receivers, rank, topology).rounds
        assert [m.src for m in rnd] == [expect]


def test_a_rank_plans_only_its_own_moves():
    """FSDP over 64 ranks, every rank needs the whole tensor (an all-gather): a rank plans
    its 63 receives and its 63 sends, never the other 63 x 62 moves."""
    src = {
        "w": describe_mesh("w", (64, 8), torch.float32, list(range(64)), (Shard(0),))
    }
    need = {
        r: [
            ParamTarget(
                "p",
                (64, 8),
                torch.bfloat16,
                (Piece("w", Box.full((64, 8)), (), (0, 0)),),
            )
        ]
        for r in range(64)
    }
    p = plan_for_rank(src, Receivers.of(need), 5)
    moves = [m for rnd in p.rounds for m in rnd]
    assert (
        sum(m.src == 5 for m in moves) == 63
        and sum(m.dests[0].rank == 5 for m in moves) == 63
    )
    assert (
        len(moves) == 126
        and p.lower_bound_bytes(5) == p.received_bytes(5) == 63 * 8 * 2
    )


def test_uncovered_box_names_tensor_box_and_rank():
    src = {"w": describe_mesh("w", (8, 4), torch.float32, [0, 1], (Shard(0),))}
    src["w"] = type(src["w"])("w", (8, 4), torch.float32, src["w"].holders[:1])
    need = {
        1: [
            ParamTarget(
                "p", (8, 4), torch.float32, (Piece("w", Box.full((8, 4)), (), (0, 0)),)
            )
        ]
    }
    with pytest.raises(
        CoverageError, match=r"tensor 'w' box \[4:8, 0:4\] \(for p on rank 1\)"
    ):
        plan_for_rank(src, Receivers.of(need), 1)


def test_name_order_sorts_numbers_as_numbers_and_is_total():
    names = [
        "layers.10.experts.2",
        "layers.2.experts.10",
        "layers.2.experts.9",
        "x01",
        "x1",
    ]
    assert sorted(names, key=name_order) == [
        "layers.2.experts.9",
        "layers.2.experts.10",
        "layers.10.experts.2",
        "x01",
        "x1",
    ]
    assert name_order("x01") != name_order("x1")


def test_both_planners_move_a_fused_weights_pieces_in_the_order_they_lie():
    """A fused expert weight whose pieces were recorded in name order (experts 0, 1, 10,
    11, 2, ...): both planners list each rank's moves into it in the order the experts lie
    in it, so that the copies of consecutive experts join (``copy_program``)."""
    experts = 12
    src = {
        f"e.{i}.w": describe_mesh(
            f"e.{i}.w", (4, 3), torch.float32, [0, 1], (Shard(0),)
        )
        for i in range(experts)
    }
    pieces = tuple(
        Piece(n, Box.full((4, 3)), (int(n.split(".")[1]),), (0, 0)) for n in sorted(src)
    )
    assert [p.index[0] for p in pieces][:4] == [0, 1, 10, 11]
    need = {
        r: [ParamTarget("w13", (experts, 4, 3), torch.bfloat16, pieces)] for r in (0, 1)
    }

    def order(p, rank):
        local = [m.dests[0].index[0] for m in p.local if m.dests[0].rank == rank]
        received = [
            d.index[0]
            for rnd in p.rounds
            for m in rnd
            for d in m.dests
            if d.rank == rank
        ]
        return local, received

    for rank in (0, 1):
        for p in (plan(src, need), plan_for_rank(src, Receivers.of(need), rank)):
            local, received = order(p, rank)
            assert local == list(range(experts)) and received == list(range(experts))
