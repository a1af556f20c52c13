"""The tokenizer manager's bounded wait for a distributed update's answer (``weight_sync.answer_guard``).

Against the installed wheel, without an engine: upstream's ``init_communicators`` wraps the
update and session communicators; a scheduler that never answers gets ``success=False``
within the bound (the bound shortened here; ``test/reliability/test_scheduler_death.py``
measures the real one against a hung scheduler), later calls are refused at once until
the late answer comes, and every other request keeps upstream's unbounded wait. Generation
is refused while an update is unanswered or after one left the weights mixed, until an
update succeeds.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time

import pytest
from guard_fakes import BOUND_S, guarded

import sglang.srt.managers.io_struct as io
from sglang.srt.weight_sync.answer_guard import (
    distributed_update,
    refuse_generation_if_unsafe,
)
from sglang.srt.weight_sync.protocol import (
    DEFAULT_TIMEOUT_S,
    GRACE_S,
    MIXED,
    answer_bound_s,
    as_tensor_request,
)


@pytest.fixture
def manager(monkeypatch):
    return guarded(monkeypatch)


def distributed(update_id="u1", timeout_s=5.0):
    return io.UpdateWeightsDistributedReqInput(
        update_id=update_id, channel="/tmp/x", timeout_s=timeout_s
    )


def test_bound_is_timeout_plus_grace():
    assert answer_bound_s(7.0) == 7.0 + GRACE_S
    # the suite sets the grace (test/conftest.py): proof that the setting reaches it
    assert GRACE_S == float(os.environ["SGLANG_WEIGHT_SYNC_GRACE_S"]) == 15.0


@pytest.mark.parametrize(
    "raw, grace",
    [(None, 30.0), ("1", 1.0), ("45.5", 45.5), ("600", 600.0)],
)
def test_grace_comes_from_the_environment(raw, grace):
    from sglang.srt.weight_sync.protocol import GRACE_ENV, grace_from_env

    assert grace_from_env({} if raw is None else {GRACE_ENV: raw}) == grace


@pytest.mark.parametrize("raw", ["0.5", "601", "nan", "inf", "-3", "", "30s"])
def test_a_grace_out_of_range_is_refused_naming_the_variable(raw):
    from sglang.srt.weight_sync.protocol import GRACE_ENV, grace_from_env

    with pytest.raises(ValueError) as e:
        grace_from_env({GRACE_ENV: raw})
    assert str(e.value) == (
        f"SGLANG_WEIGHT_SYNC_GRACE_S={raw!r}: must be a number of seconds in [1, 600]"
    )


def test_upstream_hooks_install_it():
    import inspect

    from sglang.srt.managers import tokenizer_control_mixin as tcm

    assert "bound_answers(self)" in inspect.getsource(
        tcm.TokenizerControlMixin.init_communicators
    )


def test_wrapper_delegates_what_it_does_not_bound(manager):
    assert manager.update_weights_distributed_communicator.handle_recv(1) == (
        "handled",
        1,
    )


def test_an_answer_within_the_bound_passes_through(manager):
    async def go():
        call = asyncio.ensure_future(
            manager.update_weights_distributed_communicator(distributed())
        )
        await asyncio.sleep(0.05)
        manager.inner["update_weights_distributed"].answer.set_result(["ok"])
        return await call

    assert asyncio.run(go()) == ["ok"]


def test_no_answer_fails_within_the_bound_then_refuses_until_the_late_answer(manager):
    async def go():
        start = time.monotonic()
        reply = await manager.update_weights_distributed_communicator(distributed("u7"))
        elapsed = time.monotonic() - start
        # while u7 is unanswered: updates (either form) and session calls are refused at once
        later = await manager.update_weights_from_tensor_communicator(
            as_tensor_request(distributed("u8"), 2)
        )
        end = await manager.end_weight_update_communicator(io.EndWeightUpdateReqInput())
        sent = {k: len(c.calls) for k, c in manager.inner.items()}
        manager.inner["update_weights_distributed"].answer.set_result(
            ["late"]
        )  # the scheduler answers late
        await asyncio.sleep(0.01)  # the task ends, then its done callbacks run
        after = asyncio.ensure_future(
            manager.end_weight_update_communicator(io.EndWeightUpdateReqInput())
        )
        await asyncio.sleep(0.05)
        manager.inner["end_weight_update"].answer.set_result(["ended"])
        return reply, elapsed, later, end, sent, await after

    reply, elapsed, later, end, sent, after = asyncio.run(go())
    assert (
        BOUND_S - 0.005 <= elapsed < BOUND_S + 0.5
    )  # asyncio's timer was seen firing 34 us early
    [r] = reply
    assert isinstance(r, io.UpdateWeightsDistributedReqOutput) and r.success is False
    assert (
        "no answer from the engine within 0.3s to distributed weight update 'u7'"
        in r.message
    )
    assert "waiting for its schedulers to receive and apply it" in r.message
    assert "an engine rank did not answer" in r.message
    [l] = later
    assert isinstance(l, io.UpdateWeightsFromTensorReqOutput) and not l.success
    assert (
        "'u8' refused" in l.message
        and "has not answered distributed weight update 'u7'" in l.message
    )
    [e] = end
    assert (
        isinstance(e, io.EndWeightUpdateReqOutput)
        and not e.success
        and "'u7'" in e.message
    )
    assert sent == {
        "update_weights_distributed": 1,
        "update_weights_from_tensor": 0,
        "begin_weight_update": 0,
        "end_weight_update": 0,
    }, "a refused call reached a scheduler"
    assert after == ["ended"], "calls go through again once the late answer came"


def test_other_tensor_updates_keep_upstreams_wait(manager):
    async def go():
        req = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[b"x"], load_format=None
        )
        call = asyncio.ensure_future(
            manager.update_weights_from_tensor_communicator(req)
        )
        await asyncio.sleep(BOUND_S + 0.2)
        assert not call.done(), "a non-distributed update was bounded"
        manager.inner["update_weights_from_tensor"].answer.set_result(["fine"])
        return await call

    assert asyncio.run(go()) == ["fine"]


def test_reserved_format_request_is_read_for_its_id_and_timeout():
    req = as_tensor_request(distributed("u3", timeout_s=9.5), 2)
    assert distributed_update(req) == ("u3", 9.5, "/tmp/x")
    assert distributed_update(distributed("u4", 3.0)) == ("u4", 3.0, "/tmp/x")
    assert (
        distributed_update(
            io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b"x"])
        )
        is None
    )


class Evil:
    def __reduce__(self):
        return (print, ("loaded",))


@pytest.mark.parametrize(
    "payload",
    [
        b"garbage",
        pickle.dumps({"update_id": "u", "timeout_s": Evil()}),
        pickle.dumps(["not", "a", "dict"]),
        "not base64!",
    ],
)
def test_unreadable_control_bounds_by_the_default(payload, capsys):
    req = io.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[payload], load_format="distributed_shards"
    )
    assert distributed_update(req) == ("", DEFAULT_TIMEOUT_S, "")
    assert "loaded" not in capsys.readouterr().out, "a pickled global was called"


def test_invalid_timeout_bounds_by_the_default():
    req = io.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[pickle.dumps({"update_id": "u", "timeout_s": -1})],
        load_format="distributed_shards",
    )
    assert distributed_update(req) == ("u", DEFAULT_TIMEOUT_S, "")


def test_upstream_generate_request_asks_the_guard_first():
    import inspect

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    source = inspect.getsource(TokenizerManager.generate_request)
    assert source.index("refuse_generation_if_unsafe(self)") < source.index(
        "normalize_batch_and_arguments"
    )


def _answer(manager, update_id, outputs):
    async def go():
        call = asyncio.ensure_future(
            manager.update_weights_distributed_communicator(distributed(update_id))
        )
        await asyncio.sleep(0.01)
        manager.inner["update_weights_distributed"].answer.set_result(outputs)
        return await call

    return asyncio.run(go())


def _out(success, message):
    """A scheduler's reply as the engine sends it: ``mixed`` set when writes had begun."""
    return io.UpdateWeightsDistributedReqOutput(
        success=success, message=message, mixed=MIXED in message
    )


