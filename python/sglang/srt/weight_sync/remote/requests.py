"""The tokenizer manager's side of a weight-sync group with remote engines.

``join_weight_sync_group`` and ``leave_weight_sync_group`` check the request and hand it to
the schedulers. ``update_weights_remote`` walks one update through its steps
(``remote.protocol.UpdateStep``) so that the engine keeps serving while it receives:

1. ``receive``, without the writer lock: every TP rank starts receiving its regions into
   staging; generation goes on with the old weights;
2. ``status`` every ``POLL_S``, without the lock, until every TP rank has received all of
   its regions (or filled its staging), or one failed (then nothing was written: the old
   weights serve on), at most ``receive_bound_s(timeout_s)`` in all: past that the receive
   is aborted and the update refused (``REFUSED``), so that a receive stuck where no wait's
   bound reaches never holds the update, or its caller, for ever;
3. ``apply`` under the writer lock (generation waits, as for any SGLang weight update):
   the schedulers write the staged regions between batches, and stream the rest if the
   staging was too small. The time from asking for the lock to releasing it is the
   pause the reply reports, beside the time spent receiving. The lock is waited for at
   most ``timeout_s`` (requests in flight hold it for as long as they generate): when it
   is not taken by then, the update is refused (``REFUSED``) and its staging dropped, and
   the apply step is never sent, so the engine never applies an update whose caller,
   answered within its own bound, was told it failed.

Every step's answer is awaited at most ``answer_bound_s(timeout_s)``. An apply step that
failed after writes began (``mixed``) makes the tokenizer manager refuse generation until
an update succeeds (``answer_guard``). Each update has one outcome record (``outcome``), as
on the colocated path: in a private directory the tokenizer manager makes once (its
``sglang-weights-*`` channel, on the host where engine rank 0 runs beside it) under a key
made for the update, both named in every step's request. Engine rank 0 records
``committed`` right before the first write; an apply step left unanswered past its bound
is recorded ``abandoned`` unless rank 0 came first, so a scheduler that resumes later never
writes an update its caller was told failed, and the reply says which of the two held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Optional

from sglang.srt.weight_sync.answer_guard import guard_of, no_answer_message
from sglang.srt.weight_sync.outcome import forget
from sglang.srt.weight_sync.protocol import REFUSED, answer_bound_s, make_channel
from sglang.srt.weight_sync.remote.protocol import (
    POLL_S,
    ReceiveState,
    UpdateStep,
    join_problems,
    leave_problems,
    receive_bound_s,
    remote_reply,
    update_problems,
)
from sglang.srt.weight_sync.sglang_compat import (
    clear_preprocess_cache,
    record_served_weight_version,
    replace_fields,
)

__all__ = (
    "join_weight_sync_group",
    "leave_weight_sync_group",
    "update_weights_remote",
)

logger = logging.getLogger(__name__)


def _merged(outputs) -> dict:
    """One answer from every scheduler's: success when all succeeded, every message."""
    return {
        "success": bool(outputs) and all(o.success for o in outputs),
        "message": "; ".join(o.message for o in outputs),
    }


async def _checked(manager, obj, problems, what: str, communicator) -> dict:
    manager.auto_create_handle_loop()
    if problems:
        return {"success": False, "message": f"{what} refused: " + "; ".join(problems)}
    return _merged(await communicator(obj))


async def join_weight_sync_group(manager, obj) -> dict:
    """Join (every TP rank) epoch ``obj.epoch`` of the group ``obj.group_name``: blocks until
    every member arrived in the trainer's store and every engine's layout is known."""
    return await _checked(
        manager,
        obj,
        join_problems(obj),
        "join",
        manager.join_weight_sync_group_communicator,
    )


async def leave_weight_sync_group(manager, obj) -> dict:
    """Leave the group ``obj.group_name`` (every TP rank releases it)."""
    return await _checked(
        manager,
        obj,
        leave_problems(obj),
        "leave",
        manager.leave_weight_sync_group_communicator,
    )


