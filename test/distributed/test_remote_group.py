"""A weight-sync group of trainer ranks and remote engine ranks, without an engine.

Four trainer ranks hold ``Shard(0)`` fp32 shards; two engines of TP 2 (bf16 parameters by
the hand rules of a tiny Qwen2) are the ranks after them, all in one group made in a TCP
store (``remote.group.SyncGroup``). Every engine rank must end with SGLang's slicing of the
weights bit for bit, receiving exactly its parameters' bytes (its lower bound: it holds
none of the trainer's data), and every trainer rank must send within 10% of the mean.
"""

from __future__ import annotations

import time

import pytest
from ports import free_port
from ranks import run_ranks
from remote_group_cases import (
    dying_engine_job,
    remote_group_job,
    silent_engines_job,
    stalled_join_job,
    weights_of,
)

ENGINES = [("e0", 2), ("e1", 2)]


def _small_job(**extra) -> dict:
    """Two trainer ranks and one TP-2 engine (four ranks), one update: the job of
    ``remote_group_cases`` with ``extra``."""
    return dict(
        port=free_port(),
        trainers=2,
        engines=ENGINES[:1],
        seeds=[1],
        bucket=1 << 20,
        **extra,
    )


def test_trainer_ranks_send_straight_to_two_engines():
    job = dict(
        port=free_port(), trainers=4, engines=ENGINES, seeds=[1, 2], bucket=1 << 20
    )
    results = run_ranks(8, remote_group_job, job, timeout=300)
    for update in range(2):
        sent = [r["updates"][update]["sent"] for r in results[:4]]
        mean = sum(sent) / len(sent)
        assert max(sent) <= 1.1 * mean and min(sent) > 0, sent
        received = 0
        for rank, r in enumerate(results[4:], start=4):
            u = r["updates"][update]
            assert not u["wrong"], f"rank {rank}: parameters differ: {u['wrong'][:4]}"
            assert u["received"] == u["lower_bound"] == u["param_bytes"], (rank, u)
            received += u["received"]
        assert sum(sent) == received, (sent, received)


def test_a_share_larger_than_the_staging_streams_into_the_parameters():
    """An engine rank whose staging holds less than its share: the receiving thread waits
    for the pause to write what landed, the rest streams in (a round written while the
    next is on the wire), and the parameters still end bit for bit."""
    cap = 100_000
    results = run_ranks(4, remote_group_job, _small_job(staging=cap), timeout=300)
    for rank, r in enumerate(results[2:], start=2):
        u = r["updates"][0]
        assert not u["wrong"], f"rank {rank}: parameters differ: {u['wrong'][:4]}"
        assert u["received"] == u["lower_bound"] == u["param_bytes"] > 2 * cap, u
        assert u["rounds"] > 1 and u["staging_peak"] <= cap + u["largest_round"], u


def _refusals(**fault) -> list:
    """Every rank's error for one update of four trainer ranks into a TP-2 engine, with
    ``fault`` on trainer rank 1 (``remote_group_cases.remote_group_job``)."""
    job = dict(
        port=free_port(),
        trainers=4,
        engines=ENGINES[:1],
        seeds=[1],
        bucket=1 << 20,
        **fault,
    )
    results = run_ranks(6, remote_group_job, job, timeout=300)
    return [r["updates"][0]["error"] for r in results]


def test_nan_on_a_trainer_rank_refuses_the_update_on_every_rank():
    for rank, message in enumerate(_refusals(nan=True)):
        assert "GroupRefusal" in message and "trainer rank 1" in message, (
            rank,
            message,
        )
        assert "NaN" in message or "nan" in message.lower(), message


