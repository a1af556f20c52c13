"""One outcome per update that the trainer and the engine agree on (issue 24, item 7).

The decisions, without an engine (``test/reliability/test_outcome_agreement.py`` runs the
faults against a live one):

* the outcome record (``weight_sync.outcome``): made once, the first writer wins, the
  other reads it;
* the tokenizer manager's guard: when its bound passes it records that it gave up, and
  its answer says whether the engine will never apply the update (abandoned) or may have
  begun to (committed); a late success never lifts the refusal of generation;
* the engine's commit step: rank 0 refuses an abandoned update before any write, every
  rank writes only if all vote for the same update, and a rank whose vote is lost says
  the weights are mixed;
* the trainer: a rank that raises ``PeerLost`` during an update says what it knows of
  the engine's answer (``outcome``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest
from guard_fakes import generation_served, guarded

import sglang.srt.managers.io_struct as io
from sglang.srt.weight_sync import engine_update, trainer_flow
from sglang.srt.weight_sync.answer_guard import (
    refuse_generation_if_unsafe,
)
from sglang.srt.weight_sync.control_plane import PeerLost
from sglang.srt.weight_sync.outcome import Outcome, decide, forget, record_path
from sglang.srt.weight_sync.protocol import (
    MIXED,
    REFUSED,
    as_tensor_request,
    make_channel,
)

BOUND_S = 0.2


@pytest.fixture
def channel():
    path = make_channel()
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


# ------------------------------------------------------------------ the record


def test_the_first_outcome_recorded_holds(channel):
    assert decide(channel, "u1", Outcome.ABANDONED) is Outcome.ABANDONED
    assert decide(channel, "u1", Outcome.COMMITTED) is Outcome.ABANDONED
    assert decide(channel, "u2", Outcome.COMMITTED) is Outcome.COMMITTED
    assert decide(channel, "u2", Outcome.ABANDONED) is Outcome.COMMITTED
    forget(channel, "u1")
    assert not os.path.lexists(record_path(channel, "u1"))
    forget(channel, "u1")  # nothing left to remove: fine
    assert os.readlink(record_path(channel, "u2")) == "committed"


def test_two_sides_racing_get_one_outcome(channel):
    for i in range(50):
        update_id, results = f"race-{i}", []
        barrier = threading.Barrier(2)

        def side(word):
            barrier.wait()
            results.append((word, decide(channel, update_id, word)))

        threads = [
            threading.Thread(target=side, args=(w,))
            for w in (Outcome.COMMITTED, Outcome.ABANDONED)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held = {r for _, r in results}
        assert len(held) == 1, results
        assert sum(w is r for w, r in results) == 1, (
            f"exactly one side made the record: {results}"
        )


def test_a_record_nobody_can_make_or_read_raises(tmp_path, channel):
    from sglang.srt.weight_sync.protocol import ChannelError

    with pytest.raises(ChannelError):
        decide(str(tmp_path / "sglang-weights-gone"), "u", Outcome.COMMITTED)
    with open(record_path(channel, "odd"), "w") as f:  # a regular file, not a record
        f.write("committed")
    with pytest.raises(OSError):
        decide(channel, "odd", Outcome.COMMITTED)
    os.symlink("maybe", record_path(channel, "odd2"))
    with pytest.raises(ValueError):
        decide(channel, "odd2", Outcome.COMMITTED)


# ------------------------------------------------------------------ the tokenizer manager


@pytest.fixture
def manager(monkeypatch):
    return guarded(monkeypatch, BOUND_S)


def _req(channel, update_id):
    return io.UpdateWeightsDistributedReqInput(
        update_id=update_id, channel=channel, timeout_s=5.0
    )


def _out(success, message, mixed=False):
    return io.UpdateWeightsDistributedReqOutput(
        success=success, message=message, mixed=mixed
    )


def test_the_guard_abandons_an_unanswered_update_and_serves_after_the_late_refusal(
    manager, channel
):
    async def go():
        [reply] = await manager.update_weights_distributed_communicator(
            _req(channel, "u1")
        )
        recorded = os.readlink(record_path(channel, "u1"))
        with pytest.raises(
            ValueError,
            match=r"not answered distributed weight update 'u1'.*abandoned and will not be "
            r"applied.*restart the engine",
        ):
            refuse_generation_if_unsafe(manager)
        # the scheduler resumes: rank 0 finds the record and every rank refuses
        manager.inner["update_weights_distributed"].answer.set_result(
            [_out(False, REFUSED + "engine rank 0: ... had already given up ...")]
        )
        await asyncio.sleep(0.01)  # the task ends, then its done callbacks run
        return reply, recorded

    reply, recorded = asyncio.run(go())
    assert recorded == "abandoned"
    assert reply.success is False
    assert (
        "no answer from the engine within 0.2s to distributed weight update 'u1'"
        in (reply.message)
    )
    assert "The update is abandoned: the engine will not apply it" in reply.message, (
        reply.message
    )
    assert generation_served(manager), (
        "a late refusal leaves the old weights: served again"
    )
    assert not os.path.lexists(record_path(channel, "u1")), (
        "the record outlived its answer"
    )


def test_the_guard_finds_the_engine_committed_and_a_late_success_stays_refused(
    manager, channel
):
    async def go():
        call = asyncio.ensure_future(
            manager.update_weights_distributed_communicator(_req(channel, "u2"))
        )
        await asyncio.sleep(0.01)
        assert decide(channel, "u2", Outcome.COMMITTED) is Outcome.COMMITTED  # rank 0
        [reply] = await call
        manager.inner["update_weights_distributed"].answer.set_result(
            [_out(True, "Success")]
        )
        await asyncio.sleep(0.01)  # the task ends, then its done callbacks run
        return reply

    reply = asyncio.run(go())
    assert reply.success is False
    assert "The engine had already committed to applying it" in reply.message, (
        reply.message
    )
    assert "its weights are unknown" in reply.message
    with pytest.raises(
        ValueError,
        match=r"until a distributed weight update succeeds: distributed weight update 'u2' "
        r"was applied after the engine had answered that it failed",
    ):
        refuse_generation_if_unsafe(manager)
    assert not os.path.lexists(record_path(channel, "u2"))

    async def timely():
        call = asyncio.ensure_future(
            manager.update_weights_distributed_communicator(_req(channel, "u3"))
        )
        await asyncio.sleep(0.01)
        decide(channel, "u3", Outcome.COMMITTED)
        manager.inner["update_weights_distributed"].answer.set_result(
            [_out(True, "Success")]
        )
        return await call

    [ok] = asyncio.run(timely())
    assert ok.success and generation_served(manager), "a timely success serves again"
    assert not os.path.lexists(record_path(channel, "u3")), (
        "a timely answer leaves no record"
    )


def test_the_tensor_path_is_abandoned_alike(manager, channel):
    async def go():
        [reply] = await manager.update_weights_from_tensor_communicator(
            as_tensor_request(_req(channel, "t1"), 2)
        )
        return reply, os.readlink(record_path(channel, "t1"))

    reply, recorded = asyncio.run(go())
    assert recorded == "abandoned" and isinstance(
        reply, io.UpdateWeightsFromTensorReqOutput
    )
    assert "The update is abandoned" in reply.message, reply.message


def test_without_a_record_the_answer_says_the_weights_are_unknown(manager, tmp_path):
    async def go():
        [reply] = await manager.update_weights_distributed_communicator(
            _req(str(tmp_path / "sglang-weights-gone"), "u4")
        )
        return reply

    reply = asyncio.run(go())
    assert "Whether the engine may still apply it could not be recorded" in (
        reply.message
    )
    assert "does not exist" in reply.message
    assert "restart the engine" in reply.message


# ------------------------------------------------------------------ the engine's commit


class Vote:
    """The engine's control group as the commit step sees it."""

    def __init__(self, agreed=True, lost=None):
        self.agreed, self.lost_with, self.votes, self.lost = agreed, lost, [], None

    def all_equal(self, value, timeout_s, phase):
        self.votes.append((value, timeout_s, phase))
        if self.lost_with is not None:
            self.lost = self.lost_with
            raise PeerLost(f"{phase}: {self.lost_with}")
        return self.agreed


