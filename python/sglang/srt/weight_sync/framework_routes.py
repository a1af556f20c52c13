"""Routes that an RL framework's own SGLang build adds and its released code calls, answered
here so that code runs unchanged on this wheel: slime's ``/weight_version`` (and
``/get_weight_version``, which upstream answers 404 since 0.5.15), ``/post_process_weights``
and ``/pull_weights``. The http_server patch adds thin handlers; what each one answers is
decided here, without touching the engine's processes.

* The weight version is the one every update records (``weight_version`` of each update).
* ``/post_process_weights`` restores and repacks quantized layers around an update in slime's
  build; slime calls it for compressed-tensors models only. On a model without quantization
  there is nothing to restore or repack, so it succeeds doing nothing; on a quantized model it
  is refused, naming what is missing.
* ``/pull_weights`` copies or patches a host-local checkpoint in slime's build (its delta
  sync); this wheel has no such pull, and the refusal names what to call instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Dict, Optional

__all__ = (
    "POST_PROCESS_FIELDS",
    "RouteReply",
    "post_process_weights_reply",
    "pull_weights_reply",
    "weight_version_reply",
)

# The body of slime's post_process_weights request (SGLangEngine.post_process_weights).
POST_PROCESS_FIELDS = ("restore_weights_before_load", "post_process_quantization")

PULL_WEIGHTS_REFUSED = (
    "/pull_weights (slime's host-local checkpoint pull for --update-weight-local-checkpoint-dir "
    "and --update-weight-mode delta, from slime's own SGLang patch) is not served by this "
    "wheel. Reload the published checkpoint with /update_weights_from_disk instead (slime: "
    "--update-weight-mode full --update-weight-transport disk without "
    "--update-weight-local-checkpoint-dir), or update without disk: "
    "/update_weights_from_distributed (slime's nccl transport) or this wheel's weight-sync "
    "group (/join_weight_sync_group, then /update_weights_remote), which sends only the bytes "
    "each engine rank keeps."
)


@dataclass(frozen=True)
class RouteReply:
    """What a route answers: the HTTP status and the JSON body."""

    status: int
    body: Dict[str, Any]


def weight_version_reply(tokenizer_manager) -> RouteReply:
    """``GET /weight_version``: the weight version the last update recorded."""
    from sglang.srt.weight_sync.sglang_compat import weight_version

    return RouteReply(
        HTTPStatus.OK, {"weight_version": weight_version(tokenizer_manager)}
    )


def _refused(status: HTTPStatus, message: str) -> RouteReply:
    return RouteReply(status, {"success": False, "message": message})


def post_process_weights_reply(raw: bytes, quantization: Optional[str]) -> RouteReply:
    """``POST /post_process_weights`` with body ``raw`` on a model of ``quantization`` (the
    engine's ``model_config.quantization``, None without quantization)."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        return _refused(
            HTTPStatus.BAD_REQUEST, f"post_process_weights: body is not JSON: {e}"
        )
    if not isinstance(body, dict):
        return _refused(
            HTTPStatus.BAD_REQUEST,
            f"post_process_weights: expected a JSON object with {list(POST_PROCESS_FIELDS)}, "
            f"got {type(body).__name__}",
        )
    unknown = sorted(set(body) - set(POST_PROCESS_FIELDS))
    wrong = sorted(
        k for k in POST_PROCESS_FIELDS if k in body and not isinstance(body[k], bool)
    )
    if unknown or wrong:
        return _refused(
            HTTPStatus.BAD_REQUEST,
            f"post_process_weights: unknown fields {unknown}, not booleans {wrong}; "
            f"expected {list(POST_PROCESS_FIELDS)}",
        )
    asked = [k for k in POST_PROCESS_FIELDS if body.get(k)]
    if not asked:
        return RouteReply(
            HTTPStatus.OK, {"success": True, "message": "Nothing requested."}
        )
    if quantization is None:
        return RouteReply(
            HTTPStatus.OK,
            {
                "success": True,
                "message": f"Success: the model is not quantized, {asked} has nothing to "
                "restore or repack.",
            },
        )
    return _refused(
        HTTPStatus.NOT_IMPLEMENTED,
        f"post_process_weights {asked}: restoring and repacking {quantization!r} layers "
        "around an update (slime's own SGLang patch) is not served by this wheel; update "
        "quantized rollouts with a build that has it, or serve an unquantized model.",
    )


def pull_weights_reply() -> RouteReply:
    """``POST /pull_weights``: refused, naming the calls that update instead."""
    return _refused(HTTPStatus.NOT_IMPLEMENTED, PULL_WEIGHTS_REFUSED)
