"""What crosses a process boundary in a distributed weight update, defined once.

* Bounds: the default and largest ``timeout_s``, the grace every engine-side wait adds,
  the smallest bucket.
* The request (``UpdateWeightsDistributedReqInput``): its checks, the flags it shares
  with the tensor path, and the control dict it becomes on the tensor path's reserved
  ``load_format`` (``DISTRIBUTED_LOAD_FORMAT``).
* The channel: a private directory holding the sockets of each engine TP rank
  (``socket_path`` for messages).
* The payload a trainer rank sends the engine rank beside it: its ``PayloadKind`` and the
  JSON header that describes it, checked before anything is decoded.
* The reply: upstream's ``success``/``message``, per-rank ``FIGURES``, ``mixed``, and
  per-rank ``phases`` (``phase_timing``).

Nothing here talks to a peer; ``delivery`` moves payloads, ``control_plane`` runs the
collectives, ``engine_update`` and ``trainer_flow`` are the two ends.
"""

from __future__ import annotations

import base64
import collections
import enum
import functools
import io
import json
import math
import os
import pickle
import re
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = (
    "CARRIED_FIELDS",
    "CHANNEL_PREFIX",
    "CONTROL_FIELDS",
    "CPU_DTYPES",
    "ChannelError",
    "DATA_GROUP_TIMEOUT_S",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DISTRIBUTED_LOAD_FORMAT",
    "DeliveryError",
    "FIGURES",
    "GRACE_ENV",
    "GRACE_S",
    "CUDA_IPC_GLOBALS",
    "HEADER_BYTES",
    "HEADER_BYTES_PER_TENSOR",
    "HEADER_DEPTH",
    "HeaderBound",
    "HeaderTooLarge",
    "LayoutFrames",
    "IPC_PATH_MAX",
    "MAX_TIMEOUT_S",
    "MAX_UPDATE_ID_CHARS",
    "MIN_BUCKET_BYTES",
    "MIXED",
    "MAX_RANK",
    "PayloadKind",
    "REFUSED",
    # pr: scale
    "Fp8Region",
    "Fp8RegionKind",
    # pr: scale end
    "WEIGHTS_RELEASED",
    "answer_bound_s",
    "as_tensor_request",
    "carried",
    "check_timeout",
    "control_dict",
    "decode_header",
    # pr: safety
    "encode_header",
    # pr: safety end
    "grace_from_env",
    "header_fields",
    "is_mixed",
    "make_channel",
    "payload_globals",
    "read_control",
    "reply_body",
    "request_problems",
    "resolve_channel",
    # pr: scale
    "segment_socket_path",
    # pr: scale end
    "socket_path",
    "trainer_bound_s",
    # pr: scale
    "with_head",
    # pr: scale end
)

# ---------------------------------------------------------------------------- bounds

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0  # far below what ZeroMQ's poll (int milliseconds) overflows at
GRACE_ENV = "SGLANG_WEIGHT_SYNC_GRACE_S"


def grace_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The grace in seconds: ``SGLANG_WEIGHT_SYNC_GRACE_S`` if set (in [1, 600]), else 30.

    Read once, when this module is imported: set it alike in the trainer's and the engine's
    processes, before they start (a host whose ranks lag each other by more than 30 s after
    a payload wait needs more; tests that wait out a bound on purpose use less)."""
    raw = environ.get(GRACE_ENV)
    if raw is None:
        return 30.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 1.0 <= value <= 600.0:  # also refuses nan
        raise ValueError(
            f"{GRACE_ENV}={raw!r}: must be a number of seconds in [1, 600]"
        )
    return value


# Slack over ``timeout_s`` for engine-side collectives that follow a bounded wait on another
# rank (every engine rank waits up to timeout_s for its payload before they share problems).
GRACE_S = grace_from_env()
DEFAULT_BUCKET_BYTES = 512 << 20
MIN_BUCKET_BYTES = 1 << 20  # smaller buckets only multiply rounds
MAX_UPDATE_ID_CHARS = 256
# A payload header's bound grows with the engine's model (``HeaderBound``): a fixed part for
# the update's own fields, plus an allowance per tensor the model has. A real entry takes
# about 135 bytes (name, shape, dtype, placements, where its bytes lie); a Megatron-core
# tensor's entry lists the holders of its pieces in this rank's buffers as well.
HEADER_BYTES = 1 << 20
HEADER_BYTES_PER_TENSOR = 2 << 10


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


class HeaderTooLarge(DeliveryError):
    """A payload header over the engine's ``HeaderBound``: refused at once, not dropped."""


