"""What crosses a process boundary in a distributed weight update, defined once.

* Bounds: the default and largest ``timeout_s``, the grace every engine-side wait adds,
  the smallest bucket.
* The request (``UpdateWeightsDistributedReqInput``): its checks, the flags it shares
  with the tensor path, and the control dict it becomes on the tensor path's reserved
  ``load_format`` (``DISTRIBUTED_LOAD_FORMAT``).
* The channel: a private directory with one ``ipc://`` socket per engine TP rank.
* The payload a trainer rank sends the engine rank beside it: its ``PayloadKind`` and the
  JSON header that describes it, checked before anything is decoded.
* The reply: upstream's ``success``/``message``, per-rank ``FIGURES``, and ``mixed``.

Nothing here talks to a peer; ``delivery`` moves payloads, ``control_plane`` runs the
collectives, ``engine_update`` and ``trainer_flow`` are the two ends.
"""

from __future__ import annotations

import base64
import enum
import io
import json
import math
import os
import pickle
import stat
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = (
    "CARRIED_FIELDS",
    "CHANNEL_PREFIX",
    "CONTROL_FIELDS",
    "ChannelError",
    "DATA_GROUP_TIMEOUT_S",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DISTRIBUTED_LOAD_FORMAT",
    "DeliveryError",
    "FIGURES",
    "GRACE_S",
    "HEADER_BYTES",
    "IPC_PATH_MAX",
    "MAX_TIMEOUT_S",
    "MAX_UPDATE_ID_CHARS",
    "MIN_BUCKET_BYTES",
    "MIXED",
    "PayloadKind",
    "REFUSED",
    "WEIGHTS_RELEASED",
    "answer_bound_s",
    "as_tensor_request",
    "carried",
    "check_timeout",
    "control_dict",
    "decode_header",
    "encode_header",
    "is_mixed",
    "make_channel",
    "read_control",
    "reply_body",
    "request_problems",
    "resolve_channel",
    "socket_path",
    "trainer_bound_s",
)

# ---------------------------------------------------------------------------- bounds

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0  # far below what ZeroMQ's poll (int milliseconds) overflows at
# Slack over ``timeout_s`` for engine-side collectives that follow a bounded wait on another
# rank (every engine rank waits up to timeout_s for its payload before they share problems).
GRACE_S = 30.0
DEFAULT_BUCKET_BYTES = 512 << 20
MIN_BUCKET_BYTES = 1 << 20  # smaller buckets only multiply rounds
MAX_UPDATE_ID_CHARS = 256
HEADER_BYTES = 1 << 20


def answer_bound_s(timeout_s: float) -> float:
    """How long the tokenizer manager waits for the schedulers' answer to an update bounded
    by ``timeout_s``: every scheduler collective waits at most ``timeout_s + GRACE_S``."""
    return timeout_s + GRACE_S


def trainer_bound_s(timeout_s: float) -> float:
    """How long a trainer rank waits, in one barrier, while the engine applies an update
    bounded by ``timeout_s``: the engine waits up to ``timeout_s`` for payloads, then up to
    ``timeout_s + GRACE_S`` for its own ranks."""
    return 2 * timeout_s + GRACE_S


# The timeout of the engine's data-plane group (``executor.DataGroup``): above every bound
# this package waits with (``trainer_bound_s(MAX_TIMEOUT_S)`` is the largest), so that NCCL's
# watchdog never ends a wait before the bound does.
DATA_GROUP_TIMEOUT_S = 2 * (MAX_TIMEOUT_S + GRACE_S)


class DeliveryError(RuntimeError):
    """A request field, channel or payload that is missing, late or malformed."""


class ChannelError(DeliveryError):
    """A channel path that is not a private channel directory of this user."""


