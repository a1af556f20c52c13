"""Deliver: each trainer rank hands only its own shards to the engine rank beside it.

The channel is a private directory (mode 0700, named ``sglang-weights-*``)
holding one ZeroMQ ``ipc://`` socket per engine TP rank for messages. A channel is an
identity, not a string: it is resolved (``realpath``) and checked before any
socket is bound or connected, so every spelling of one directory is one
channel. A trainer rank PUSHes one message: a JSON header (the update
id, which trainer rank it is, the map from trainer ranks to engine ranks, each
tensor's name and ``MeshSpec``; fused local buffers (Megatron-core) travel
without a spec, and the HF tensors they hold pieces of come with
``HoldersSpec``s; its layout in a frame of its own that both ends keep,
``protocol.LayoutFrames``) and its local tensors. CUDA tensors go as CUDA IPC handles
(SGLang's ``MultiprocessingSerializer``), so no payload bytes are copied or
gathered; the engine unpickles them naming only what rebuilds a CUDA tensor from
its handle (``protocol.payload_globals``: no fd passing, nothing that connects to
a socket or waits on a peer). CPU tensors (tests, CPU engines) travel inline, one frame
each after the header, each described in the header by dtype and shape: no shared-memory
manager (torch's must answer within a second, which a loaded machine misses), no
multiprocessing authkey (an engine launched separately has another), nothing left in
/dev/shm, and nothing unpickled. The engine reads and checks the header
(bounded: size, nesting, integers only, known keys and types) before it unpickles
or decodes anything, drops a malformed message on arrival (logged), refuses update
ids it has already consumed, and never dies of a malformed message.
"""

# pr: scale
# CPU tensors are copied once into a shared-memory segment (``shared_segment``: a memfd
# passed over a datagram socket the channel holds beside each engine rank's message socket)
# that the engine maps and reads in place, each tensor described in the header by dtype,
# shape and offset, and cast on that copy where the engine keeps a smaller dtype
# (``wire_dtypes``); until the engine has bound that socket (the first update of a
# channel), they travel inline. A memfd has no name in /dev/shm and goes with its last
# descriptor and mapping: still no shared-memory manager, and nothing unpickled.
# pr: scale end

from __future__ import annotations