def test_generation_is_refused_after_mixed_weights_until_an_update_succeeds(manager):
    refuse_generation_if_unsafe(manager)  # nothing happened yet: serves
    mixed = _out(
        False,
        f"distributed weight update FAILED after writes began on engine rank 1 (PeerLost: x): {MIXED}",
    )
    assert _answer(manager, "u1", [mixed]) == [mixed]
    with pytest.raises(
        ValueError,
        match=r"generation refused until a distributed weight update succeeds: "
        r"distributed weight update 'u1': .*engine rank 1.*MIXED",
    ):
        refuse_generation_if_unsafe(manager)
    _answer(
        manager,
        "u2",
        [_out(False, "refused, no parameter changed: engine rank 0: no payload")],
    )
    with pytest.raises(
        ValueError, match="'u1'"
    ):  # a refusal writes nothing: still mixed
        refuse_generation_if_unsafe(manager)
    _answer(manager, "u3", [_out(True, "Success")])
    refuse_generation_if_unsafe(manager)  # whole again


def test_the_mixed_field_decides_and_the_text_only_where_the_reply_has_no_field():
    from sglang.srt.weight_sync.protocol import is_mixed

    assert is_mixed(
        io.UpdateWeightsDistributedReqOutput(success=False, message="x", mixed=True)
    )
    assert not is_mixed(
        io.UpdateWeightsDistributedReqOutput(success=False, message=f"quoting: {MIXED}")
    )
    # upstream's tensor-path reply (the reserved load_format) has no such field: its message says it
    assert is_mixed(
        io.UpdateWeightsFromTensorReqOutput(success=False, message=f"FAILED: {MIXED}")
    )
    assert not is_mixed(
        io.UpdateWeightsFromTensorReqOutput(success=False, message="refused")
    )