def check_timeout(timeout_s) -> float:
    """``timeout_s`` as a float, or DeliveryError: a positive, finite number of seconds up to an hour."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise DeliveryError(
            f"timeout_s={timeout_s!r}: must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
        )
    return float(timeout_s)


# ---------------------------------------------------------------------------- the channel

CHANNEL_PREFIX = "sglang-weights-"
IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


def make_channel() -> str:
    """A new private channel directory (owner-only), for one trainer/engine pairing."""
    return tempfile.mkdtemp(prefix=CHANNEL_PREFIX)


def socket_path(channel: str, engine_rank: int) -> str:
    """Where engine rank ``engine_rank`` listens in ``channel``."""
    return os.path.join(channel, f"tp{engine_rank}.sock")


def resolve_channel(channel, engine_rank: int = 0) -> str:
    """The channel's real path, checked: an existing directory named ``sglang-weights-*``
    (not a symlink), owned by this user, not accessible to group or others, and short
    enough for the socket path of ``engine_rank``. Raises ChannelError naming the problem."""
    if not isinstance(channel, str) or not channel:
        raise ChannelError(f"channel {channel!r}: must be a non-empty path string")
    spelled = os.path.abspath(channel)
    if os.path.islink(spelled):
        raise ChannelError(
            f"channel {channel!r} is a symlink; pass the directory itself"
        )
    real = os.path.realpath(spelled)
    try:
        st = os.lstat(real)
    except OSError as e:
        raise ChannelError(
            f"channel {channel!r} does not exist ({e.strerror})"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ChannelError(f"channel {channel!r} is not a directory")
    if not os.path.basename(real).startswith(CHANNEL_PREFIX):
        raise ChannelError(
            f"channel {channel!r}: the directory's name must start with {CHANNEL_PREFIX!r}"
        )
    if st.st_uid != os.getuid():
        raise ChannelError(
            f"channel {channel!r} is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
        )
    if st.st_mode & 0o077:
        raise ChannelError(
            f"channel {channel!r} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
            "(no group or world access)"
        )
    path = socket_path(real, engine_rank)
    if len(path.encode()) > IPC_PATH_MAX:
        raise ChannelError(
            f"channel {channel!r}: socket path {path!r} is longer than the {IPC_PATH_MAX}-byte "
            "ipc limit; use a shorter directory"
        )
    return real


# ---------------------------------------------------------------------------- the request

# Reserved load_format that routes the existing tensor path (and so existing callers such as
# verl's HTTP client) to the distributed update; each rank's payload is then the control dict.
DISTRIBUTED_LOAD_FORMAT = "distributed_shards"
# Flags a tensor-path request and a distributed request share, where the release has them.
CARRIED_FIELDS = (
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "selector",
    "torch_empty_cache",
)
# The distributed request's own fields, as the control dict of the tensor path carries them.
CONTROL_FIELDS = ("update_id", "channel", "timeout_s", "bucket_bytes")


def request_problems(req) -> List[str]:
    """What is wrong with a request's own fields (empty when nothing): checked by the
    tokenizer manager before any scheduler sees the request, and again by each rank."""
    problems = []
    update_id, bucket = (
        getattr(req, "update_id", None),
        getattr(req, "bucket_bytes", None),
    )
    if not isinstance(update_id, str) or not 0 < len(update_id) <= MAX_UPDATE_ID_CHARS:
        problems.append(
            f"update_id={update_id!r}: must be a non-empty string of at most {MAX_UPDATE_ID_CHARS} "
            "characters"
        )
    try:
        check_timeout(getattr(req, "timeout_s", None))
        resolve_channel(getattr(req, "channel", None))
    except DeliveryError as e:
        problems.append(str(e))
    if bucket is not None and (
        isinstance(bucket, bool)
        or not isinstance(bucket, int)
        or bucket < MIN_BUCKET_BYTES
    ):
        problems.append(
            f"bucket_bytes={bucket!r}: must be None (default {DEFAULT_BUCKET_BYTES}) or an integer "
            f">= {MIN_BUCKET_BYTES} (1 MiB)"
        )
    return problems


def carried(src, accepted: Sequence[str]) -> Dict[str, Any]:
    """The flags of request ``src`` that a request type with fields ``accepted`` also has."""
    return {
        f: getattr(src, f) for f in CARRIED_FIELDS if f in accepted and hasattr(src, f)
    }


def control_dict(req) -> Dict[str, Any]:
    """The control dict a distributed request becomes on the tensor path (one per rank)."""
    return {f: getattr(req, f) for f in CONTROL_FIELDS}


class _NoGlobals(pickle.Unpickler):
    """Loads plain data only: a control dict of strings and numbers needs no global."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def read_control(data) -> Dict[str, Any]:
    """A control dict as the tensor path serialised it (bytes, or base64 text over HTTP);
    raises ``pickle.UnpicklingError`` or ``ValueError`` on anything but plain data."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    control = _NoGlobals(io.BytesIO(bytes(data))).load()
    if not isinstance(control, dict):
        raise ValueError(f"a control payload is a dict, not {type(control).__name__}")
    return control


# ---------------------------------------------------------------------------- the payload


class PayloadKind(str, enum.Enum):
    """What a trainer rank's payload asks of the engine rank beside it."""

    SHARDS = "shards"  # its local shards: the engine reshards within its TP group
    PARAMS = "params"  # parameter-shaped buffers in this rank's layout: the engine only copies
    DESCRIBE = "describe"  # no tensors: publish the engine's manifest into the channel