@dataclass(frozen=True)
class HeaderBound:
    """How many bytes of a payload header an engine rank reads: ``HEADER_BYTES`` plus
    ``HEADER_BYTES_PER_TENSOR`` for each of the ``tensors`` its model has (its derived
    targets: HF tensors, their aliases, or its parameters, whichever are more). A payload
    describes at most the model's tensors, so a real header of any model size fits, while a
    mistaken or hostile one cannot make the parser read without end. ``tensors=0``: the
    bound before the engine knows its model (``HEADER_BYTES`` alone)."""

    tensors: int = 0

    @property
    def bytes(self) -> int:
        return HEADER_BYTES + HEADER_BYTES_PER_TENSOR * self.tensors

    def __str__(self) -> str:
        if not self.tensors:
            return f"{self.bytes} bytes (its model's tensors are not known)"
        return (
            f"{self.bytes} bytes ({HEADER_BYTES} + {HEADER_BYTES_PER_TENSOR} for each of the "
            f"{self.tensors} tensors of its model)"
        )


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


# pr: scale
def segment_socket_path(channel: str, engine_rank: int) -> str:
    """Where engine rank ``engine_rank`` takes the shared-memory segments of CPU payloads
    in ``channel`` (a unix datagram socket, ``shared_segment``)."""
    return os.path.join(channel, f"tp{engine_rank}.seg")