def test_generation_is_refused_while_an_update_is_unanswered(manager):
    """A late success does not lift the refusal: the caller was told the update failed, so
    the weights it applied are not served until an update succeeds in time (issue 24)."""

    async def go():
        reply = await manager.update_weights_distributed_communicator(distributed("u5"))
        with pytest.raises(
            ValueError,
            match=r"not answered distributed weight update 'u5'.*restart the engine",
        ):
            refuse_generation_if_unsafe(manager)
        manager.inner["update_weights_distributed"].answer.set_result(
            [_out(True, "Success")]
        )  # late: applied after its caller was told it failed
        await asyncio.sleep(0.01)  # the task ends, then its done callbacks run
        with pytest.raises(
            ValueError,
            match=r"until a distributed weight update succeeds: distributed weight update "
            r"'u5' was applied after the engine had answered that it failed",
        ):
            refuse_generation_if_unsafe(manager)
        return reply

    [reply] = asyncio.run(go())
    assert reply.success is False
    _answer(manager, "u6", [_out(True, "Success")])
    refuse_generation_if_unsafe(manager)  # a timely success: served again


def test_a_late_answer_saying_mixed_keeps_generation_refused(manager):
    async def go():
        await manager.update_weights_distributed_communicator(distributed("u6"))
        manager.inner["update_weights_distributed"].answer.set_result(
            [_out(False, f"x: {MIXED}")]
        )
        await asyncio.sleep(0.01)  # the task ends, then its done callbacks run
        with pytest.raises(
            ValueError, match=r"until a distributed weight update succeeds: .*'u6'"
        ):
            refuse_generation_if_unsafe(manager)

    asyncio.run(go())