def encode_header(
    update_id: str,
    trainer_rank: int,
    rank_map: Mapping[int, int],
    tensors: Sequence[Tuple[str, Any]],
    pieces: Sequence[Tuple[str, Any]],
    kind: PayloadKind,
    names: Sequence[str],
    fingerprint: str,
    inline: Optional[Sequence[Tuple[str, Sequence[int]]]],
) -> bytes:
    """The JSON header of a payload: ``tensors`` and ``pieces`` as (name, wire layout or
    None); ``inline``: (dtype, shape) per tensor when they follow as raw frames."""
    header = {
        "update_id": str(update_id),
        "trainer_rank": int(trainer_rank),
        "rank_map": [[int(k), int(v)] for k, v in rank_map.items()],
        "tensors": [[str(n), w] for n, w in tensors],
        "pieces": [[str(n), w] for n, w in pieces],
        "kind": PayloadKind(kind).value,
        "names": [str(n) for n in names],
        "fingerprint": str(fingerprint),
    }
    if inline is not None:
        header["inline"] = [[str(d), [int(s) for s in shape]] for d, shape in inline]
    return json.dumps(header).encode()


def decode_header(frames: List[bytes]) -> dict:
    """The checked header of a message (nothing is unpickled here); DeliveryError when malformed."""
    if not frames or len(frames[0]) > HEADER_BYTES:
        raise DeliveryError(f"{len(frames)} frame(s); expected a header and the shards")
    try:
        header = json.loads(frames[0])
        inline = header.get("inline")
        update_id, trainer, pairs, tensors, pieces = (
            header["update_id"],
            header["trainer_rank"],
            header["rank_map"],
            header["tensors"],
            header["pieces"],
        )
        rank_map = {int(k): int(v) for k, v in pairs}
        kind, names, fingerprint = (
            header.get("kind", "shards"),
            header.get("names", []),
            header.get("fingerprint", ""),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DeliveryError(f"unreadable header: {type(e).__name__}: {e}") from None
    if (
        not isinstance(update_id, str)
        or not isinstance(trainer, int)
        or not _named_pairs(tensors)
        or not _named_pairs(pieces)
        or not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or not isinstance(fingerprint, str)
    ):
        raise DeliveryError("header fields have the wrong types")
    if inline is not None and not (
        _named_pairs(inline) and len(inline) == len(tensors)
    ):
        raise DeliveryError(
            "header field 'inline' must describe each tensor as [dtype, shape]"
        )
    expected = 1 if inline is None else len(inline)
    if len(frames) - 1 != expected:
        raise DeliveryError(
            f"{len(frames)} frame(s); expected a header and {expected} more"
        )
    try:
        kind = PayloadKind(kind)
    except ValueError:
        raise DeliveryError(
            f"unknown payload kind {kind!r}; expected one of {[k.value for k in PayloadKind]}"
        ) from None
    return {
        "update_id": update_id,
        "trainer_rank": trainer,
        "rank_map": rank_map,
        "tensors": tensors,
        "pieces": pieces,
        "kind": kind,
        "names": names,
        "fingerprint": fingerprint,
        "inline": inline,
    }


def _named_pairs(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) for t in value
    )


# ---------------------------------------------------------------------------- the reply

# Why an update that arrives while the memory saver has released the weights is refused.
WEIGHTS_RELEASED = (
    "weights are released (release_memory_occupation); "
    "call resume_memory_occupation(tags=['weights']) first"
)
# Our figures, one list entry per engine TP rank, in reply fields of their own: the message
# keeps upstream's text.
FIGURES = ("bytes_received", "lower_bound_bytes", "peak_staging_bytes")
REFUSED = "distributed weight update refused, no parameter changed: "
# In the message of an update that failed after parameters began to change; the reply's
# ``mixed`` field says the same where the reply type has it (upstream's tensor-path reply does not).
MIXED = "the weights are now MIXED"


def is_mixed(output) -> bool:
    """Whether a scheduler's reply says the weights are mixed: its ``mixed`` field, or, on
    upstream's tensor-path reply type (no such field), its message."""
    mixed = getattr(output, "mixed", None)
    return (
        bool(mixed)
        if mixed is not None
        else MIXED in str(getattr(output, "message", ""))
    )


def reply_body(success: bool, message: str, outputs) -> dict:
    """What ``Engine.update_weights_distributed`` and the HTTP route return: upstream's
    ``success``/``message``, ``mixed``, and the figures of the (single data-parallel)
    scheduler's reply."""
    first = outputs[0] if outputs else None
    return {
        "success": success,
        "message": message,
        "mixed": any(is_mixed(o) for o in outputs or ()),
        **{k: list(getattr(first, k, [])) for k in FIGURES},
    }


def as_tensor_request(req, tp_size: int):
    """The tensor-path request carrying distributed update ``req`` to ``tp_size`` engine
    ranks: each rank's payload is the update's control dict, marked by the reserved
    ``load_format`` (for clients that only have ``update_weights_from_tensor``)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.sglang_compat import field_names

    control = control_dict(req)
    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[
            MultiprocessingSerializer.serialize(control) for _ in range(tp_size)
        ],
        load_format=DISTRIBUTED_LOAD_FORMAT,
        **carried(req, field_names(UpdateWeightsFromTensorReqInput)),
    )
