"""Property tests of the planner on random shapes and layouts (pure, no processes).

A plan is replayed symbolically on index-encoded tensors (pieces landing plain or
permuted): every destination element must be written exactly once, with the right source element, from a
rank that really holds it; each rank must receive exactly (needed - held)
bytes, with ``held`` computed here independently; the same inputs in any
order must give the same plan.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_properties import check_plan, covers, scenarios
from torch.distributed.tensor.placement_types import Replicate, Shard

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.planner import CoverageError, plan
from sglang.srt.weight_sync.source_layout import describe_mesh
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_exact_single_coverage_and_minimal_bytes(case):
    sources, fulls, targets, bucket = case
    if not covers(sources, targets):
        with pytest.raises(CoverageError, match=r"tensor 't\d' box .* on rank \d+"):
            plan(sources, targets, bucket_bytes=bucket)
        return
    p = plan(sources, targets, bucket_bytes=bucket)
    check_plan(p, sources, fulls, targets)
    for rnd in (
        p.rounds
    ):  # no rank moves more than the cap in one round (rows never exceed 7*7*4 bytes)
        load = {}
        for m in rnd:
            for r in set(m.group):
                load[r] = load.get(r, 0) + m.nbytes
        assert all(v <= max(bucket, 7 * 7 * 4) for v in load.values())


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_deterministic_regardless_of_input_order(case, rnd: random.Random):
    sources, fulls, targets, bucket = case
    if not covers(sources, targets):
        return
    shuffled = list(sources.items())
    rnd.shuffle(shuffled)
    ranks = list(targets.items())
    rnd.shuffle(ranks)
    a = plan(sources, targets, bucket_bytes=bucket)
    b = plan(dict(shuffled), dict(ranks), bucket_bytes=bucket)
    assert a.fingerprint == b.fingerprint
    assert a == b


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_listing_one_ranks_local_copies_changes_nothing_else(case):
    """An engine rank lists only its own local copies (``local_ranks``): the same rounds,
    zero fills, byte counts and fingerprint, and exactly its share of the local copies."""
    sources, fulls, targets, bucket = case
    if not covers(sources, targets):
        return
    whole = plan(sources, targets, bucket_bytes=bucket)
    for rank in targets:
        mine = plan(sources, targets, bucket_bytes=bucket, local_ranks=(rank,))
        assert (
            mine.local
            == tuple(m for m in whole.local if m.src == rank)
            == tuple(whole.local_for(rank))
        )
        assert (
            mine.rounds,
            mine.zero_fills,
            mine.needed_bytes,
            mine.held_bytes,
            mine.fingerprint,
        ) == (
            whole.rounds,
            whole.zero_fills,
            whole.needed_bytes,
            whole.held_bytes,
            whole.fingerprint,
        )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), min_size=2, max_size=4, unique=True),
            st.integers(0, 100),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_least_loaded_holder_is_the_minimum_of_the_loads(picks):
    """The heap that picks a sender among equally close holders agrees with a plain minimum
    over (bytes sent so far, rank) while loads grow between picks."""
    from collections import defaultdict

    from sglang.srt.weight_sync.planner import LeastLoaded

    sent = defaultdict(int)
    least = LeastLoaded(sent)
    for near, nbytes in picks:
        expected = min(near, key=lambda r: (sent.get(r, 0), r))
        assert least.pick(near) == expected
        sent[expected] += nbytes


def test_a_rank_holding_several_boxes_copies_from_the_one_that_covers_the_need():
    """Listed holders (Megatron-core fused buffers) can give a rank several boxes of one tensor:
    a need inside one of them is a local copy from it, a need across them is split, and only
    what the rank does not hold arrives."""
    from sglang.srt.weight_sync.source_layout import Holder, SourceTensor

    holders = tuple(
        Holder(rank, Box((row, 0), (2, 4)), "w", (i * 2, 0), (4, 4))
        for rank, rows in ((0, (0, 4)), (1, (2, 6)))
        for i, row in enumerate(rows)
    )
    src = {"w": SourceTensor("w", (8, 4), torch.float32, holders)}
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    need = {
        0: [
            ParamTarget(
                "inside",
                (2, 4),
                torch.float32,
                (Piece("w", Box((4, 0), (2, 4)), (), (0, 0)),),
            ),
            ParamTarget(
                "across",
                (4, 4),
                torch.float32,
                (Piece("w", Box((0, 0), (4, 4)), (), (0, 0)),),
            ),
        ]
    }
    p = plan(src, need)
    assert [(m.region, m.holder.offsets) for m in p.local] == [
        (Box((4, 0), (2, 4)), (2, 0)),
        (Box((0, 0), (2, 4)), (0, 0)),
    ]
    assert [(m.src, m.region) for rnd in p.rounds for m in rnd] == [
        (1, Box((2, 0), (2, 4)))
    ]
    assert p.received_bytes(0) == p.lower_bound_bytes(0) == 2 * 4 * 4
    buffers = {
        0: {"w": torch.cat([full[0:2], full[4:6]])},
        1: {"w": torch.cat([full[2:4], full[6:8]])},
    }
    params = {"inside": torch.zeros(2, 4), "across": torch.zeros(4, 4)}
    for (
        m
    ) in p.local:  # rank 0's local copies, replayed as the executor reads its buffer
        d = m.dests[0]
        params[d.param][d.box(m.region).slices()] = buffers[0]["w"][
            m.src_box().slices()
        ]
    for m in (m for rnd in p.rounds for m in rnd):
        d = m.dests[0]
        params[d.param][d.box(m.region).slices()] = buffers[m.src]["w"][
            m.src_box().slices()
        ]
    assert torch.equal(params["inside"], full[4:6]) and torch.equal(
        params["across"], full[0:4]
    )


def test_uncovered_box_names_tensor_box_and_rank():
    src = {"w": describe_mesh("w", (8, 4), torch.float32, [0, 1], (Shard(0),))}
    src["w"] = type(src["w"])(
        "w", (8, 4), torch.float32, src["w"].holders[:1]
    )  # rank 1's half is missing
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
        plan(src, need)


def test_replicas_share_the_sending():
    """Four ranks need a tensor that two DP replicas hold: each replica serves two of them."""
    src = {"w": describe_mesh("w", (4, 4), torch.float32, [0, 1], (Replicate(),))}
    need = {
        r: [
            ParamTarget(
                "p", (4, 4), torch.float32, (Piece("w", Box.full((4, 4)), (), (0, 0)),)
            )
        ]
        for r in range(2, 6)
    }
    p = plan(src, need)
    served = {m.src: sorted(d.rank for d in m.dests) for rnd in p.rounds for m in rnd}
    assert served == {0: [2, 4], 1: [3, 5]}


def test_identical_needs_become_one_broadcast():
    src = {"w": describe_mesh("w", (4, 4), torch.float32, [0], (Replicate(),))}
    need = {
        r: [
            ParamTarget(
                "p", (4, 4), torch.float32, (Piece("w", Box.full((4, 4)), (), (0, 0)),)
            )
        ]
        for r in range(4)
    }
    p = plan(src, need)
    assert p.broadcast_groups == ((0, 1, 2, 3),)
    assert [len(m.dests) for rnd in p.rounds for m in rnd] == [3]


def test_plan_cache_reuses_plans_for_unchanged_layouts():
    from sglang.srt.weight_sync.planner import PlanCache

    src = {"w": describe_mesh("w", (4, 4), torch.float32, [0, 1], (Shard(0),))}
    need = {
        r: [
            ParamTarget(
                "p",
                (2, 4),
                torch.float32,
                (Piece("w", Box((2 * r, 0), (2, 4)), (), (0, 0)),),
            )
        ]
        for r in (0, 1)
    }
    cache = PlanCache()
    first = cache.get(src, need)
    assert cache.get(dict(src), {r: list(t) for r, t in need.items()}) is first
    moved = {"w": describe_mesh("w", (4, 4), torch.float32, [1, 0], (Shard(0),))}
    assert cache.get(moved, need) is not first


def test_plan_cache_takes_the_engine_layouts_digest_for_its_targets(monkeypatch):
    """The engine keys its cache with its targets' digest instead of hashing every
    rank's targets on each update; the plan's fingerprint is that key (ranks agree on it),
    and a rank's own-local-copies plan is cached apart with the same fingerprint."""
    from sglang.srt.weight_sync import planner

    src = {"w": describe_mesh("w", (4, 4), torch.float32, [0, 1], (Shard(0),))}
    need = {
        r: [
            ParamTarget(
                "p", (4, 4), torch.float32, (Piece("w", Box.full((4, 4)), (), (0, 0)),)
            )
        ]
        for r in (0, 1)
    }
    cache = planner.PlanCache()
    first = cache.get(src, need, targets_digest="layout-1")
    assert first.fingerprint == planner.inputs_fingerprint(
        src, need, targets_digest="layout-1"
    )
    assert first.fingerprint != planner.inputs_fingerprint(src, need)
    monkeypatch.setattr(
        planner,
        "targets_key",
        lambda *a: pytest.fail("targets hashed despite their digest"),
    )
    assert (
        cache.get(src, {r: list(t) for r, t in need.items()}, targets_digest="layout-1")
        is first
    )
    mine = cache.get(src, need, targets_digest="layout-1", local_ranks=(1,))
    assert mine is not first and mine.fingerprint == first.fingerprint
    assert mine.local == tuple(first.local_for(1)) and mine.rounds == first.rounds
    assert cache.get(src, need, targets_digest="layout-2") is not first


def test_executor_lands_permuted_pieces_transposed():
    """gpt-oss experts: checkpoint [E, H, 2I] lands as [E, 2I, H]; the executor permutes on the receiving side."""
    from benchmark.weight_sync.hand_rules import reference_param
    from sglang.srt.weight_sync.executor import execute

    full = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    src = {"w": describe_mesh("w", (2, 3, 4), torch.float32, [0], (Replicate(),))}
    target = ParamTarget(
        "p",
        (2, 2, 3),
        torch.float32,
        (Piece("w", Box((0, 0, 2), (2, 3, 2)), (), (0, 0, 0), (0, 2, 1)),),
    )
    p = plan(src, {0: [target]})
    params = {"p": torch.zeros(2, 2, 3)}
    execute(p, 0, {"w": full}, params)
    assert torch.equal(params["p"], full[:, :, 2:].transpose(1, 2))
    assert torch.equal(params["p"], reference_param(target, {"w": full}))