def _sync(rank, control):
    sync = engine_update.EngineWeightSync(rank)
    sync._control = control
    return sync, engine_update.ReceivedShards(sync, None)


def test_rank_0_commits_and_every_rank_votes_for_the_same_update(channel):
    req = _req(channel, "c1")
    sync, received = _sync(0, Vote())
    assert sync._commit(received, req, 35.0) is None
    assert os.readlink(record_path(channel, "c1")) == "committed"
    [(vote0, bound, phase)] = sync._control.votes
    assert bound == 35.0 and "committing to write update 'c1'" in phase
    other, received1 = _sync(1, Vote())
    assert other._commit(received1, req, 35.0) is None
    assert other._control.votes[0][0] == vote0 != 0, "both vote for update 'c1'"
    forget(channel, "c1")
    other, received1 = _sync(1, Vote())
    other._commit(received1, _req(channel, "c2"), 35.0)
    assert other._control.votes[0][0] != vote0, "another update, another vote"
    assert not os.path.lexists(record_path(channel, "c2")), "only rank 0 records"


def test_rank_0_refuses_an_update_the_tokenizer_manager_gave_up_on(channel):
    decide(channel, "c3", Outcome.ABANDONED)
    sync, received = _sync(0, Vote(agreed=False))
    refusal = sync._commit(received, _req(channel, "c3"), 35.0)
    assert refusal.startswith(
        REFUSED + "engine rank 0: the engine's tokenizer manager "
        "had already given up on update 'c3'"
    ), refusal
    assert sync._control.votes[0][0] == 0, "rank 0 votes against: every rank refuses"
    assert not received.mixed
    other, received1 = _sync(1, Vote(agreed=False))
    refusal = other._commit(received1, _req(channel, "c3"), 35.0)
    assert refusal.startswith(
        REFUSED + "engine rank 1: the TP ranks did not all commit"
    )
    single, received0 = _sync(
        0, Vote(agreed=True)
    )  # TP 1: its own vote is all there is
    assert single._commit(received0, _req(channel, "c3"), 35.0).startswith(REFUSED)