# pr: scale end
def resolve_channel(channel, engine_rank: int = 0) -> str:
    """The channel's real path, checked: an existing directory named ``sglang-weights-*``
    (not a symlink), owned by this user, not accessible to group or others, and short
    enough for the socket path of ``engine_rank``. Raises ChannelError naming the problem."""
    if not isinstance(channel, str) or not channel:
        raise ChannelError(f"channel {channel!r}: must be a non-empty path string")
    if "\x00" in channel:
        raise ChannelError(
            f"channel {channel!r} holds a NUL byte, which no path can hold"
        )
    if not _encodable(channel):
        raise ChannelError(
            f"channel {channel!r} is not valid UTF-8 (undecodable bytes); pass the "
            "directory make_channel() returned"
        )
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
    if (
        not isinstance(update_id, str)
        or not 0 < len(update_id) <= MAX_UPDATE_ID_CHARS
        or not _encodable(update_id)
    ):
        problems.append(
            f"update_id={update_id!r}: must be a non-empty string of at most "
            f"{MAX_UPDATE_ID_CHARS} characters, valid UTF-8"
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
    # pr: scale
    PARAMS = "params"  # parameter-shaped buffers in this rank's layout: the engine only copies
    DESCRIBE = "describe"  # no tensors: publish the engine's manifest into the channel
    # pr: scale end


# pr: scale
class Fp8RegionKind(str, enum.Enum):
    """How a ``Fp8Region`` of a block-FP8 weight travels in a "params" payload."""

    # quantized by the trainer: e4m3 bytes, then float32 scales (uint8)
    QUANTIZED = "e4m3"
    STAGED = "staged"  # in the weight's staged dtype, shaped as the region: the engine quantizes


@dataclass(frozen=True)
class Fp8Region:
    """Whole blocks of one block-FP8 weight in a "params" payload (``trainer_reshard``):
    its tensor ``key`` carries ``param[index][offsets : offsets + sizes]`` as ``kind``
    says. The header lists them (``fp8_regions``); an engine before this field refuses such
    a header by its unknown key, before reading any tensor."""

    key: str
    kind: Fp8RegionKind
    param: str
    index: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    block: Tuple[int, int]

    @property
    def blocks(self) -> int:
        """Its block grid's size (a ragged last block counts)."""
        n = math.prod(self.sizes[:-2])
        for size, b in zip(self.sizes[-2:], self.block):
            n *= -(-size // b)
        return n

    @property
    def quantized_bytes(self) -> int:
        """A QUANTIZED region's tensor size: one byte per element, four per block."""
        return math.prod(self.sizes) + 4 * self.blocks

    def to_wire(self) -> list:
        return [
            self.key,
            self.kind.value,
            self.param,
            list(self.index),
            list(self.offsets),
            list(self.sizes),
            list(self.block),
        ]

    @staticmethod
    def from_wire(w) -> Fp8Region:
        key, kind, param, index, offsets, sizes, block = w
        return Fp8Region(
            key,
            Fp8RegionKind(kind),
            param,
            tuple(index),
            tuple(offsets),
            tuple(sizes),
            tuple(block),
        )


_REGION_KINDS = frozenset(k.value for k in Fp8RegionKind)


def _is_region_wire(w) -> bool:
    """A ``Fp8Region.to_wire``: names, a kind, an index, a box of two dims or more, a block."""
    return (
        _is_list(w, 7)
        and len(w) == 7
        and _is_str(w[0], MAX_NAME_CHARS)
        and isinstance(w[1], str)
        and w[1] in _REGION_KINDS
        and _is_str(w[2], MAX_NAME_CHARS)
        and _is_shape(w[3])
        and _is_shape(w[4])
        and _is_shape(w[5])
        and len(w[4]) == len(w[5]) >= 2
        and _is_list(w[6], 2)
        and len(w[6]) == 2
        and all(_is_int(b, 1, MAX_SIZE) for b in w[6])
    )


# pr: scale end
def header_fields(
    update_id: str,
    trainer_rank: int,
    rank_map: Mapping[int, int],
    tensors: Sequence[Tuple[str, Any]],
    pieces: Sequence[Tuple[str, Any]],
    kind: PayloadKind,
    names: Sequence[str],
    fingerprint: str,
    inline: Optional[Sequence[Tuple[str, Sequence[int]]]],
    # pr: scale
    # (segment id, (dtype, shape, offset) per tensor) when the tensors lie in a
    # shared-memory segment passed beside the message (``shared_segment``)
    shared: Optional[Tuple[str, Sequence[Tuple[str, Sequence[int], int]]]] = None,
    # the block-FP8 regions a "params" payload carries (``Fp8Region``)
    fp8_regions: Sequence[Fp8Region] = (),
    # pr: scale end
) -> Dict[str, Any]:
    """The fields of a payload's header: ``tensors`` and ``pieces`` as (name, wire layout or
    None); ``inline``: (dtype, shape) per tensor when they follow as raw frames. Each
    distinct device mesh is written once, in ``meshes``, and a tensor's layout names it by
    index: a mesh lists every trainer rank, so repeating it per tensor would grow the
    header with tensors times ranks."""
    meshes: Dict[str, int] = {}
    by_id: Dict[int, int] = {}  # tensors of one mesh share its object: encoded once

    def interned(wire):
        if wire is None:
            return None
        shape, dtype, mesh, placements = wire
        index = by_id.get(id(mesh))
        if index is None:
            index = by_id[id(mesh)] = meshes.setdefault(json.dumps(mesh), len(meshes))
        return [shape, dtype, index, placements]

    header = {
        "update_id": str(update_id),
        "trainer_rank": int(trainer_rank),
        "rank_map": [[int(k), int(v)] for k, v in rank_map.items()],
        "tensors": [[str(n), interned(w)] for n, w in tensors],
        "pieces": [[str(n), w] for n, w in pieces],
        "kind": PayloadKind(kind).value,
        "names": [str(n) for n in names],
        "fingerprint": str(fingerprint),
    }
    if meshes:
        header["meshes"] = [json.loads(m) for m in meshes]
    # pr: scale
    if fp8_regions:
        header["fp8_regions"] = [q.to_wire() for q in fp8_regions]
    # pr: scale end
    if inline is not None:
        header["inline"] = [[str(d), [int(s) for s in shape]] for d, shape in inline]
    # pr: scale
    if shared is not None:
        header["shared"] = [
            str(shared[0]),
            [[str(d), [int(s) for s in shape], int(o)] for d, shape, o in shared[1]],
        ]
    # pr: scale end
    return header


# pr: scale
def with_head(
    fields: Mapping[str, Any],
    update_id: str,
    trainer_rank: int,
    rank_map: Mapping[int, int],
    segment: Optional[str],
) -> Dict[str, Any]:
    """``header_fields`` of another update of the same layout: ``fields`` with its head
    (the update, the trainer rank, the rank map, the segment) replaced and its layout
    fields (the tensors and where they lie) the same objects, so that a sender builds a
    MoE model's layout once and ``LayoutFrames`` finds it unchanged at once."""
    out = dict(fields)
    out["update_id"] = str(update_id)
    out["trainer_rank"] = int(trainer_rank)
    out["rank_map"] = [[int(k), int(v)] for k, v in rank_map.items()]
    if segment is not None:
        out["shared"] = [str(segment), fields["shared"][1]]
    return out


# pr: scale end
# pr: safety
def encode_header(*args, **kwargs) -> bytes:
    """``header_fields`` as one JSON frame (every field in one object; ``LayoutFrames``
    sends the same fields as two frames)."""
    return json.dumps(header_fields(*args, **kwargs)).encode()


# pr: safety end
# The fields of a header that describe the payload's tensors: the same every update of a
# training run, so ``LayoutFrames`` sends them in a frame of their own, kept by both ends.
_LAYOUT_KEYS = frozenset(
    (
        "tensors",
        "pieces",
        "names",
        "fingerprint",
        "meshes",
        "inline",
        # pr: scale
        "placements",
        "fp8_regions",
        # pr: scale end
    )
)


class LayoutFrames:
    """One end's memo of payload layouts. A payload's header is a small head (the update,
    the trainer rank, the kind) and a layout frame (``_LAYOUT_KEYS``: every tensor's name
    and layout, and where its bytes lie): a MoE model's layout is megabytes
    that are the same every update, so the sender encodes it and the receiver parses and
    checks it only when it changed. Each end keeps its last ``keep`` layouts, by their
    fields (sender) or bytes (receiver); a receiver without a memo, or a header in one
    frame (``encode_header``), is read in full."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._sent: List[Tuple[Dict[str, Any], bytes]] = []
        self._read: collections.OrderedDict[bytes, Dict[str, Any]] = (
            collections.OrderedDict()
        )

    def encode(self, fields: Mapping[str, Any]) -> List[bytes]:
        """``header_fields`` as [head, layout] frames."""
        head = {k: v for k, v in fields.items() if k not in _LAYOUT_KEYS}
        layout = {k: v for k, v in fields.items() if k in _LAYOUT_KEYS}
        # pr: scale
        # a payload in a shared-memory segment: the head names the segment, the layout
        # places each tensor in it
        shared = head.pop("shared", None)
        if shared is not None:
            head["segment"], layout["placements"] = shared
        # pr: scale end
        head["layout"] = True
        raw = next((b for f, b in self._sent if f == layout), None)
        if raw is None:
            raw = json.dumps(layout).encode()
            self._sent = [(layout, raw)] + self._sent[: self.keep - 1]
        return [json.dumps(head).encode(), raw]

    def read(self, raw: bytes) -> Optional[Dict[str, Any]]:
        """The checked layout of frame ``raw`` when it was read before (else None)."""
        layout = self._read.get(raw)
        if layout is not None:
            self._read.move_to_end(raw)
        return layout

    def keep_read(self, raw: bytes, layout: Dict[str, Any]) -> None:
        self._read[bytes(raw)] = layout
        while len(self._read) > self.keep:
            self._read.popitem(last=False)


def decode_header(
    frames: List[bytes],
    bound: HeaderBound = HeaderBound(),
    layouts: Optional[LayoutFrames] = None,
) -> dict:
    """The checked header of a message (nothing is unpickled here), or DeliveryError
    saying why it is malformed. Bounded before anything is interpreted: each JSON frame's
    size (``bound``: ``HeaderTooLarge``) and nesting depth are checked before it is parsed,
    numbers must be integers within range (no float, NaN or inf), keys are known and
    unique, and every field has its type, so what a peer sends can neither exhaust the
    parser nor reach later code in a shape it does not expect. Tensor layouts come back
    with their meshes in place (``encode_header`` interns them). The header is one frame,
    or a head and a layout frame (``LayoutFrames``; a layout read before is taken from
    ``layouts`` as it was checked then); ``data_at``: the index of the first data frame; ``memo``: a dict that lives as long as
    the layout is kept, for what the receiver derives from it."""
    if not frames:
        raise DeliveryError("an empty message; expected a header and the shards")
    head = _parse_json(frames[0], bound, "header")
    if head.get("layout") is True:
        if len(frames) < 2:
            raise DeliveryError(
                "a header that names a layout frame, and no second frame"
            )
        _check_keys(head, _HEAD_REQUIRED, _HEAD_KEYS, "header")
        layout = layouts.read(frames[1]) if layouts is not None else None
        if layout is None:
            fields = _parse_json(frames[1], bound, "header's layout frame")
            _check_keys(
                fields, frozenset(("tensors", "pieces")), _LAYOUT_KEYS, "layout"
            )
            layout = _checked_layout(fields)
            if layouts is not None:
                layouts.keep_read(frames[1], layout)
        data_at = 2
        # pr: scale
        segment = head.get("segment")
        if (segment is None) != (layout["placements"] is None):
            raise DeliveryError(
                f"header field 'segment' is {segment!r} for a layout "
                f"{'with' if layout['placements'] is not None else 'without'} placements "
                "in a segment"
            )
        # pr: scale end
    else:
        _check_keys(head, _REQUIRED_KEYS, _HEADER_KEYS, "header")
        fields = {k: head[k] for k in _LAYOUT_KEYS & set(head)}
        # pr: scale
        shared = head.get("shared")
        _check(
            shared is None
            or (
                _is_list(shared, 2)
                and len(shared) == 2
                and _is_str(shared[0], MAX_SEGMENT_ID_CHARS)
            ),
            "shared",
            shared,
            "null, or [segment id, [dtype, shape, offset] for each tensor]",
        )
        segment = None if shared is None else shared[0]
        fields["placements"] = None if shared is None else shared[1]
        # pr: scale end
        layout = _checked_layout(fields)
        data_at = 1
    update_id, trainer = head["update_id"], head["trainer_rank"]
    _check(
        _is_str(update_id, MAX_UPDATE_ID_CHARS) and update_id,
        "update_id",
        update_id,
        f"a non-empty string of at most {MAX_UPDATE_ID_CHARS} characters",
    )
    _check(_is_rank(trainer), "trainer_rank", trainer, f"a rank in [0, {MAX_RANK})")
    pairs = head["rank_map"]
    _check(
        _is_list(pairs, MAX_RANK)
        and all(
            _is_list(p, 2) and len(p) == 2 and all(map(_is_rank, p)) for p in pairs
        ),
        "rank_map",
        pairs,
        "a list of [trainer rank, engine rank] pairs",
    )
    rank_map = {k: v for k, v in pairs}
    _check(len(rank_map) == len(pairs), "rank_map", pairs, "each trainer rank once")
    kind = head.get("kind", PayloadKind.SHARDS.value)
    _check(
        isinstance(kind, str) and kind in _KINDS,
        "kind",
        kind,
        f"one of {sorted(_KINDS)}",
    )
    # pr: scale
    _check(
        not layout["fp8_regions"] or kind == PayloadKind.PARAMS.value,
        "fp8_regions",
        f"{len(layout['fp8_regions'])} entries in a {kind!r} payload",
        'none outside a "params" payload',
    )
    # pr: scale end
    inline = layout["inline"]
    expected = 1 if inline is None else len(inline)
    # pr: scale
    _check(
        segment is None or _is_str(segment, MAX_SEGMENT_ID_CHARS),
        "segment",
        segment,
        f"null or a string of at most {MAX_SEGMENT_ID_CHARS} characters",
    )
    placements = layout["placements"]
    if placements is not None:
        expected = 0  # every tensor lies in the segment
    # pr: scale end
    if len(frames) - data_at != expected:
        raise DeliveryError(
            f"{len(frames)} frame(s); expected a header"
            + (", its layout" if data_at == 2 else "")
            + f" and {expected} more"
        )
    return {
        "update_id": update_id,
        "trainer_rank": trainer,
        "rank_map": rank_map,
        "tensors": layout["tensors"],
        "pieces": layout["pieces"],
        "kind": PayloadKind(kind),
        "names": layout["names"],
        "fingerprint": layout["fingerprint"],
        "inline": inline,
        # pr: scale
        "fp8_regions": layout["fp8_regions"],
        "shared": None if placements is None else [segment, placements],
        # pr: scale end
        "data_at": data_at,
        "memo": layout["memo"],
    }


def _parse_json(raw: bytes, bound: HeaderBound, what: str) -> dict:
    """A JSON object read from ``raw`` within ``bound`` and ``HEADER_DEPTH`` (integers only,
    unique keys), or DeliveryError."""
    if len(raw) > bound.bytes:
        raise HeaderTooLarge(
            f"a payload {what} of {len(raw)} bytes; this engine rank reads at most {bound}: "
            "a payload describes at most the model's tensors (is the trainer updating "
            "another model?)"
        )
    depth = _nesting_depth(bytes(raw))
    if depth > HEADER_DEPTH:
        raise DeliveryError(
            f"the {what} nests deeper than {HEADER_DEPTH} levels; a real one nests "
            "a few levels"
        )
    try:
        fields = json.loads(
            bytes(raw),
            parse_float=_no_float,
            parse_constant=_no_float,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError and ours are ValueError
        raise DeliveryError(f"unreadable {what}: {e}") from None
    if not isinstance(fields, dict):
        raise DeliveryError(
            f"the {what} is a JSON {type(fields).__name__}, not an object"
        )
    return fields


def _check_keys(fields: dict, required, known, what: str) -> None:
    unknown = sorted(set(fields) - known)
    missing = sorted(required - set(fields))
    if unknown or missing:
        raise DeliveryError(
            f"{what} keys: unknown {unknown}, missing {missing}; expected "
            f"{sorted(known)}"
        )


def _checked_layout(fields: dict) -> Dict[str, Any]:
    """The layout fields of a header (``_LAYOUT_KEYS``), checked, meshes in place."""
    meshes = fields.get("meshes", [])
    _check(
        _is_list(meshes) and all(_is_mesh(m) for m in meshes),
        "meshes",
        meshes,
        "a list of meshes of ranks",
    )
    tensors, pieces = fields["tensors"], fields["pieces"]
    _check(
        _is_list(tensors)
        and all(
            _is_entry(t, functools.partial(_is_interned_wire, len(meshes)), True)
            for t in tensors
        ),
        "tensors",
        tensors,
        f"a list of [name, [shape, dtype, mesh index below {len(meshes)}, placements] "
        "or null]",
    )
    tensors = [
        [n, None if w is None else [w[0], w[1], meshes[w[2]], w[3]]] for n, w in tensors
    ]
    _check(
        _is_list(pieces) and all(_is_entry(t, _is_holders_wire) for t in pieces),
        "pieces",
        pieces,
        'a list of [name, ["holders", shape, dtype, holders]]',
    )
    names = fields.get("names", [])
    fingerprint = fields.get("fingerprint", "")
    _check(
        _is_list(names) and all(_is_str(n, MAX_NAME_CHARS) for n in names),
        "names",
        names,
        "a list of tensor names",
    )
    _check(_is_str(fingerprint, MAX_NAME_CHARS), "fingerprint", fingerprint, "a string")
    inline = fields.get("inline")
    _check(
        inline is None
        or (
            _is_list(inline)
            and len(inline) == len(tensors)
            and all(
                _is_list(d, 2)
                and len(d) == 2
                and _is_str(d[0], MAX_NAME_CHARS)
                and _is_shape(d[1])
                for d in inline
            )
        ),
        "inline",
        inline,
        "null or [dtype, shape] for each tensor",
    )
    # pr: scale
    regions = fields.get("fp8_regions", [])
    keys = {n for n, _ in tensors}
    _check(
        _is_list(regions)
        and all(_is_region_wire(q) for q in regions)
        and len({q[0] for q in regions}) == len(regions)
        and all(q[0] in keys for q in regions),
        "fp8_regions",
        regions,
        "a list of [tensor key, kind, parameter, index, offsets, sizes, [rows, columns]], each "
        "naming one of the payload's tensors once",
    )
    placements = fields.get("placements")
    _check(
        placements is None
        or (
            inline is None
            and _is_list(placements)
            and len(placements) == len(tensors)
            and all(
                _is_list(d, 3)
                and len(d) == 3
                and _is_str(d[0], MAX_NAME_CHARS)
                and _is_shape(d[1])
                and _is_int(d[2], 0, MAX_SIZE)
                for d in placements
            )
        ),
        "shared",
        placements,
        "null, or (without inline) [dtype, shape, offset] for each tensor",
    )
    # pr: scale end
    return {
        "tensors": tensors,
        "pieces": pieces,
        "names": names,
        "fingerprint": fingerprint,
        "inline": inline,
        # pr: scale
        "placements": placements,
        "fp8_regions": tuple(Fp8Region.from_wire(q) for q in regions),
        # pr: scale end
        # what a receiver derives from this layout (its specs), kept as long as the layout
        "memo": {},
    }


# Header bounds: a real header nests a few levels (an entry's mesh of ranks is the deepest);
# ranks, sizes and names stay far below these.
HEADER_DEPTH = 32
MAX_RANK = 1 << 24
MAX_SIZE = 1 << 62
MAX_NDIM = 64
MAX_NAME_CHARS = 4096
# pr: scale
MAX_SEGMENT_ID_CHARS = 64
# pr: scale end
_REQUIRED_KEYS = frozenset(
    ("update_id", "trainer_rank", "rank_map", "tensors", "pieces")
)
_HEADER_KEYS = _REQUIRED_KEYS | {
    "kind",
    "names",
    "fingerprint",
    "inline",
    # pr: scale
    "shared",
    "fp8_regions",
    # pr: scale end
    "meshes",
}
_HEAD_REQUIRED = frozenset(("update_id", "trainer_rank", "rank_map", "layout"))
_HEAD_KEYS = _HEAD_REQUIRED | {
    "kind",
    # pr: scale
    "segment",
    # pr: scale end
}
_KINDS = frozenset(k.value for k in PayloadKind)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = frozenset(b"[{")


def _nesting_depth(raw: bytes) -> int:
    """How deep the JSON text ``raw`` nests (strings left out), without parsing it; stops
    counting past ``HEADER_DEPTH``."""
    depth = deepest = 0
    for c in _JSON_STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS):
        if c in _OPENING:
            depth += 1
            if depth > HEADER_DEPTH:
                return depth
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _no_float(text: str):
    raise ValueError(f"{text} is not an integer (a header holds integers only)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise ValueError(f"the integer {text[:24]}... is out of range")
    return int(text)


def _unique_keys(pairs) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"an object repeats a key ({sorted(keys)})")
    return dict(pairs)


def _check(ok, field: str, value, expected: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 120 else shown[:120] + "..."
        raise DeliveryError(f"header field {field!r} is {shown}; expected {expected}")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8
        return False
    return True


def _is_list(value, most: int = MAX_SIZE) -> bool:
    return isinstance(value, list) and len(value) <= most


def _is_int(value, low: int, high: int) -> bool:
    return type(value) is int and low <= value < high


def _is_rank(value) -> bool:
    return _is_int(value, 0, MAX_RANK)


def _is_str(value, most: int) -> bool:
    return isinstance(value, str) and len(value) <= most and _encodable(value)


def _is_shape(value) -> bool:
    return _is_list(value, MAX_NDIM) and all(_is_int(n, 0, MAX_SIZE) for n in value)


def _is_mesh(value, depth: int = 0) -> bool:
    if value is None or _is_rank(value):
        return True
    return (
        depth < MAX_NDIM
        and isinstance(value, list)
        and all(_is_mesh(v, depth + 1) for v in value)
    )


_PLACEMENT_ARITY = {"S": 1, "SS": 2, "R": 0}


def _is_placement(p) -> bool:
    """("S", dim), ("SS", dim, split factor), ("R",), or a placement type's name alone
    (refused by name when the layout is read)."""
    if not (_is_list(p, 3) and p and _is_str(p[0], 64)):
        return False
    arity = _PLACEMENT_ARITY.get(p[0], 0)
    return len(p) == 1 + arity and all(_is_int(n, 0, MAX_SIZE) for n in p[1:])


def _is_mesh_wire(w) -> bool:
    """A ``MeshSpec`` on the wire: [shape, dtype, mesh of ranks, placements]."""
    return (
        _is_list(w, 4)
        and len(w) == 4
        and _is_shape(w[0])
        and _is_str(w[1], 64)
        and _is_mesh(w[2])
        and _is_list(w[3], MAX_NDIM)
        and all(_is_placement(p) for p in w[3])
    )


def _is_interned_wire(meshes: int, w) -> bool:
    """A ``MeshSpec`` in a payload header: its mesh an index into the header's meshes."""
    return (
        _is_list(w, 4)
        and len(w) == 4
        and _is_int(w[2], 0, meshes)
        and _is_mesh_wire([w[0], w[1], None, w[3]])
    )


def _is_holder(h) -> bool:
    return (
        _is_list(h, 6)
        and len(h) == 6
        and _is_rank(h[0])
        and all(_is_shape(h[i]) for i in (1, 2, 4, 5))
        and _is_str(h[3], MAX_NAME_CHARS)
    )


def _is_holders_wire(w) -> bool:
    """A ``HoldersSpec`` on the wire: ["holders", shape, dtype, holders]."""
    return (
        _is_list(w, 4)
        and len(w) == 4
        and w[0] == "holders"
        and _is_shape(w[1])
        and _is_str(w[2], 64)
        and _is_list(w[3])
        and all(_is_holder(h) for h in w[3])
    )


def _is_entry(entry, is_wire, may_be_null: bool = False) -> bool:
    return (
        _is_list(entry, 2)
        and len(entry) == 2
        and _is_str(entry[0], MAX_NAME_CHARS)
        and ((may_be_null and entry[1] is None) or is_wire(entry[1]))
    )


# The dtypes a CPU tensor travels in, by their names in ``torch`` (a header names one as
# ``str(dtype)``, "torch.bfloat16"): ``delivery.INLINE_DTYPES``
CPU_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)

# What a pickled payload frame may name, by payload kind: only CUDA tensors travel pickled
# (as CUDA IPC handles), so only the globals that rebuild one from its handle, and only on an
# engine with CUDA; CPU tensors travel inline, described by the header (nothing unpickled).
# Nothing here passes fds, connects to a socket or waits on a peer (SGLang's own unpickler
# allows fd passing, ``DupFd``, which connects to a socket the sender names and waits
# there).
# pr: scale
# A "describe" payload carries no tensors.
# CPU tensors may also lie in a shared-memory segment (``shared_segment``), described by the
# header too.
# pr: scale end
_DTYPES = (
    "bfloat16",
    "bool",
    "complex128",
    "complex64",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "int16",
    "int32",
    "int64",
    "int8",
    "uint16",
    "uint32",
    "uint64",
    "uint8",
)
CUDA_IPC_GLOBALS = frozenset(
    (
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "UntypedStorage"),
        *(("torch", d) for d in _DTYPES),
    )
)


def payload_globals(kind: PayloadKind, cuda: bool) -> frozenset:
    """The globals a pickled frame of a ``kind`` payload may name on an engine with
    (``cuda``) or without CUDA: CUDA IPC's rebuild of a tensor, or nothing."""
    if not cuda:
        return frozenset()
    kind = PayloadKind(kind)
    # pr: scale
    if kind == PayloadKind.DESCRIBE:  # it carries no tensors
        return frozenset()
    # pr: scale end
    return CUDA_IPC_GLOBALS


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
    ``success``/``message``, ``mixed``, the figures of the (single data-parallel)
    scheduler's reply, and its ``phases`` (``phase_timing``: per phase or counter, one
    value per engine TP rank; empty where the reply has none)."""
    first = outputs[0] if outputs else None
    return {
        "success": success,
        "message": message,
        "mixed": any(is_mixed(o) for o in outputs or ()),
        **{k: list(getattr(first, k, [])) for k in FIGURES},
        "phases": {
            k: list(v) for k, v in (getattr(first, "phases", None) or {}).items()
        },
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
