"""Deliver: each trainer rank hands only its own shards to the engine rank beside it.

The channel is a private directory (mode 0700, named ``sglang-weights-*``)
holding one ZeroMQ ``ipc://`` socket per engine TP rank. A channel is an
identity, not a string: it is resolved (``realpath``) and checked before any
socket is bound or connected, so every spelling of one directory is one
channel. A trainer rank PUSHes one two-part message: a JSON header (the update
id, which trainer rank it is, the map from trainer ranks to engine ranks, each
tensor's name and ``MeshSpec``; fused local buffers (Megatron-core) travel
without a spec, and the HF tensors they hold pieces of come with
``HoldersSpec``s) and its local tensors. CUDA tensors go as CUDA IPC handles
(SGLang's ``MultiprocessingSerializer``), so no payload bytes are copied or
gathered; CPU tensors (tests, CPU engines) travel inline, one frame each after
the header, described by dtype and shape: no shared-memory manager (torch's
answers within 1 s or fails, which a loaded 2-core machine misses), no
multiprocessing authkey (an engine launched separately has another), nothing
left in /dev/shm, and nothing unpickled. The engine reads and checks the header
before it unpickles or decodes anything, refuses update ids it has already
consumed, and never dies of a malformed message.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import zmq

from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.source_layout import HoldersSpec, MeshSpec

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0  # far below what ZeroMQ's poll (int milliseconds) overflows at
CHANNEL_PREFIX = "sglang-weights-"
IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
MAX_CHANNELS = 8  # bound sockets per engine rank; the least recently used one is retired
CONSUMED_IDS = 4096  # update ids remembered per engine rank, to refuse replays
HEADER_BYTES = 1 << 20
PAYLOAD_KINDS = ("shards", "params", "describe")


class DeliveryError(RuntimeError):
    """A payload that did not arrive, arrived late, or is malformed."""


class ChannelError(DeliveryError):
    """A channel path that is not a private channel directory of this user."""


def make_channel() -> str:
    """A new private channel directory (owner-only), for one trainer/engine pairing."""
    return tempfile.mkdtemp(prefix=CHANNEL_PREFIX)


def check_timeout(timeout_s) -> float:
    """``timeout_s`` as a float, or DeliveryError: a positive, finite number of seconds up to an hour."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise DeliveryError(f"timeout_s={timeout_s!r}: must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    return float(timeout_s)


def _socket_path(channel: str, engine_rank: int) -> str:
    return os.path.join(channel, f"tp{engine_rank}.sock")


def resolve_channel(channel, engine_rank: int = 0) -> str:
    """The channel's real path, checked: an existing directory named ``sglang-weights-*``
    (not a symlink), owned by this user, not accessible to group or others, and short
    enough for the socket path of ``engine_rank``. Raises ChannelError naming the problem."""
    if not isinstance(channel, str) or not channel:
        raise ChannelError(f"channel {channel!r}: must be a non-empty path string")
    spelled = os.path.abspath(channel)
    if os.path.islink(spelled):
        raise ChannelError(f"channel {channel!r} is a symlink; pass the directory itself")
    real = os.path.realpath(spelled)
    try:
        st = os.lstat(real)
    except OSError as e:
        raise ChannelError(f"channel {channel!r} does not exist ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ChannelError(f"channel {channel!r} is not a directory")
    if not os.path.basename(real).startswith(CHANNEL_PREFIX):
        raise ChannelError(f"channel {channel!r}: the directory's name must start with {CHANNEL_PREFIX!r}")
    if st.st_uid != os.getuid():
        raise ChannelError(f"channel {channel!r} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise ChannelError(f"channel {channel!r} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
                           "(no group or world access)")
    path = _socket_path(real, engine_rank)
    if len(path.encode()) > IPC_PATH_MAX:
        raise ChannelError(f"channel {channel!r}: socket path {path!r} is longer than the {IPC_PATH_MAX}-byte "
                           "ipc limit; use a shorter directory")
    return real


@dataclass
class Payload:
    """What one engine rank received: the trainer's local tensors beside it (by buffer key)
    and the layouts of the HF tensors they hold (by HF name). ``kind`` "shards": for
    engine-side resharding; "params": parameter-shaped buffers already in this rank's
    layout (trainer-side, one hop), filled from the HF tensors ``names`` and planned
    against the engine manifest ``fingerprint``; "describe": a request to publish the
    engine's manifest (``manifest.py``)."""

    update_id: str
    trainer_rank: int
    rank_map: Dict[int, int]
    tensors: Dict[str, torch.Tensor]
    specs: Dict[str, Union[MeshSpec, HoldersSpec]]
    kind: str = "shards"
    names: Tuple[str, ...] = ()
    fingerprint: str = ""


def local_shard(tensor: torch.Tensor, spec: Optional[MeshSpec] = None) -> Tuple[torch.Tensor, MeshSpec]:
    """A DTensor's local shard and layout (never ``full_tensor()``), or a plain tensor
    with its explicit spec."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local(), MeshSpec.of_dtensor(tensor)
    if spec is None:
        raise DeliveryError("a plain tensor needs an explicit MeshSpec (sharded or full)")
    return tensor, spec


# dtypes a CPU payload may carry inline, by the name the header gives them
INLINE_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                     torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _inline_frame(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (ZeroMQ copies them into the socket)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _from_frame(frame: bytes, dtype_name: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor an inline frame carries, or ValueError when frame and description disagree."""
    dtype = INLINE_DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"dtype {dtype_name!r} is not one of {sorted(INLINE_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    expected = math.prod(shape) * dtype.itemsize
    if len(frame) != expected:
        raise ValueError(f"{len(frame)} bytes for a {dtype_name} tensor of shape {shape} ({expected} bytes)")
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape) if expected else \
        torch.empty(shape, dtype=dtype)


