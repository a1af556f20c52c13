"""A remote engine's update has one outcome, as a colocated one (``remote.requests``,
``outcome``), decided by the tokenizer manager's steps without an engine:

* every step carries the tokenizer manager's own outcome directory (a private channel) and
  a key made for the update, whatever the caller sent;
* an apply step left unanswered past its bound is recorded ``abandoned`` (the answer says
  the engine will not apply it) and generation is refused until the late answer, a refusal,
  comes; then the old weights serve again and the record is gone;
* when engine rank 0 committed first, the answer says the weights are unknown and a late
  success never lifts the refusal;
* an apply answered in time leaves no record.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
from guard_fakes import generation_served

import sglang.srt.managers.io_struct as io
from sglang.srt.weight_sync.answer_guard import (
    bound_answers,
    refuse_generation_if_unsafe,
)
from sglang.srt.weight_sync.outcome import Outcome, decide, record_path
from sglang.srt.weight_sync.protocol import REFUSED
from sglang.srt.weight_sync.remote import requests as remote_requests

BOUND_S = 0.2


class _Lock:
    @property
    @contextlib.asynccontextmanager
    async def writer_lock(self):
        yield


class FakeManager:
    """The tokenizer manager's parts the remote steps use; the schedulers answer receive and
    status at once, and apply with ``apply_answer`` (set by the test, or never)."""

    is_pause = False
    mm_processor = None

    def __init__(self):
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = _Lock()
        self.steps = []
        self.apply_answer: asyncio.Future = None
        self.on_apply = lambda obj: None
        self.receive_state = "done"  # what receive and status answer (set by the test)

    def auto_create_handle_loop(self):
        pass

    async def update_weights_remote_communicator(self, obj):
        self.steps.append(obj)
        if obj.step != "apply":
            return [
                io.UpdateWeightsRemoteReqOutput(
                    success=True, message="", state=self.receive_state
                )
            ]
        self.on_apply(obj)
        self.apply_answer = asyncio.get_running_loop().create_future()
        return await self.apply_answer


@pytest.fixture
def manager(monkeypatch):
    monkeypatch.setattr(remote_requests, "answer_bound_s", lambda timeout_s: BOUND_S)
    m = FakeManager()
    bound_answers(m)
    yield m
    for made in {s.outcome_channel for s in m.steps}:
        os.rmdir(made)  # empty: every record went with its answer


def _update(update_id):
    return io.UpdateWeightsRemoteReqInput(
        group_name="g",
        update_id=update_id,
        timeout_s=5.0,
        outcome_channel="/tmp/not-the-managers",
        outcome_id="chosen-by-the-caller",
    )


def _record(manager) -> str:
    obj = manager.steps[-1]
    return record_path(obj.outcome_channel, obj.outcome_id)


def _refused(reply: dict, update_id: str, *says: str) -> None:
    """``reply`` refuses update ``update_id`` with nothing written, saying each of ``says``
    and that the update will never be applied."""
    assert reply["success"] is False and not reply["mixed"], reply
    message = reply["message"]
    assert message.startswith(REFUSED) and repr(update_id) in message, message
    for said in says + ("will not be applied",):
        assert said in message, (said, message)


def test_an_unanswered_apply_is_abandoned_and_the_late_refusal_serves_again(manager):
    async def go():
        reply = await remote_requests.update_weights_remote(manager, _update("r1"))
        recorded = os.readlink(_record(manager))
        served = generation_served(manager)
        manager.apply_answer.set_result(
            [
                io.UpdateWeightsRemoteReqOutput(
                    success=False, message=REFUSED + "had already given up"
                )
            ]
        )
        await asyncio.sleep(0.01)  # the step ends, then its done callbacks run
        return reply, recorded, served

    reply, recorded, served = asyncio.run(go())
    steps = manager.steps
    assert [s.step for s in steps] == ["receive", "apply"], steps
    assert len({(s.outcome_channel, s.outcome_id) for s in steps}) == 1
    assert steps[0].outcome_channel != "/tmp/not-the-managers"
    assert steps[0].outcome_id.startswith("r1#"), steps[0].outcome_id
    assert recorded == "abandoned"
    assert reply["success"] is False
    assert "The update is abandoned: the engine will not apply it" in reply["message"]
    assert not served, "generation is refused while the apply step is unanswered"
    assert generation_served(manager), (
        "a late refusal leaves the old weights: served again"
    )
    assert not os.path.lexists(_record(manager)), "the record outlived its answer"


def test_rank_0_committed_first_and_a_late_success_stays_refused(manager):
    manager.on_apply = lambda obj: decide(
        obj.outcome_channel, obj.outcome_id, Outcome.COMMITTED
    )

    async def go():
        reply = await remote_requests.update_weights_remote(manager, _update("r2"))
        manager.apply_answer.set_result(
            [io.UpdateWeightsRemoteReqOutput(success=True, message="Success")]
        )
        await asyncio.sleep(0.01)
        return reply

    reply = asyncio.run(go())
    assert reply["success"] is False
    assert "The engine had already committed to applying it" in reply["message"]
    with pytest.raises(ValueError, match=r"was applied after the engine had answered"):
        refuse_generation_if_unsafe(manager)
    assert not os.path.lexists(_record(manager))


def test_an_apply_answered_in_time_leaves_no_record(manager):
    def commit_and_answer(obj):
        assert decide(obj.outcome_channel, obj.outcome_id, Outcome.COMMITTED) is (
            Outcome.COMMITTED
        )
        asyncio.get_running_loop().call_soon(
            lambda: manager.apply_answer.set_result(
                [io.UpdateWeightsRemoteReqOutput(success=True, message="Success")]
            )
        )

    manager.on_apply = commit_and_answer
    reply = asyncio.run(remote_requests.update_weights_remote(manager, _update("r3")))
    assert reply["success"] is True, reply
    assert generation_served(manager)
    assert not os.path.lexists(_record(manager)), "a timely answer leaves no record"


def test_a_writer_lock_held_past_the_bound_refuses_and_never_applies(manager):
    """A long generation holds the writer lock's reader side past the update's timeout_s:
    the tokenizer manager stops waiting for the pause, refuses the update (nothing written:
    the apply step is never sent, the staging is dropped) and serving goes on; the lock is
    left as it was, and once the generation ends a writer takes it at once."""
    from sglang.srt.utils.aio_rwlock import RWLock

    manager.model_update_lock = lock = RWLock()
    update = _update("held")
    update.timeout_s = 0.5

    async def go():
        await lock.acquire_reader()  # a generation in flight
        started = time.monotonic()
        reply = await remote_requests.update_weights_remote(manager, update)
        seconds = time.monotonic() - started
        served = generation_served(manager)
        await lock.release_reader()
        await asyncio.wait_for(lock.acquire_writer(), 1.0)
        await lock.release_writer()
        return reply, seconds, served

    reply, seconds, served = asyncio.run(go())
    assert [s.step for s in manager.steps] == ["receive", "abort"], manager.steps
    _refused(reply, "held", "timeout_s=0.5s", "writer lock")
    assert 0.5 <= seconds < 3, seconds
    assert served, "a refused update leaves the old weights serving"


def test_a_receive_that_never_ends_is_aborted_and_refused_within_its_bound(
    manager, monkeypatch
):
    """Every TP rank says "receiving" for ever (a receive stuck where no wait's bound
    reaches, such as NCCL's first communicator init): the tokenizer manager polls at most
    ``receive_bound_s(timeout_s)``, then aborts the receive and refuses the update, naming
    it and the bound (nothing written: the apply step is never sent); the next update's
    receive works."""
    from sglang.srt.weight_sync.remote import protocol as remote_protocol

    assert remote_protocol.receive_bound_s(5.0) == 2 * 5.0 + remote_protocol.GRACE_S
    monkeypatch.setattr(remote_requests, "receive_bound_s", lambda timeout_s: 0.3)

    def answer_apply(obj):
        asyncio.get_running_loop().call_soon(
            lambda: manager.apply_answer.set_result(
                [io.UpdateWeightsRemoteReqOutput(success=True, message="Success")]
            )
        )

    manager.on_apply = answer_apply
    manager.receive_state = "receiving"
    started = time.monotonic()
    reply = asyncio.run(
        remote_requests.update_weights_remote(manager, _update("stuck"))
    )
    seconds = time.monotonic() - started
    steps = [s.step for s in manager.steps]
    assert steps[0] == "receive" and steps[-1] == "abort", steps
    assert set(steps[1:-1]) == {"status"} and "apply" not in steps, steps
    _refused(reply, "stuck", "within 0.3s", "timeout_s=5")
    assert 0.3 <= seconds < 2, seconds
    assert generation_served(manager), "a refused update leaves the old weights serving"

    manager.receive_state, manager.steps[:] = "done", []
    reply = asyncio.run(remote_requests.update_weights_remote(manager, _update("next")))
    assert reply["success"] is True, reply
    assert [s.step for s in manager.steps] == ["receive", "apply"], manager.steps
