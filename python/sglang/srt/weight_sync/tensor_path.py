"""A distributed update carried by SGLang's tensor path: ``update_weights_from_tensor``
with the reserved ``load_format`` (``protocol.DISTRIBUTED_LOAD_FORMAT``), whose per-rank
payload is the update's small control dict, not weights.

``as_distributed_request`` turns it into the distributed request the engine's steps take
(0.5.23's scheduler hook). A payload that cannot be read becomes a request every rank
refuses together, carrying why (``problem``).
"""

# pr: here
# On releases whose model runner is the only hook (0.5.10.post1, 0.5.12, 0.5.15.post1),
# ``update_from_payload`` runs the three steps of ``engine_update`` in one call, then the
# model's post-load fixups.
# pr: here end

from __future__ import annotations

import functools
import logging

from sglang.srt.weight_sync.protocol import (
    DEFAULT_TIMEOUT_S,
    DISTRIBUTED_LOAD_FORMAT,
    carried,
)
from sglang.srt.weight_sync.sglang_compat import field_names, subclass_with_field

# isort: split
# pr: here
from typing import Tuple

from sglang.srt.weight_sync.apply import run_post_load
from sglang.srt.weight_sync.engine_update import (
    apply_shards,
    end_of_update,
    receive_shards,
)
from sglang.srt.weight_sync.phase_timing import Phase
from sglang.srt.weight_sync.protocol import MIXED, PayloadKind

# pr: here end

__all__ = (
    "DISTRIBUTED_LOAD_FORMAT",
    "as_distributed_request",
    # pr: here
    "update_from_payload",
    # pr: here end
)

logger = logging.getLogger(__name__)


# pr: here
def update_from_payload(runner, own_payload) -> Tuple[bool, str]:
    """The three steps on releases whose model runner is the only hook (0.5.10, 0.5.12): it
    hands over this rank's control payload; the scheduler then flushes the cache and runs
    upstream's barrier as for any tensor update. These releases have no weight-update session
    whose end would run the model's post-load fixups (MLA's w_kc/w_vc from kv_b_proj), so an
    update that wrote parameters runs them here (``apply.run_post_load``)."""
    recv_req = _control_request(lambda: own_payload, {})
    received = receive_shards(recv_req, runner)
    success, message = apply_shards(
        runner.model, runner.model_config, received, recv_req
    )
    if (
        success and received.payload.kind != PayloadKind.DESCRIBE  # it wrote nothing
    ):
        try:
            with received.clock.phase(Phase.REFRESH):
                run_post_load(runner.model)
        except Exception as e:  # noqa: BLE001 - every parameter is new, what is computed from them may not be
            logger.exception(
                "engine rank %d: the post-load fixups after a distributed weight update failed",
                received.sync.rank,
            )
            success, message = (
                False,
                (
                    f"distributed weight update FAILED after writes on engine rank {received.sync.rank}: "
                    f"the model's post-load fixups raised {type(e).__name__}: {e}: {MIXED} (parameters "
                    "new, tensors computed from them old); generation is refused until a distributed "
                    "weight update succeeds"
                ),
            )
    return end_of_update(received, recv_req, success, message)


# pr: here end
def as_distributed_request(recv_req, deserialize_own_rank):
    """The distributed request behind a tensor-path request with the reserved load_format."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    common = carried(recv_req, field_names(UpdateWeightsDistributedReqInput))
    return _control_request(
        lambda: deserialize_own_rank(recv_req.serialized_named_tensors), common
    )


@functools.lru_cache(maxsize=None)
def _unreadable_request():
    """The request type for a reserved-format payload that could not be read; carries why."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    return subclass_with_field(
        UpdateWeightsDistributedReqInput,
        "UnreadableDistributedRequest",
        "problem",
        str,
        "",
    )


def _control_request(read_control, common: dict):
    """The distributed request from a control payload (``read_control()``) and the flags ``common``.
    A payload that cannot be read gives a request that every rank refuses together."""
    from sglang.srt.managers.io_struct import UpdateWeightsDistributedReqInput

    try:
        own = read_control()
        if not isinstance(own, dict):
            raise TypeError(
                f"the control payload is a {type(own).__name__}, not a dict"
            )
        missing = [k for k in ("update_id", "channel") if k not in own]
        if missing:
            raise KeyError(f"the control payload lacks {missing}")
        return UpdateWeightsDistributedReqInput(
            update_id=own["update_id"],
            channel=own["channel"],
            timeout_s=own.get("timeout_s", DEFAULT_TIMEOUT_S),
            bucket_bytes=own.get("bucket_bytes"),
            **common,
        )
    except Exception as e:  # noqa: BLE001 - garbage, a blocked pickle, missing fields: refuse, never die
        problem = f"unreadable {DISTRIBUTED_LOAD_FORMAT!r} control payload: {type(e).__name__}: {e}"
        logger.error(problem)
        return _unreadable_request()(
            update_id="", channel="", problem=problem, **common
        )
