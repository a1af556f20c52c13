"""Implicit one-shot weight-update sessions, for callers written before SGLang 0.5.23.

0.5.23 refuses ``update_weights_from_tensor`` / ``update_weights_from_distributed``
(and our ``update_weights_distributed``) outside ``begin_weight_update()`` ...
``end_weight_update()``. Callers written against earlier releases (verl 0.9.x's HTTP
adapter, AReaL 1.0.x) never open a session, so their update was refused and the
trainer ranks waiting for it hung. Here an update that arrives with no session open
runs inside a session of its own: begin (with the request's selector), the update,
end -- SGLang's own handlers, so end runs ``post_load_weights`` exactly when the
update loaded no weights through ``model.load_weights``, as an explicit session would.
An update sent inside an explicit session runs in it, unchanged.

A distributed update (ours, or the tensor path's reserved ``load_format``) that arrives
while the memory saver has released the weights is refused here, before any session,
payload or collective, on every TP rank alike (the released tags are replicated): the
engine keeps serving, and nothing writes into released memory. The release itself passes
here too (0.5.23): after SGLang's own, the weight sync's data group is dropped
(``release_with_data_group``), so that NCCL's buffers go with the engine's memory.
"""

from __future__ import annotations

import functools
import logging

__all__ = (
    "SESSION_UPDATES",
    "refusal_while_released",
    "release_with_data_group",
    "run_in_session",
    "with_implicit_sessions",
)

logger = logging.getLogger(__name__)

# request type name -> the scheduler weight-updater method that needs a session
SESSION_UPDATES = {
    "UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
    "UpdateWeightsFromDistributedReqInput": "update_weights_from_distributed",
    "UpdateWeightsDistributedReqInput": "update_weights_distributed",
}


def refusal_while_released(manager, recv_req):
    """The reply refusing a distributed update while the weights are released, or None.
    ``manager``: what holds SGLang's ``offload_tags`` (0.5.23's weight-updater manager;
    on older releases the scheduler, whose tensor-path handler calls this, patch 0007)."""
    from sglang.srt.managers import io_struct
    from sglang.srt.weight_sync.protocol import (
        DISTRIBUTED_LOAD_FORMAT,
        REFUSED,
        WEIGHTS_RELEASED,
    )
    from sglang.srt.weight_sync.sglang_compat import weights_released

    if isinstance(recv_req, io_struct.UpdateWeightsDistributedReqInput):
        output_cls = io_struct.UpdateWeightsDistributedReqOutput
    elif (
        isinstance(recv_req, io_struct.UpdateWeightsFromTensorReqInput)
        and recv_req.load_format == DISTRIBUTED_LOAD_FORMAT
    ):
        output_cls = io_struct.UpdateWeightsFromTensorReqOutput
    else:
        return None
    if not weights_released(manager):
        return None
    logger.error("distributed weight update refused: %s", WEIGHTS_RELEASED)
    return output_cls(success=False, message=REFUSED + WEIGHTS_RELEASED)


def run_in_session(manager, update, recv_req):
    """``update(recv_req)`` inside the open session, or inside a one-shot one (on releases
    with sessions; before 0.5.23 it just runs).

    ``begin_weight_update`` refuses only when a session is already open (the state is
    replicated on every TP rank, so every rank takes the same branch); then the
    update runs in that session and leaves it open. A distributed update while the
    weights are released is refused first (``refusal_while_released``).
    """
    refusal = refusal_while_released(manager, recv_req)
    if refusal is not None:
        return refusal
    # pr: here
    from sglang.srt.weight_sync.sglang_compat import has_weight_update_sessions

    if not has_weight_update_sessions():  # older releases: nothing to open
        return update(recv_req)
    # pr: here end
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
    )

    begun = manager.begin_weight_update(
        BeginWeightUpdateReqInput(selector=recv_req.selector)
    )
    if not begun.success:
        return update(recv_req)
    logger.debug(
        "%s without an open session: running it in a one-shot session",
        type(recv_req).__name__,
    )
    try:
        return update(recv_req)
    finally:
        manager.end_weight_update(EndWeightUpdateReqInput())


def with_implicit_sessions(dispatcher, manager):
    """The scheduler's dispatcher with each update in ``SESSION_UPDATES`` run through
    ``run_in_session``, and the memory saver's release dropping the weight sync's data group
    (``release_with_data_group``)."""
    from sglang.srt.managers import io_struct
    from sglang.utils import TypeBasedDispatcher

    wrapped = TypeBasedDispatcher(
        [
            (
                getattr(io_struct, req),
                functools.partial(run_in_session, manager, getattr(manager, method)),
            )
            for req, method in SESSION_UPDATES.items()
        ]
        + [
            (
                io_struct.ReleaseMemoryOccupationReqInput,
                functools.partial(release_with_data_group, manager),
            )
        ]
    )
    wrapped += dispatcher  # every other request type, handled as before
    return wrapped


def release_with_data_group(manager, recv_req):
    """SGLang's ``release_memory_occupation`` (0.5.23's weight-updater manager), then the
    weight sync's data group dropped on this TP rank (``engine_update.release_data_group``):
    NCCL's buffers go with the engine's memory. Older releases call the latter from their
    scheduler's own release (patch 0007)."""
    from sglang.srt.weight_sync.engine_update import release_data_group

    out = manager.release_memory_occupation(recv_req)
    release_data_group(manager.tp_worker)
    return out
