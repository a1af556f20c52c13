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

The same guard keeps the engine from serving weights nobody can vouch for: while an
update is unanswered (its schedulers' weights are unknown), or after one failed once
writes had begun (some parameters new, some old), generation requests are refused
(``refuse_generation_if_unsafe``, a ``ValueError`` as upstream's own request checks
raise: HTTP 400) until a distributed update succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional, Tuple

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
    "bound_answers",
    "distributed_update",
    "guard_of",
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


@dataclass
class _Unanswered:
    """A distributed update whose answer did not come within its bound (still awaited)."""

    update_id: str
    bound_s: float
    answer: asyncio.Future


class _Guard:
    """What the wrapped communicators of one tokenizer manager share: the unanswered update,
    and the answer that said the weights are mixed (until an update succeeds)."""

    def __init__(self) -> None:
        self.unanswered: Optional[_Unanswered] = None
        self.mixed: Optional[str] = None

    def pending(self) -> Optional[_Unanswered]:
        if self.unanswered is not None and self.unanswered.answer.done():
            self.unanswered = None
        return self.unanswered

    def settle(self, update_id: str, outputs) -> None:
        """What an update's answer says of the weights: a success on every scheduler makes them
        whole, a failure after writes began mixed; a refusal (nothing written) leaves them as they were."""
        if outputs and all(getattr(o, "success", False) for o in outputs):
            self.mixed = None
            return
        mixed = [o.message for o in outputs if is_mixed(o)]
        if mixed:
            self.mixed = f"distributed weight update {update_id!r}: {mixed[0]}"

    def hold(self, update_id: str, bound: float, answer: asyncio.Future) -> None:
        """An update whose answer did not come within ``bound``: until it comes (then it is
        settled), its weights are unknown and generation and later updates are refused."""
        self.unanswered = _Unanswered(update_id, bound, answer)
        answer.add_done_callback(_late_answer(update_id, time.monotonic(), self))

    def serving_refusal(self) -> Optional[str]:
        """Why generation must not run now, or None."""
        pending = self.pending()
        if pending is not None:
            return (
                f"generation refused: the engine has not answered distributed weight update "
                f"{pending.update_id!r} within {pending.bound_s:g}s ({NO_ANSWER}); its weights are unknown, "
                "possibly mixed: restart the engine"
            )
        if self.mixed is not None:
            return f"generation refused until a distributed weight update succeeds: {self.mixed}"
        return None


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
                f"distributed weight update {update[0]!r}"
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
        update_id, timeout_s = update
        bound = answer_bound_s(timeout_s)
        answer = asyncio.ensure_future(self._inner(obj))
        done, _ = await asyncio.wait({answer}, timeout=bound)
        if done:
            outputs = answer.result()
            self._guard.settle(update_id, outputs)
            return outputs
        self._guard.hold(update_id, bound, answer)
        message = (
            f"no answer from the engine within {bound:g}s to distributed weight update {update_id!r} "
            f"(timeout_s={timeout_s:g} plus {GRACE_S:g}s grace), waiting for its schedulers to receive and apply "
            f"it: {NO_ANSWER}. Its weights are unknown, possibly mixed: restart the engine"
        )
        logger.error(message)
        return [self._answer(message)]

    def _answer(self, message: str):
        return self._output_cls(success=False, message=message)


def _late_answer(update_id: str, since: float, guard: _Guard):
    def settle(answer: asyncio.Future) -> None:
        late = time.monotonic() - since
        if answer.cancelled() or answer.exception() is not None:
            logger.error(
                "distributed weight update %r: no late answer (%s)",
                update_id,
                "cancelled" if answer.cancelled() else answer.exception(),
            )
            guard.mixed = f"distributed weight update {update_id!r} never got an answer: its weights are unknown"
        else:
            logger.error(
                "distributed weight update %r: answered %.1fs after its bound: %s",
                update_id,
                late,
                " | ".join(str(getattr(r, "message", r)) for r in answer.result()),
            )
            guard.settle(update_id, answer.result())

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
    tokenizer-side steps settle and hold their updates through it."""
    return getattr(manager, "_weight_sync_guard", None)


def refuse_generation_if_unsafe(manager) -> None:
    """Called first in the tokenizer manager's ``generate_request``: a ``ValueError`` (HTTP 400)
    while a distributed update is unanswered or left the weights mixed (see the module's text)."""
    guard = getattr(manager, "_weight_sync_guard", None)
    refusal = guard.serving_refusal() if guard is not None else None
    if refusal is not None:
        raise ValueError(refusal)


def distributed_update(obj) -> Optional[Tuple[str, float]]:
    """(update id, timeout_s) of a distributed update, as ``UpdateWeightsDistributedReqInput``
    or as a tensor-path request with the reserved load_format; None for any other request.
    A timeout the schedulers refuse bounds them by the default, as here."""
    if getattr(obj, "load_format", None) == DISTRIBUTED_LOAD_FORMAT:
        control = _read_control(obj.serialized_named_tensors)
    elif type(obj).__name__ == "UpdateWeightsDistributedReqInput":
        control = {"update_id": obj.update_id, "timeout_s": obj.timeout_s}
    else:
        return None
    try:
        timeout_s = check_timeout(control.get("timeout_s", DEFAULT_TIMEOUT_S))
    except DeliveryError:
        timeout_s = DEFAULT_TIMEOUT_S
    return str(control.get("update_id", "")), timeout_s


def _read_control(payloads) -> dict:
    """The first rank's control dict (every rank gets the same); {} when unreadable
    (the schedulers then refuse the request themselves)."""
    try:
        return read_control(payloads[0])
    except Exception:  # noqa: BLE001 - garbage is the schedulers' to refuse
        return {}