import collections
import io
import logging
import math
import operator
import os
import pickle
import stat
import time
from dataclasses import dataclass
from typing import (
    Deque,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import torch
import zmq
from torch.distributed.tensor import DTensor

from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.protocol import (
    CPU_DTYPES,
    DEFAULT_TIMEOUT_S,
    ChannelError,
    DeliveryError,
    HeaderBound,
    HeaderTooLarge,
    LayoutFrames,
    PayloadKind,
    check_timeout,
    decode_header,
    header_fields,
    payload_globals,
    resolve_channel,
    socket_path,
)
from sglang.srt.weight_sync.source_layout import HoldersSpec, MeshRanks, MeshSpec

# isort: split
# pr: scale
from sglang.srt.weight_sync.protocol import Fp8Region, segment_socket_path, with_head
from sglang.srt.weight_sync.shared_segment import (
    SegmentError,
    SegmentInbox,
    SegmentWriter,
    new_segment_id,
    send_segment,
)
from sglang.srt.weight_sync.wire_dtypes import DtypeFile, dtypes_path

# pr: scale end

__all__ = (
    "ChannelError",
    "DeliveryError",
    "Payload",
    "ShardReceiver",
    "ShardSender",
    "local_shard",
    "unpickle_handles",
)

logger = logging.getLogger(__name__)

# bound sockets per engine rank; the least recently used one is retired
MAX_CHANNELS = 8
CONSUMED_IDS = 4096  # update ids remembered per engine rank, to refuse replays


@dataclass
class Payload:
    """What one engine rank received: the trainer's local tensors beside it (by buffer key)
    and the layouts of the HF tensors they hold (by HF name). ``kind`` "shards": for
    engine-side resharding; "params": parameter-shaped buffers already in this rank's
    layout (trainer-side, one hop), filled from the HF tensors ``names`` and planned
    against the engine layout's ``fingerprint``. ``layout_memo``: a dict that lives as
    long as the receiver keeps this payload's layout (``protocol.LayoutFrames``): what the
    engine derives from the layout alone (its source layout, its plan) is kept there, so an
    update in an unchanged layout (every step of an RL run) does not derive it per tensor
    again."""

    update_id: str
    trainer_rank: int
    rank_map: Dict[int, int]
    tensors: Dict[str, torch.Tensor]
    specs: Dict[str, Union[MeshSpec, HoldersSpec]]
    kind: PayloadKind = PayloadKind.SHARDS
    names: Tuple[str, ...] = ()
    fingerprint: str = ""
    layout_memo: Optional[dict] = None
    # pr: scale
    # 1-d views covering exactly the bytes of ``tensors`` when they came in one shared-memory
    # segment (``shared_segment.MappedSegment.runs``), else None
    runs: Optional[List[torch.Tensor]] = None
    # "params": regions of block-FP8 weights, each in its tensor of ``tensors`` (by key)
    fp8_regions: Tuple[Fp8Region, ...] = ()
    # pr: scale end


def local_shard(
    tensor: torch.Tensor,
    spec: Optional[MeshSpec] = None,
    ranks: Optional[MeshRanks] = None,
) -> Tuple[torch.Tensor, MeshSpec]:
    """A DTensor's local shard and layout (never ``full_tensor()``), or a plain tensor
    with its explicit spec. ``ranks``: see ``MeshSpec.of_dtensor``."""
    if isinstance(tensor, DTensor):
        return _own_local(tensor), MeshSpec.of_dtensor(tensor, ranks)
    if spec is None:
        raise DeliveryError(
            "a plain tensor needs an explicit MeshSpec (sharded or full)"
        )
    return tensor, spec


def _own_local(tensor: DTensor) -> torch.Tensor:
    """The DTensor's own local tensor, never an autograd view of it. ``to_local()`` under
    no_grad returns exactly that, except for a parameter (``nn.Parameter`` of a DTensor, as
    FSDP2 holds them), for which torch 2.13 makes a fresh view each call so that the
    result is a parameter too: a dispatch per tensor that a MoE model's tens of thousands
    pay every update, and a new object each time, so checks kept by identity from the last
    update (``executor.check_inputs``) never apply. The same storage either way."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    with torch.no_grad():
        return tensor.to_local()


# pr: scale
@dataclass(frozen=True)
class _LayoutKey:
    """What a payload's layout in the segment is built from: the names, their spec objects
    (one per layout, ``MeshRanks``), the placements (the same object while the segment's
    layout stays, ``ShardSender._share``) and the payload's kind, names and fingerprint.
    ``layout``: what stood for the shards' names and spec objects (``ShardSender.send``'s
    token), which decides when two keys have one."""

    names: List[str]
    specs: List[object]
    placed: list
    rest: tuple
    layout: Optional[object] = None

    @classmethod
    def of(cls, shards, shared, kind, names, fingerprint, layout) -> _LayoutKey:
        return cls(
            [] if layout is not None else [n for n, _, _ in shards],
            [] if layout is not None else [s for _, _, s in shards],
            shared[1],
            (PayloadKind(kind), tuple(names), fingerprint),
            layout,
        )

    def same(self, other: _LayoutKey) -> bool:
        if self.placed is not other.placed or self.rest != other.rest:
            return False
        if self.layout is not None or other.layout is not None:
            return self.layout is other.layout
        return (
            self.names == other.names
            and len(self.specs) == len(other.specs)
            and all(a is b for a, b in zip(self.specs, other.specs))
        )


# pr: scale end
def _tensor_wires(shards) -> List[Tuple[str, Optional[tuple]]]:
    """Each shard's name and its spec's wire form (None without a spec), each spec object's
    made once: tensors that share a ``MeshSpec`` object share its wire form."""
    wires: Dict[int, tuple] = {}
    return [
        (name, None if spec is None else _wire_of(spec, wires))
        for name, _, spec in shards
    ]


def _wire_of(spec: Union[MeshSpec, HoldersSpec], wires: Dict[int, tuple]) -> tuple:
    """``spec.to_wire()``, once per spec object in ``wires`` (which keeps it)."""
    known = wires.get(id(spec))
    if known is None or known[0] is not spec:
        known = wires[id(spec)] = (spec, spec.to_wire())
    return known[1]


# a shard's tensor, and whether a tensor is on a GPU: read by ``map``, a MoE model's tens
# of thousands of shards in C rather than a Python loop each
_TENSOR, _IS_CUDA = operator.itemgetter(1), operator.attrgetter("is_cuda")

# dtypes a CPU payload may carry inline, by the name the header gives them
INLINE_DTYPES = {f"torch.{name}": getattr(torch, name) for name in CPU_DTYPES}


def _inline_frame(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (ZeroMQ copies them into the socket)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _from_frame(frame: bytes, dtype_name: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor an inline frame carries, or ValueError when frame and description disagree."""
    dtype = INLINE_DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"dtype {dtype_name!r} is not one of {sorted(INLINE_DTYPES)}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and n >= 0 for n in shape
    ):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    expected = math.prod(shape) * dtype.itemsize
    if len(frame) != expected:
        raise ValueError(
            f"{len(frame)} bytes for a {dtype_name} tensor of shape {shape} ({expected} bytes)"
        )
    return (
        torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape)
        if expected
        else torch.empty(shape, dtype=dtype)
    )


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles what names only ``allowed`` globals (``protocol.payload_globals``)."""

    def __init__(self, data: bytes, allowed: frozenset) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(
                f"global {module}.{name} refused (allowed: "
                f"{'CUDA IPC handles only' if self.allowed else 'nothing'})"
            )
        return super().find_class(module, name)


def unpickle_handles(data: bytes, kind: PayloadKind, cuda: bool):
    """The tensors a pickled payload frame carries as CUDA IPC handles, decoded with
    ``payload_globals(kind, cuda)`` only: nothing at all on an engine without CUDA."""
    allowed = payload_globals(kind, cuda)
    if not allowed:
        raise pickle.UnpicklingError(
            "a pickled payload is refused: this engine has no CUDA, so tensors must travel "
            "inline (CPU tensors), and nothing is unpickled"
            if not cuda
            else f"a pickled {PayloadKind(kind).value!r} payload is refused: it carries no tensors"
        )
    return _HandleUnpickler(bytes(data), allowed).load()


class ShardSender:
    """Trainer side: one PUSH socket to one engine rank. Keeps the last shards (CUDA: the
    engine maps their memory) for the engine until it has answered (``release()``, which
    the trainer's flows call on the reply), the next send or ``close()``."""

    # pr: scale
    # CPU shards: the shared-memory segment they were copied into is kept as long, since
    # the engine maps it too.
    # pr: scale end

    def __init__(self, channel: str, engine_rank: int) -> None:
        self.channel = resolve_channel(channel, engine_rank)
        # pr: scale
        self._segment_path = segment_socket_path(self.channel, engine_rank)
        # pr: scale end
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{socket_path(self.channel, engine_rank)}")
        self._alive: List[torch.Tensor] = []
        # pr: scale
        self._segment = SegmentWriter()
        self._dtypes = DtypeFile(dtypes_path(self.channel, engine_rank))
        # pr: scale end
        self._layouts = LayoutFrames()
        # pr: scale
        # the last placements sent: (the segment's offsets object, dtypes, placements)
        self._placed: Optional[Tuple[list, list, list]] = None
        # the last header built for a payload in the segment, and what it was built from
        self._header: Optional[Tuple[_LayoutKey, dict]] = None
        # pr: scale end
        # bytes the last payload carried inline, through the socket (CPU tensors)
        # pr: scale
        # (those that shared memory did not carry: the engine had not bound its segment
        # socket)
        # pr: scale end
        self.inline_bytes = 0
        # pr: scale
        # the last CPU send's description, the engine's dtypes it was cast for and the
        # dtypes each shard travelled in (``send``'s ``layout``)
        self._steady: Optional[Tuple[object, object, List[torch.dtype]]] = None
        # pr: scale end

    def send(
        self,
        update_id: str,
        trainer_rank: int,
        rank_map: Mapping[int, int],
        shards: Sequence[Tuple[str, torch.Tensor, Optional[MeshSpec]]],
        pieces: Optional[Mapping[str, HoldersSpec]] = None,
        kind: PayloadKind = PayloadKind.SHARDS,
        names: Sequence[str] = (),
        fingerprint: str = "",
        # pr: scale
        # the block-FP8 regions of a "params" payload (``Payload.fp8_regions``)
        fp8_regions: Sequence[Fp8Region] = (),
        # the description ``shards`` come from (``source_layout.Described.sources``): the
        # same object as the last send's stands for the same names, specs and local shapes,
        # so the dtypes, the segment's layout and the header follow from the last send's
        # instead of from each shard again
        layout: Optional[object] = None,
        # pr: scale end
    ) -> None:
        """``shards``: (key, local tensor, its MeshSpec, or None for a buffer that
        ``pieces`` (HF name -> HoldersSpec) describe, or a parameter buffer of a
        "params" payload); ``kind``, ``names``, ``fingerprint``: see ``Payload``."""
        tensors = list(map(_TENSOR, shards))
        inline = None
        self._alive = []
        cuda = any(map(_IS_CUDA, tensors))
        # pr: scale
        shared = token = None
        if not cuda:
            token, shared = self._to_segment(shards, tensors, layout)
        # pr: scale end
        if cuda:
            # a non-contiguous view would share its whole storage (other tensors' bytes): share a copy
            self._alive = [
                t.detach() if t.is_contiguous() else t.detach().contiguous()
                for t in tensors
            ]
            frames = [MultiprocessingSerializer.serialize(self._alive)]
        # pr: scale
        elif shared is not None:
            frames = []
        # pr: scale end
        else:
            contiguous = [t.detach().contiguous() for t in tensors]
            inline = [(str(t.dtype), t.shape) for t in contiguous]
            frames = [_inline_frame(t) for t in contiguous]
        self.inline_bytes = sum(f.nbytes for f in frames) if inline is not None else 0
        # pr: scale
        key = (  # a payload in the segment: its layout's header is built once
            _LayoutKey.of(shards, shared, kind, names, fingerprint, token)
            if shared is not None and not pieces and not fp8_regions
            else None
        )
        if key is not None and self._header is not None and key.same(self._header[0]):
            header = with_head(
                self._header[1], update_id, trainer_rank, rank_map, shared[0]
            )
            self._sock.send_multipart([*self._layouts.encode(header), *frames])
            return
        # pr: scale end
        header = header_fields(
            update_id,
            trainer_rank,
            rank_map,
            _tensor_wires(shards),
            [(name, spec.to_wire()) for name, spec in (pieces or {}).items()],
            kind,
            names,
            fingerprint,
            inline,
            # pr: scale
            shared,
            fp8_regions,
            # pr: scale end
        )
        # pr: scale
        self._header = None if key is None else (key, header)
        # pr: scale end
        self._sock.send_multipart([*self._layouts.encode(header), *frames])

    # pr: scale
    def _to_segment(
        self,
        shards: Sequence[Tuple[str, torch.Tensor, Optional[MeshSpec]]],
        tensors: List[torch.Tensor],
        layout: Optional[object],
    ):
        """CPU ``tensors`` (of ``shards``) into the segment, each in its ``_wire_dtype``, and
        the segment to the engine rank: (what stands for this send's names, specs, shapes
        and dtypes: the same object while they stay, a new one when the engine's dtypes
        change; None without ``layout``), and ``_share``'s answer."""
        wanted = self._dtypes.get()  # one look at the engine's file per payload
        steady = self._steady
        if (
            layout is None
            or steady is None
            or steady[0] is not layout
            or steady[1] is not wanted
        ):
            dtypes = [self._wire_dtype(wanted, n, t, spec) for n, t, spec in shards]
            steady = (layout, wanted, dtypes)
            self._steady = steady if layout is not None else None
        token = steady if layout is not None else None
        with torch.no_grad():  # copies of the values, never part of a graph
            return token, self._share(tensors, steady[2], token)

    @staticmethod
    def _wire_dtype(
        wanted: Mapping[str, torch.dtype], name: str, t: torch.Tensor, spec
    ) -> torch.dtype:
        """The dtype a CPU shard travels in: the engine's, where it keeps the tensor in one
        smaller floating dtype (``wire_dtypes``: the cast the engine would make, made once
        in the copy into shared memory), else its own."""
        want = wanted.get(name) if isinstance(spec, MeshSpec) else None
        if (
            want is not None
            and t.is_floating_point()
            and want.itemsize < t.element_size()
        ):
            return want
        return t.dtype

    def buffers(
        self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[torch.dtype]
    ) -> Optional[List[torch.Tensor]]:
        """CPU tensors of ``shapes`` and ``dtypes`` in the shared-memory segment the next
        ``send`` passes to the engine rank (which then copies nothing on this side), or
        None while the engine has not bound its segment socket (then ``send`` copies)."""
        if not hasattr(os, "memfd_create") or not os.path.exists(self._segment_path):
            return None
        return self._segment.allocate(shapes, dtypes)[0]

    def _share(
        self,
        tensors: Sequence[torch.Tensor],
        dtypes: List[torch.dtype],
        token: Optional[object] = None,
    ):
        """Put CPU ``tensors`` into the segment (copied and cast to ``dtypes``, unless they
        are the segment's own ``buffers``) and pass it to the engine rank: (segment id,
        placement per tensor) for the header, or None when the engine has not bound its
        segment socket yet (its first update on this channel) or shared memory is
        unavailable: then they go inline. The segment is written either way, so that the
        next update finds its pages in place. ``token``: an object standing for the
        tensors' shapes and ``dtypes``, the same while they stay (``send``), or None."""
        if not tensors or not hasattr(os, "memfd_create"):
            return None
        if self._segment.holds(tensors):
            dtypes = [t.dtype for t in tensors]
            fd = self._segment.fd
            offsets = self._segment.offsets
        else:
            fd, offsets = self._segment.write(tensors, dtypes, token)
        segment_id = new_segment_id()
        if not send_segment(self._segment_path, segment_id, fd):
            self._segment.release()  # never reached the engine: free for the next send
            return None
        placed = self._placed  # the same offsets object: the segment's same layout
        if (
            placed is None
            or placed[0] is not offsets
            or (placed[1] is not dtypes and placed[1] != dtypes)
        ):
            placed = self._placed = (
                offsets,
                dtypes,
                [
                    (str(d), list(t.shape), off)
                    for t, d, off in zip(tensors, dtypes, offsets)
                ],
            )
        return segment_id, placed[2]

    @property
    def shared_bytes(self) -> int:
        """Shared memory this sender holds for the engine rank (its segment, kept between
        updates so that the next finds its pages in place)."""
        return self._segment.nbytes

    # pr: scale end
    def release(self) -> None:
        """Drop the last shards: the engine has answered, so it no longer reads them."""
        self._alive = []
        # pr: scale
        self._segment.release()  # the segment they were copied into may take the next update's
        # pr: scale end

    def close(self) -> None:
        self._alive = []
        # pr: scale
        self._segment.close()
        # pr: scale end
        self._sock.close()
        self._ctx.term()


class ShardReceiver:
    """Engine side: a PULL socket per channel for this engine rank, bound on first use;
    at most ``MAX_CHANNELS`` at a time (the least recently used is closed)."""

    def __init__(self, engine_rank: int, max_channels: int = MAX_CHANNELS) -> None:
        self.engine_rank = engine_rank
        self.max_channels = max_channels
        self._ctx = zmq.Context()
        self._socks: collections.OrderedDict[str, zmq.Socket] = (
            collections.OrderedDict()
        )
        # pr: scale
        self._inboxes: Dict[str, SegmentInbox] = {}  # by channel, beside its socket
        # pr: scale end
        # the payload layouts read last, checked, with the specs decoded from each
        self._layouts = LayoutFrames()
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
        path = socket_path(real, self.engine_rank)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ChannelError(
                f"engine rank {self.engine_rank}: channel {channel!r} holds {path!r}, "
                "which is not a socket; refusing to replace it"
            )
        while len(self._socks) >= self.max_channels:
            old, sock = self._socks.popitem(last=False)
            logger.info(
                "engine rank %d: retiring channel %s (more than %d channels)",
                self.engine_rank,
                old,
                self.max_channels,
            )
            sock.close()
            # pr: scale
            self._inboxes.pop(old).close()
            # pr: scale end
        # pr: scale
        seg_path = segment_socket_path(real, self.engine_rank)
        try:
            inbox = SegmentInbox(seg_path)
        except (OSError, SegmentError) as e:
            raise ChannelError(
                f"engine rank {self.engine_rank}: channel {channel!r}: cannot bind {seg_path!r}: {e}"
            ) from None
        # pr: scale end
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, -1)
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as e:
            sock.close()
            # pr: scale
            inbox.close()
            # pr: scale end
            raise ChannelError(
                f"engine rank {self.engine_rank}: channel {channel!r}: cannot bind {path!r}: {e}"
            ) from None
        self._socks[real] = sock
        # pr: scale
        self._inboxes[real] = inbox
        # pr: scale end
        return sock

    def receive(
        self,
        channel: str,
        update_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bound: HeaderBound = HeaderBound(),
    ) -> Payload:
        """This rank's payload for ``update_id``; payloads of other updates and malformed
        messages are dropped (and logged); an id consumed before is refused. A header over
        ``bound`` (the engine's model: ``HeaderBound``) is refused at once: waiting out the
        timeout for another payload would only hide a trainer that describes too much."""
        timeout_s = check_timeout(timeout_s)
        if update_id in self._consumed:
            raise self._error(
                f"update id {update_id!r} was already consumed; a replay is refused"
            )
        sock = self._socket(channel)
        # pr: scale
        inbox = self._inboxes[resolve_channel(channel, self.engine_rank)]
        # pr: scale end
        deadline = time.monotonic() + timeout_s
        dropped: Deque[str] = collections.deque(maxlen=3)
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms):
                note = f" (dropped: {'; '.join(dropped)})" if dropped else ""
                raise self._error(
                    f"no payload for update {update_id!r} within {timeout_s:g}s on channel {channel!r}: the "
                    f"trainer rank beside this engine rank did not deliver (dead, late or another update){note}"
                )
            frames = sock.recv_multipart()
            try:
                header = decode_header(frames, bound, self._layouts)
            except HeaderTooLarge as e:
                raise self._error(
                    f"a message on channel {channel!r} while waiting for update "
                    f"{update_id!r}: {e}"
                ) from None
            except Exception as e:  # noqa: BLE001 - whatever a message holds, it is dropped, never raised
                reason = (
                    e if isinstance(e, DeliveryError) else f"{type(e).__name__}: {e}"
                )
                logger.warning(
                    "engine rank %d: dropping a malformed message on channel %s: %s",
                    self.engine_rank,
                    channel,
                    reason,
                )
                dropped.append(f"malformed message: {reason}")
                continue
            if header["update_id"] != update_id:
                logger.warning(
                    "engine rank %d: dropping a payload of update %r while waiting for %r",
                    self.engine_rank,
                    header["update_id"],
                    update_id,
                )
                dropped.append(f"payload of update {header['update_id']!r}")
                continue
            self._consume(update_id)
            return self._payload(
                header,
                frames[header["data_at"] :],
                # pr: scale
                inbox,
                # pr: scale end
            )

    def _consume(self, update_id: str) -> None:
        self._consumed.add(update_id)
        self._consumed_order.append(update_id)
        if len(self._consumed_order) > CONSUMED_IDS:
            self._consumed.discard(self._consumed_order.popleft())

    def _payload(
        self,
        header: dict,
        frames: List[bytes],
        # pr: scale
        inbox: SegmentInbox,
        # pr: scale end
    ) -> Payload:
        """The payload of the awaited update: checked, then (only then) decoded
        (``_shards``)."""
        trainer, names = header["trainer_rank"], [name for name, _ in header["tensors"]]
        self._check_addressing(header, names)
        tensors, runs = self._shards(
            header,
            frames,
            names,
            # pr: scale
            inbox,
            # pr: scale end
        )
        return Payload(
            header["update_id"],
            trainer,
            header["rank_map"],
            tensors,
            self._specs(header),
            header["kind"],
            tuple(header["names"]),
            header["fingerprint"],
            header["memo"],
            # pr: scale
            runs,
            header["fp8_regions"],
            # pr: scale end
        )

    def _check_addressing(self, header: dict, names: List[str]) -> None:
        """The payload is for this engine rank and names each tensor once."""
        trainer = header["trainer_rank"]
        if header["rank_map"].get(trainer) != self.engine_rank:
            raise self._error(
                f"the payload of trainer rank {trainer} is for engine rank "
                f"{header['rank_map'].get(trainer)}"
            )
        twice = sorted(n for n, k in collections.Counter(names).items() if k > 1)
        if twice:
            raise self._error(
                f"tensor {twice[0]!r} delivered twice by trainer rank {trainer}"
            )

    def _shards(
        self,
        header: dict,
        frames: List[bytes],
        names: List[str],
        # pr: scale
        inbox: SegmentInbox,
        # pr: scale end
    ) -> Tuple[Dict[str, torch.Tensor], Optional[List[torch.Tensor]]]:
        """The shard tensors by ``names``, read from inline frames or unpickled from CUDA
        IPC handles, and None."""
        # pr: scale
        # Or mapped from the payload's shared-memory segment (taken from ``inbox``): the
        # same ``FixedShards`` every update the inbox keeps its mapping for, with the
        # segment's runs (``Payload.runs``) instead of None.
        # pr: scale end
        trainer, count = header["trainer_rank"], len(names)
        runs = None
        try:
            if header["inline"] is not None:
                tensors = [
                    _from_frame(f, *desc) for f, desc in zip(frames, header["inline"])
                ]
            # pr: scale
            elif header["shared"] is not None:
                segment, placed = header["shared"]
                shards, runs = inbox.mapped(segment, placed, names)
                return shards, runs
            # pr: scale end
            else:
                tensors = unpickle_handles(
                    frames[0], header["kind"], torch.cuda.is_available()
                )
        except Exception as e:  # noqa: BLE001 - a dead sender, a blocked pickle, garbage: refuse, never die
            raise self._error(
                f"cannot read the shards of trainer rank {trainer} (is it alive?): "
                f"{type(e).__name__}: {e}"
            ) from None
        if (
            not isinstance(tensors, list)
            or len(tensors) != count
            or not all(isinstance(t, torch.Tensor) for t in tensors)
        ):
            raise self._error(
                f"trainer rank {trainer} sent {type(tensors).__name__}, not {count} tensors"
            )
        return dict(zip(names, tensors)), runs

    def _specs(self, header: dict) -> Dict[str, Union[MeshSpec, HoldersSpec]]:
        """Each tensor's layout: a mesh and placements, or the holders of its pieces;
        decoded once per layout the receiver keeps (``LayoutFrames``)."""
        memo = header["memo"]
        if "specs" not in memo:
            memo["specs"] = self._decode_specs(header)
        return dict(memo["specs"])

    def _decode_specs(self, header: dict) -> Dict[str, Union[MeshSpec, HoldersSpec]]:
        trainer = header["trainer_rank"]
        specs: Dict[str, Union[MeshSpec, HoldersSpec]] = {}
        described = [
            (n, w, MeshSpec.from_wire) for n, w in header["tensors"] if w is not None
        ]
        for name, wire, decode in described + [
            (n, w, HoldersSpec.from_wire) for n, w in header["pieces"]
        ]:
            if name in specs:
                raise self._error(
                    f"tensor {name!r} described twice by trainer rank {trainer}"
                )
            try:
                specs[name] = decode(wire)
            except Exception as e:  # noqa: BLE001 - names the tensor whatever the wire got wrong
                raise self._error(
                    f"tensor {name!r} from trainer rank {trainer}: bad layout {wire!r}: {e}"
                ) from None
        return specs

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        # pr: scale
        for inbox in self._inboxes.values():
            inbox.close()
        self._inboxes.clear()
        # pr: scale end
        self._ctx.term()
