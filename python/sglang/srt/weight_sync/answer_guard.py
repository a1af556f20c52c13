"""The tokenizer manager's guard: a bounded wait for each update's answer, and no serving of mixed weights.

The schedulers answer an update once every TP rank has received, checked and applied
it; each of their waits is bounded by the update's ``timeout_s`` (``control_plane``). A
scheduler that hangs, or that died while SGLang's subprocess watchdog has not torn the
engine down, never answers, and upstream's communicator would wait for ever.
``bound_answers`` wraps the tokenizer manager's update communicators (the distributed
request and the tensor path's reserved ``load_format``): the wait ends after
``protocol.answer_bound_s(timeout_s)`` with ``success=False`` naming the phase. The request stays in flight (cancelling it
would leave upstream's communicator expecting an answer it then drops or hands to the
next caller); until its answer comes, later distributed updates and session calls are
refused at once instead of queueing behind it.

When the bound passes, the guard records in the update's channel that it gave up on the
update (``outcome``), unless engine rank 0 has already recorded that it is applying it:
an abandoned update is refused by every TP rank before any write, so a scheduler that
resumes later never applies what the caller was told failed, and the answer says which
of the two happened.

The same guard keeps the engine from serving weights nobody can vouch for: while an
update is unanswered (its schedulers' weights are unknown), after one failed once
writes had begun (some parameters new, some old), or after a late answer said that an
update the caller was told failed was applied, generation requests are refused
(``refuse_generation_if_unsafe``, a ``ValueError`` as upstream's own request checks
raise: HTTP 400) until a distributed update succeeds. A late refusal leaves the weights
as they were, and serving resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

from sglang.srt.weight_sync.outcome import Outcome, decide, forget
from sglang.srt.weight_sync.protocol import (
    DEFAULT_TIMEOUT_S,
    DISTRIBUTED_LOAD_FORMAT,
    GRACE_S,
    DeliveryError,
    answer_bound_s,
    check_timeout,
    is_mixed,
    read_control,
)

__all__ = (
    "BoundedCommunicator",
    "DistributedUpdate",
    "bound_answers",
    "distributed_update",
    "guard_of",
    "no_answer_message",
    "refuse_generation_if_unsafe",
)

logger = logging.getLogger(__name__)

# communicator name -> its reply type in io_struct (this module answers with it when the engine does not)
UPDATES = {
    "update_weights_distributed": "UpdateWeightsDistributedReqOutput",
    "update_weights_from_tensor": "UpdateWeightsFromTensorReqOutput",
}
SESSIONS = {
    "begin_weight_update": "BeginWeightUpdateReqOutput",
    "end_weight_update": "EndWeightUpdateReqOutput",
}
NO_ANSWER = "an engine rank did not answer (a scheduler may have died or hung)"


class DistributedUpdate(NamedTuple):
    """What the guard reads of a distributed update request."""

    update_id: str
    timeout_s: float
    channel: str


@dataclass
class _Unanswered:
    """A distributed update whose answer did not come within its bound (still awaited), and
    what its outcome record said then (None: nothing could be recorded)."""

    update_id: str
    bound_s: float
    answer: asyncio.Future
    recorded: Optional[Outcome]


class _Guard:
    """What the wrapped communicators of one tokenizer manager share: the unanswered update,
    and why the weights cannot be vouched for (mixed, or applied after the caller was told
    the update failed) until an update succeeds."""

    def __init__(self) -> None:
        self.unanswered: Optional[_Unanswered] = None
        self.unsafe: Optional[str] = None

    def pending(self) -> Optional[_Unanswered]:
        """The unanswered update, until its late answer has been settled (not merely come:
        nothing may be served between the two)."""
        return self.unanswered

    def settle(self, update_id: str, outputs) -> None:
        """What an update's timely answer says of the weights: a success on every scheduler
        makes them whole, a failure after writes began mixed; a refusal (nothing written)
        leaves them as they were."""
        if _succeeded(outputs):
            self.unsafe = None
            return
        mixed = [o.message for o in outputs if is_mixed(o)]
        if mixed:
            self.unsafe = f"distributed weight update {update_id!r}: {mixed[0]}"

    def settle_late(self, update_id: str, bound_s: float, outputs) -> None:
        """A late answer decides as a timely one, except a success: its caller was told the
        update failed, so weights it believes were never applied must not be served (the
        engine refuses an update it knows was abandoned, so only an update committed before
        the bound can end so)."""
        if _succeeded(outputs):
            self.unsafe = (
                f"distributed weight update {update_id!r} was applied after the engine had "
                f"answered that it failed (no answer within {bound_s:g}s), so its caller "
                "believes it was not applied"
            )
            return
        self.settle(update_id, outputs)

    def give_up(
        self, update_id: str, bound_s: float, answer: asyncio.Future, channel: str
    ) -> Tuple[Optional[Outcome], str]:
        """``answer`` did not come within ``bound_s``: record in ``channel`` that the caller
        is told the update failed, unless engine rank 0 recorded first that it is applying
        it, and hold the update (generation and later updates refused) until its answer
        comes and is settled. The outcome that holds, or None and why nothing was recorded."""
        recorded, why = _abandon(channel, update_id)
        unanswered = _Unanswered(update_id, bound_s, answer, recorded)
        self.unanswered = unanswered
        answer.add_done_callback(
            _late_answer(unanswered, channel, time.monotonic(), self)
        )
        return recorded, why

    def serving_refusal(self) -> Optional[str]:
        """Why generation must not run now, or None."""
        pending = self.pending()
        if pending is not None:
            what = (
                "the update is abandoned and will not be applied, but a scheduler does not "
                "answer: wait for its answer, or restart the engine"
                if pending.recorded is Outcome.ABANDONED
                else "its weights are unknown, possibly mixed: restart the engine"
            )
            return (
                f"generation refused: the engine has not answered distributed weight update "
                f"{pending.update_id!r} within {pending.bound_s:g}s ({NO_ANSWER}); {what}"
            )
        if self.unsafe is not None:
            return f"generation refused until a distributed weight update succeeds: {self.unsafe}"
        return None


def _succeeded(outputs) -> bool:
    return bool(outputs) and all(getattr(o, "success", False) for o in outputs)


class BoundedCommunicator:
    """An upstream communicator whose distributed updates get an answer within their bound.
    Everything else (``handle_recv``, ``set_fan_out``, other requests) goes to ``inner``."""

    def __init__(self, inner, output_cls, guard: _Guard, updates: bool) -> None:
        self._inner, self._output_cls, self._guard, self._updates = (
            inner,
            output_cls,
            guard,
            updates,
        )

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def __call__(self, obj):
        update = distributed_update(obj) if self._updates else None
        if self._updates and update is None:
            return await self._inner(
                obj
            )  # not a distributed update: upstream's wait, unchanged
        pending = self._guard.pending()
        if pending is not None:
            what = (
                f"distributed weight update {update.update_id!r}"
                if update
                else type(obj).__name__
            )
            return [
                self._answer(
                    f"{what} refused: the engine has not answered distributed weight update {pending.update_id!r} "
                    f"(no answer within {pending.bound_s:g}s; {NO_ANSWER}); the engine must be restarted"
                )
            ]
        if update is None:
            return await self._inner(obj)
        update_id, timeout_s, channel = update
        bound = answer_bound_s(timeout_s)
        answer = asyncio.ensure_future(self._inner(obj))
        done, _ = await asyncio.wait({answer}, timeout=bound)
        if done:
            forget(channel, update_id)
            outputs = answer.result()
            self._guard.settle(update_id, outputs)
            return outputs
        recorded, why = self._guard.give_up(update_id, bound, answer, channel)
        message = no_answer_message(update_id, timeout_s, bound, recorded, why)
        logger.error(message)
        return [self._answer(message)]

    def _answer(self, message: str):
        return self._output_cls(success=False, message=message)


def _abandon(channel: str, update_id: str) -> Tuple[Optional[Outcome], str]:
    """Record that the caller is told the update failed, unless engine rank 0 recorded first
    that it is applying it: the outcome that holds, or None and why nothing was recorded."""
    try:
        return decide(channel, update_id, Outcome.ABANDONED), ""
    except (OSError, ValueError, DeliveryError) as e:
        return None, f"{type(e).__name__}: {e}"


def no_answer_message(
    update_id: str,
    timeout_s: float,
    bound: float,
    recorded: Optional[Outcome],
    why: str = "",
) -> str:
    """The answer to an update its schedulers left unanswered past ``bound``: what became of
    it, as its outcome record says."""
    if recorded is Outcome.ABANDONED:
        fate = (
            "The update is abandoned: the engine will not apply it (a scheduler that resumes "
            "refuses it), so the engine keeps the weights of its last update that succeeded; "
            "until the engine answers, generation and updates are refused (if it never "
            "answers, restart the engine)"
        )
    elif recorded is Outcome.COMMITTED:
        fate = (
            "The engine had already committed to applying it when the bound passed: its "
            "weights are unknown (the new ones, or mixed), and generation is refused until a "
            "distributed weight update succeeds"
        )
    else:
        fate = (
            f"Whether the engine may still apply it could not be recorded ({why}): its weights "
            "are unknown, possibly mixed: restart the engine"
        )
    return (
        f"no answer from the engine within {bound:g}s to distributed weight update {update_id!r} "
        f"(timeout_s={timeout_s:g} plus {GRACE_S:g}s grace), waiting for its schedulers to receive "
        f"and apply it: {NO_ANSWER}. {fate}"
    )


def _late_answer(unanswered: _Unanswered, channel: str, since: float, guard: _Guard):
    update_id = unanswered.update_id

    def settle(answer: asyncio.Future) -> None:
        forget(channel, update_id)
        if guard.unanswered is unanswered:
            guard.unanswered = None
        late = time.monotonic() - since
        if answer.cancelled() or answer.exception() is not None:
            logger.error(
                "distributed weight update %r: no late answer (%s)",
                update_id,
                "cancelled" if answer.cancelled() else answer.exception(),
            )
            guard.unsafe = f"distributed weight update {update_id!r} never got an answer: its weights are unknown"
        else:
            logger.error(
                "distributed weight update %r: answered %.1fs after its bound: %s",
                update_id,
                late,
                " | ".join(str(getattr(r, "message", r)) for r in answer.result()),
            )
            guard.settle_late(update_id, unanswered.bound_s, answer.result())

    return settle


def bound_answers(manager) -> None:
    """Wrap ``manager``'s update and session communicators; called at the end of its
    ``init_communicators`` (the response dispatcher keeps the originals' ``handle_recv``)."""
    from sglang.srt.managers import io_struct

    guard = manager._weight_sync_guard = _Guard()
    for name, output in {**UPDATES, **SESSIONS}.items():
        attr = f"{name}_communicator"
        if hasattr(manager, attr) and hasattr(io_struct, output):
            setattr(
                manager,
                attr,
                BoundedCommunicator(
                    getattr(manager, attr),
                    getattr(io_struct, output),
                    guard,
                    name in UPDATES,
                ),
            )


def guard_of(manager) -> Optional[_Guard]:
    """The guard ``bound_answers`` gave ``manager`` (None before it ran): the remote path's
    tokenizer-side steps settle and give up on their updates through it."""
    return getattr(manager, "_weight_sync_guard", None)


def refuse_generation_if_unsafe(manager) -> None:
    """Called first in the tokenizer manager's ``generate_request``: a ``ValueError`` (HTTP 400)
    while a distributed update is unanswered or left the weights mixed (see the module's text)."""
    guard = getattr(manager, "_weight_sync_guard", None)
    refusal = guard.serving_refusal() if guard is not None else None
    if refusal is not None:
        raise ValueError(refusal)


def distributed_update(obj) -> Optional[DistributedUpdate]:
    """Update id, timeout_s and channel of a distributed update, as
    ``UpdateWeightsDistributedReqInput`` or as a tensor-path request with the reserved
    load_format; None for any other request. A timeout the schedulers refuse bounds them
    by the default, as here."""
    if getattr(obj, "load_format", None) == DISTRIBUTED_LOAD_FORMAT:
        control = _read_control(obj.serialized_named_tensors)
    elif type(obj).__name__ == "UpdateWeightsDistributedReqInput":
        control = {
            "update_id": obj.update_id,
            "timeout_s": obj.timeout_s,
            "channel": obj.channel,
        }
    else:
        return None
    try:
        timeout_s = check_timeout(control.get("timeout_s", DEFAULT_TIMEOUT_S))
    except DeliveryError:
        timeout_s = DEFAULT_TIMEOUT_S
    return DistributedUpdate(
        str(control.get("update_id", "")), timeout_s, str(control.get("channel", ""))
    )


def _read_control(payloads) -> dict:
    """The first rank's control dict (every rank gets the same); {} when unreadable
    (the schedulers then refuse the request themselves)."""
    try:
        return read_control(payloads[0])
    except Exception:  # noqa: BLE001 - garbage is the schedulers' to refuse
        return {}