async def update_weights_remote(manager, obj) -> dict:
    """One update of the group ``obj.group_name``, as the module's text says; returns
    ``remote.protocol.remote_reply``."""
    manager.auto_create_handle_loop()
    problems = update_problems(obj)
    if problems:
        return remote_reply(
            False, "remote weight update refused: " + "; ".join(problems)
        )
    guard = guard_of(manager)
    pending = guard.pending() if guard is not None else None
    if pending is not None:
        return remote_reply(
            False,
            f"remote weight update refused: the engine has not answered weight update "
            f"{pending.update_id!r}; the engine must be restarted",
        )
    channel = _outcome_channel(manager)
    if channel is None:
        return remote_reply(
            False,
            "remote weight update refused: the tokenizer manager cannot make the private "
            "directory its updates' outcome records live in (see the log)",
        )
    record = f"{obj.update_id or obj.group_name}#{uuid.uuid4().hex[:12]}"
    obj = replace_fields(obj, outcome_channel=channel, outcome_id=record)
    bound = answer_bound_s(obj.timeout_s)
    communicate = manager.update_weights_remote_communicator

    async def step(which: UpdateStep):
        answer = asyncio.ensure_future(
            communicate(replace_fields(obj, step=which.value))
        )
        done, _ = await asyncio.wait({answer}, timeout=bound)
        if done:
            return answer.result()[0]
        if which != UpdateStep.APPLY:  # nothing is written before the apply step
            raise TimeoutError(
                f"no answer from the engine's schedulers within {bound:g}s to the {which.value} "
                "step of a remote weight update (a scheduler may have died or hung)"
            )
        recorded, why = (
            guard.give_up(record, bound, answer, channel)
            if guard is not None
            else (None, "no answer guard")
        )
        raise TimeoutError(
            no_answer_message(record, obj.timeout_s, bound, recorded, why)
        )

    started = time.monotonic()
    receiving = receive_bound_s(obj.timeout_s)
    try:
        out = await step(UpdateStep.RECEIVE)
        while out.success and out.state != ReceiveState.DONE.name.lower():
            if time.monotonic() - started > receiving:
                break
            await asyncio.sleep(POLL_S)
            out = await step(UpdateStep.STATUS)
    except TimeoutError as e:
        return remote_reply(False, str(e))
    receive_s = time.monotonic() - started
    if out.success and out.state != ReceiveState.DONE.name.lower():
        message = (
            f"{REFUSED}remote weight update {obj.update_id or obj.group_name!r}: receiving "
            f"did not end within {receiving:g}s (2 * timeout_s={obj.timeout_s:g} + grace; "
            f"the TP ranks' state: {out.state}); the receive is aborted and the update "
            "will not be applied, the old weights serve on"
        )
        logger.error("%s", message)
        await _abort(step)
        return remote_reply(False, message, None, receive_s=receive_s)
    if not out.success:
        await _abort(step)
        return remote_reply(False, out.message, out, receive_s=receive_s)
    if obj.abort_all_requests:
        manager.abort_request(abort_all=True)
    paused = time.monotonic()
    try:
        async with manager.is_pause_cond:
            is_paused = manager.is_pause
            if is_paused:  # whoever paused the engine holds the writer lock
                out = await step(UpdateStep.APPLY)
        if not is_paused:
            async with _writer_lock(manager.model_update_lock, obj.timeout_s):
                out = await step(UpdateStep.APPLY)
    except _NoPause as e:
        message = (
            f"{REFUSED}remote weight update {obj.update_id or obj.group_name!r}: {e}; "
            "its staged regions are dropped and it will not be applied, the old weights "
            "serve on"
        )
        logger.error("%s", message)
        await _abort(step)
        return remote_reply(False, message, out, receive_s=receive_s)
    except TimeoutError as e:
        logger.error("remote weight update: %s", e)
        return remote_reply(False, str(e), None)
    forget(channel, record)
    pause_s = time.monotonic() - paused
    if guard is not None:
        guard.settle(out.update_id or obj.group_name, [out])
    message = out.message
    if out.success:
        if obj.flush_cache:
            clear_preprocess_cache(manager)
        if obj.weight_version is not None:
            record_served_weight_version(manager, obj.weight_version)
            message += f" Weight version updated to {obj.weight_version}."
    logger.info(
        "remote weight update %s: %s; received while serving for %.3fs, paused %.3fs",
        out.update_id,
        "success" if out.success else message,
        receive_s,
        pause_s,
    )
    return remote_reply(out.success, message, out, pause_s=pause_s, receive_s=receive_s)


class _NoPause(Exception):
    """The writer lock was not taken within the update's bound (why, in the message)."""


@contextlib.asynccontextmanager
async def _writer_lock(lock, timeout_s: float):
    """``lock``'s writer lock (SGLang's ``model_update_lock``), waited for at most
    ``timeout_s``, else ``_NoPause``: requests in flight hold its reader side while they
    generate, and an unbounded wait would let the engine apply the update after its
    trainer, past its own bound, reported it failed. A wait given up leaves the lock as
    it was (the writer's turn is withdrawn as the wait is cancelled)."""
    writer = lock.writer_lock
    try:
        await asyncio.wait_for(writer.__aenter__(), timeout_s)
    except asyncio.TimeoutError:
        raise _NoPause(
            f"generation was not paused within timeout_s={timeout_s:g}s (requests in "
            "flight held the engine's writer lock)"
        ) from None
    try:
        yield
    finally:
        await writer.__aexit__(None, None, None)


async def _abort(step) -> None:
    """Forget a receive that failed (best effort: its thread has ended or ends by itself)."""
    try:
        await step(UpdateStep.ABORT)
    except TimeoutError as e:
        logger.error("remote weight update: abort not answered: %s", e)


def _outcome_channel(manager) -> Optional[str]:
    """The private directory (a channel) the outcome records of ``manager``'s remote updates
    live in, made on first use and kept on the manager; None when it cannot be made."""
    channel = getattr(manager, "_weight_sync_outcomes", None)
    if channel is None:
        try:
            channel = manager._weight_sync_outcomes = make_channel()
        except OSError:
            logger.exception("remote weight update: no directory for outcome records")
    return channel