class ShardSender:
    """Trainer side: one PUSH socket to one engine rank. Keeps the last shards alive
    until the next send or ``close()``, since the engine maps their memory."""

    def __init__(self, channel: str, engine_rank: int) -> None:
        self.channel = resolve_channel(channel, engine_rank)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{_socket_path(self.channel, engine_rank)}")
        self._alive: List[torch.Tensor] = []

    def send(
        self,
        update_id: str,
        trainer_rank: int,
        rank_map: Mapping[int, int],
        shards: Sequence[Tuple[str, torch.Tensor, Optional[MeshSpec]]],
        pieces: Optional[Mapping[str, HoldersSpec]] = None,
        kind: str = "shards",
        names: Sequence[str] = (),
        fingerprint: str = "",
    ) -> None:
        """``shards``: (key, local tensor, its MeshSpec, or None for a buffer that
        ``pieces`` (HF name -> HoldersSpec) describe, or a parameter buffer of a
        "params" payload); ``kind``, ``names``, ``fingerprint``: see ``Payload``."""
        # a non-contiguous view would share its whole storage (other tensors' bytes): share a copy
        self._alive = [t.detach() if t.is_contiguous() else t.detach().contiguous() for _, t, _ in shards]
        header = {
            "update_id": str(update_id),
            "trainer_rank": int(trainer_rank),
            "rank_map": [[int(k), int(v)] for k, v in rank_map.items()],
            "tensors": [[name, None if spec is None else spec.to_wire()] for name, _, spec in shards],
            "pieces": [[name, spec.to_wire()] for name, spec in (pieces or {}).items()],
            "kind": kind, "names": [str(n) for n in names], "fingerprint": str(fingerprint),
        }
        if any(t.is_cuda for t in self._alive):
            frames = [MultiprocessingSerializer.serialize(self._alive)]
        else:
            header["inline"] = [[str(t.dtype), list(t.shape)] for t in self._alive]
            frames, self._alive = [_inline_frame(t) for t in self._alive], []
        self._sock.send_multipart([json.dumps(header).encode(), *frames])

    def close(self) -> None:
        self._alive = []
        self._sock.close()
        self._ctx.term()