def test_a_wrong_shard_on_a_trainer_rank_is_a_refusal_on_every_rank():
    """A shard of the wrong shape on trainer rank 1 is checked against the plan before the
    members agree: every member raises the same ``GroupRefusal`` naming the tensor and the
    rank, at once, and none is left waiting in a round (``PeerLost``)."""
    name = sorted(weights_of(1))[0]
    started = time.monotonic()
    messages = _refusals(wrong_shard=True)
    assert time.monotonic() - started < 60
    for rank, message in enumerate(messages):
        assert message.startswith("GroupRefusal"), (rank, message)
        assert "trainer rank 1" in message and repr(name) in message, message
        assert "local shard has shape" in message and "PeerLost" not in message


def test_an_engine_rank_dying_mid_update_is_named_within_the_bound():
    job = dict(
        port=free_port(), trainers=2, engines=ENGINES[:1], bucket=1 << 20, timeout=10
    )
    results = run_ranks(4, dying_engine_job, job, timeout=300, may_die=[3])
    for rank, r in enumerate(results[:3]):
        assert r["error"], f"rank {rank} did not notice the dead engine rank"
        assert r["seconds"] < 10 + 5, r
        print(rank, r)


@pytest.mark.parametrize("stall", ["meet", "groups"])
def test_a_rank_that_never_reaches_the_rendezvous_fails_every_join_in_time(stall):
    """An engine rank stops short of the rendezvous of epoch 1: before meeting the others
    in the store, or after it, before making the epoch's groups (gloo's rendezvous, which
    waited for the groups' own timeout of hours: an engine joins in its scheduler loop, so
    serving froze that long). Every other rank's join fails within the join's bound, naming
    the phase; then every rank joins epoch 2 and an update lands bit for bit, and the
    store keeps no key of epoch 1 (``remote.rendezvous.forget_before``)."""
    timeout = 4
    job = _small_job(timeout=timeout, stall=stall)
    results = run_ranks(4, stalled_join_job, job, timeout=300)
    phase = "meeting the 4 ranks" if stall == "meet" else "making the data group"
    for rank, r in enumerate(results[:3]):
        assert r["error"] and r["error"].startswith("PeerLost"), (rank, r["error"])
        assert phase in r["error"] and "epoch 1" in r["error"], (rank, r["error"])
        assert r["seconds"] < timeout + 3, (rank, r["seconds"])
    for rank, r in enumerate(results):
        (update,) = r["updates"]
        assert "error" not in update, (rank, update)
        if rank >= 2:
            assert not update["wrong"] and update["received"] == update["lower_bound"]
    assert results[0]["epoch1_keys"] == [], results[0]["epoch1_keys"]


def test_the_store_port_is_free_and_outside_the_ephemeral_range():
    """The port a trainer's first rank picks for the group's store (``free_port``, as verl's
    checkpoint engine does) is free, below the kernel's ephemeral range, and a range with no
    free port left raises naming it."""
    import socket

    from sglang.srt.weight_sync.remote.rendezvous import _ephemeral_low, free_port

    for _ in range(20):
        port = free_port()
        assert 10000 <= port < _ephemeral_low(), port
        with socket.socket() as s:
            s.bind(("", port))
    with socket.socket() as s:
        s.bind(("", port))
        with pytest.raises(
            RuntimeError, match=f"no free port in \\[{port}, {port + 1}\\)"
        ):
            free_port(port, port + 1)


def test_a_group_whose_engines_all_fail_their_health_check_is_not_formed():
    """The first rank asks each engine's health within the join's own bound (SGLang
    answers ``/health`` by generating a token, slow on a busy engine); when none answers,
    every trainer rank's join raises, naming the engine: an update reaching no engine is
    never reported as a success."""
    results = run_ranks(2, silent_engines_job, dict(port=free_port(), timeout=7.0))
    for rank, r in enumerate(results):
        assert r["error"] and "no engine to update" in r["error"], (rank, r)
        assert "'http://silent:1'" in r["error"] and "7s" in r["error"], r
        assert r["left"] == ["http://silent:1"], r
    assert results[0]["asked"] == [7.0] and results[1]["asked"] == []