def test_rank_0_refuses_when_it_cannot_record(tmp_path):
    sync, received = _sync(0, Vote(agreed=False))
    refusal = sync._commit(
        received, _req(str(tmp_path / "sglang-weights-gone"), "c4"), 35.0
    )
    assert "cannot record in its channel that update 'c4' is being applied" in refusal
    assert sync._control.votes[0][0] == 0


def test_a_vote_lost_on_the_way_says_mixed(channel):
    sync, received = _sync(1, Vote(lost="a peer did not answer within 35s"))
    failure = sync._commit(received, _req(channel, "c5"), 35.0)
    assert received.mixed and MIXED in failure, failure
    assert "another rank may have begun writing" in failure
    assert sync._control.lost, "the group is not used again"
    assert engine_update.end_of_update(
        received, _req(channel, "c5"), False, failure
    ) == (
        False,
        failure,
    ), "the closing barrier is skipped on a lost group"


def test_a_control_group_whose_wait_failed_is_made_anew(monkeypatch):
    made = []

    class Group:
        def __init__(self, group, name, own=False, setup_s=None):
            made.append((group, name, own, setup_s))
            self.lost = None

    monkeypatch.setattr(engine_update, "ControlGroup", Group)
    monkeypatch.setattr(
        engine_update,
        "tp_state",
        lambda: SimpleNamespace(rank=0, cpu_group="sglang-tp-cpu"),
    )
    sync = engine_update.EngineWeightSync(0)
    sync.renew_control(30.0)
    first = sync.control
    sync.renew_control(30.0)
    assert sync.control is first, "kept while it works"
    first.lost = "a peer did not answer"
    sync.renew_control(40.0)
    assert sync.control is not first
    assert made == [
        ("sglang-tp-cpu", "engine-0", True, 30.0),
        ("sglang-tp-cpu", "engine-1", True, 40.0),
    ], "a gloo group of its own, never SGLang's TP group, named apart"


# ------------------------------------------------------------------ the trainer


class Control:
    """A trainer group's control collectives: the barrier ``fail_at`` raises PeerLost."""

    def __init__(self, fail_at):
        self.fail_at, self.barriers = fail_at, 0

    def barrier(self, timeout_s, phase):
        self.barriers += 1
        if self.barriers == self.fail_at:
            raise PeerLost(f"{phase}: ranks [1] never reached it")

    def broadcast_result(self, reply, src, timeout_s, phase):
        return reply


def _drive(monkeypatch, me, fail_at, reply=(True, "Success")):
    monkeypatch.setattr(trainer_flow.dist, "get_rank", lambda group=None: me)
    request = trainer_flow.ControlRequest("tok-2", "/tmp/chan", Control(fail_at))

    def flow():
        yield request
        return trainer_flow.UpdateReport("engine", "tok-2", True, "Success")

    calls = []

    def call(req):
        calls.append(req)
        return reply

    with pytest.raises(PeerLost) as caught:
        trainer_flow.drive(flow(), [0, 1], None, call, timeout_s=5.0)
    return caught.value, calls


def test_the_first_rank_says_the_engine_applied_what_it_applied(monkeypatch):
    lost, calls = _drive(monkeypatch, me=0, fail_at=2)
    assert len(calls) == 1
    assert lost.outcome == trainer_flow.UpdateOutcome("tok-2", True, "Success")
    assert str(lost).startswith("trainer rank 0: while the engine applies the update")
    assert "the engine APPLIED update 'tok-2'" in str(lost) and "ranks [1]" in str(lost)


def test_the_first_rank_says_the_engine_refused_what_it_refused(monkeypatch):
    lost, _ = _drive(monkeypatch, me=0, fail_at=2, reply=(False, REFUSED + "x"))
    assert lost.outcome.applied is False and lost.outcome.answer == REFUSED + "x"
    assert "the engine answered that update 'tok-2' failed" in str(lost)


def test_the_first_rank_knows_the_engine_was_not_asked(monkeypatch):
    lost, calls = _drive(monkeypatch, me=0, fail_at=1)
    assert not calls and lost.outcome.applied is False
    assert "the engine was not asked to apply update 'tok-2'" in str(lost)


@pytest.mark.parametrize("fail_at", [1, 2])
def test_another_rank_says_it_cannot_know(monkeypatch, fail_at):
    lost, calls = _drive(monkeypatch, me=1, fail_at=fail_at)
    assert not calls and lost.outcome.applied is None
    assert "whether the engine applied update 'tok-2' is unknown here" in str(lost)