class ShardReceiver:
    """Engine side: a PULL socket per channel for this engine rank, bound on first use;
    at most ``MAX_CHANNELS`` at a time (the least recently used is closed)."""

    def __init__(self, engine_rank: int, max_channels: int = MAX_CHANNELS) -> None:
        self.engine_rank = engine_rank
        self.max_channels = max_channels
        self._ctx = zmq.Context()
        self._socks: "collections.OrderedDict[str, zmq.Socket]" = collections.OrderedDict()
        self._consumed: Set[str] = set()
        self._consumed_order: Deque[str] = collections.deque()

    def _error(self, text: str) -> DeliveryError:
        return DeliveryError(f"engine rank {self.engine_rank}: {text}")

    def _socket(self, channel: str) -> zmq.Socket:
        try:
            real = resolve_channel(channel, self.engine_rank)
        except ChannelError as e:
            raise ChannelError(f"engine rank {self.engine_rank}: {e}") from None
        if real in self._socks:
            self._socks.move_to_end(real)
            return self._socks[real]
        path = _socket_path(real, self.engine_rank)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ChannelError(f"engine rank {self.engine_rank}: channel {channel!r} holds {path!r}, "
                               "which is not a socket; refusing to replace it")
        while len(self._socks) >= self.max_channels:
            old, sock = self._socks.popitem(last=False)
            logger.info("engine rank %d: retiring channel %s (more than %d channels)",
                        self.engine_rank, old, self.max_channels)
            sock.close()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, -1)
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:
            sock.close()
            raise ChannelError(f"engine rank {self.engine_rank}: channel {channel!r}: cannot bind {path!r}: {e}") \
                from None
        self._socks[real] = sock
        return sock

    def receive(self, channel: str, update_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Payload:
        """This rank's payload for ``update_id``; payloads of other updates and malformed
        messages are dropped (and logged); an id consumed before is refused."""
        timeout_s = check_timeout(timeout_s)
        if update_id in self._consumed:
            raise self._error(f"update id {update_id!r} was already consumed; a replay is refused")
        sock = self._socket(channel)
        deadline = time.monotonic() + timeout_s
        dropped: List[str] = []
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms):
                note = f" (dropped: {'; '.join(dropped[-3:])})" if dropped else ""
                raise self._error(
                    f"no payload for update {update_id!r} within {timeout_s:g}s on channel {channel!r}: the "
                    f"trainer rank beside this engine rank did not deliver (dead, late or another update){note}"
                )
            frames = sock.recv_multipart()
            try:
                header = _header(frames)
            except DeliveryError as e:
                logger.warning("engine rank %d: dropping a malformed message on channel %s: %s",
                               self.engine_rank, channel, e)
                dropped.append(f"malformed message: {e}")
                continue
            if header["update_id"] != update_id:
                logger.warning("engine rank %d: dropping a payload of update %r while waiting for %r",
                               self.engine_rank, header["update_id"], update_id)
                dropped.append(f"payload of update {header['update_id']!r}")
                continue
            self._consume(update_id)
            return self._payload(header, frames[1:])

    def _consume(self, update_id: str) -> None:
        self._consumed.add(update_id)
        self._consumed_order.append(update_id)
        if len(self._consumed_order) > CONSUMED_IDS:
            self._consumed.discard(self._consumed_order.popleft())

    def _payload(self, header: dict, frames: List[bytes]) -> Payload:
        """The payload of the awaited update: checked, then (only then) decoded or unpickled."""
        trainer, names = header["trainer_rank"], [name for name, _ in header["tensors"]]
        if header["rank_map"].get(trainer) != self.engine_rank:
            raise self._error(f"the payload of trainer rank {trainer} is for engine rank "
                              f"{header['rank_map'].get(trainer)}")
        twice = sorted(n for n, k in collections.Counter(names).items() if k > 1)
        if twice:
            raise self._error(f"tensor {twice[0]!r} delivered twice by trainer rank {trainer}")
        try:
            if header["inline"] is None:
                tensors = MultiprocessingSerializer.deserialize(frames[0])
            else:
                tensors = [_from_frame(f, *desc) for f, desc in zip(frames, header["inline"])]
        except Exception as e:  # noqa: BLE001 - a dead sender, a blocked pickle, garbage: refuse, never die
            raise self._error(f"cannot read the shards of trainer rank {trainer} (is it alive?): "
                              f"{type(e).__name__}: {e}") from None
        if not isinstance(tensors, list) or len(tensors) != len(names) \
                or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise self._error(f"trainer rank {trainer} sent {type(tensors).__name__}, not {len(names)} tensors")
        specs: Dict[str, Union[MeshSpec, HoldersSpec]] = {}
        described = [(n, w, MeshSpec.from_wire) for n, w in header["tensors"] if w is not None]
        for name, wire, decode in described + [(n, w, HoldersSpec.from_wire) for n, w in header["pieces"]]:
            if name in specs:
                raise self._error(f"tensor {name!r} described twice by trainer rank {trainer}")
            try:
                specs[name] = decode(wire)
            except Exception as e:  # noqa: BLE001 - names the tensor whatever the wire got wrong
                raise self._error(f"tensor {name!r} from trainer rank {trainer}: bad layout {wire!r}: {e}") from None
        return Payload(header["update_id"], trainer, header["rank_map"], dict(zip(names, tensors)), specs,
                       header["kind"], tuple(header["names"]), header["fingerprint"])

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._ctx.term()


def _header(frames: List[bytes]) -> dict:
    """The checked JSON header of a two-part message (nothing is unpickled here)."""
    if not frames or len(frames[0]) > HEADER_BYTES:
        raise DeliveryError(f"{len(frames)} frame(s); expected a header and the shards")
    try:
        header = json.loads(frames[0])
        inline = header.get("inline")
        update_id, trainer, pairs, tensors, pieces = (header["update_id"], header["trainer_rank"],
                                                      header["rank_map"], header["tensors"], header["pieces"])
        rank_map = {int(k): int(v) for k, v in pairs}
        kind, names, fingerprint = header.get("kind", "shards"), header.get("names", []), header.get("fingerprint", "")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DeliveryError(f"unreadable header: {type(e).__name__}: {e}") from None
    if not isinstance(update_id, str) or not isinstance(trainer, int) or not _named_pairs(tensors) \
            or not _named_pairs(pieces) or not isinstance(names, list) or not all(isinstance(n, str) for n in names) \
            or not isinstance(fingerprint, str):
        raise DeliveryError("header fields have the wrong types")
    if inline is not None and not (_named_pairs(inline) and len(inline) == len(tensors)):
        raise DeliveryError("header field 'inline' must describe each tensor as [dtype, shape]")
    expected = 1 if inline is None else len(inline)
    if len(frames) - 1 != expected:
        raise DeliveryError(f"{len(frames)} frame(s); expected a header and {expected} more")
    if kind not in PAYLOAD_KINDS:
        raise DeliveryError(f"unknown payload kind {kind!r}; expected one of {PAYLOAD_KINDS}")
    return {"update_id": update_id, "trainer_rank": trainer, "rank_map": rank_map, "tensors": tensors,
            "pieces": pieces, "kind": kind, "names": names, "fingerprint": fingerprint, "inline": inline}


def _named_pairs(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str)
                                           for t in value)
