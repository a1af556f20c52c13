"""CPU payloads through shared memory: no byte of a payload goes through a socket.

A trainer rank lays its CPU tensors out in a *segment*: a memfd (anonymous shared memory:
no name in /dev/shm, gone with its last descriptor and mapping) sealed against shrinking.
It passes the descriptor to the engine rank beside it over a unix datagram socket of the
channel (``protocol.segment_socket_path``, SCM_RIGHTS), then sends the payload's header,
which names the segment and gives each tensor's dtype, shape and offset in it. The engine
rank takes that segment from its socket (``SegmentInbox.take``), checks it (a memfd sealed
against shrinking that holds every byte the header places in it, so no access can fault),
maps it and views the tensors in place (``map_tensors``).

Lifetimes, explicit: the engine closes the descriptor once mapped and keeps the mapping
of the last segment per channel (``SegmentInbox.mapped``): the sender fills the same
segment every update, so mapping it (its pages populated) and viewing every tensor is done
once, not per update; the mapping goes when the sender's segment or layout changes or the
channel closes. A segment waiting in an engine's socket that no header claims is closed at
the engine's next receive. The sender (``SegmentWriter``) writes into its segment again only
for the next update after the engine answered the one that read it (``release``), and
makes a new one otherwise, so an engine that gave up late never sees a later update's
bytes; ``close`` drops it. Nothing here unpickles, opens a path a peer names, or blocks.
"""

from __future__ import annotations

import array
import errno
import fcntl
import mmap
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.box import contiguous_strides
from sglang.srt.weight_sync.copy_program import FixedShards
from sglang.srt.weight_sync.protocol import CPU_DTYPES

__all__ = (
    "ALIGN",
    "SEGMENT_DTYPES",
    "MappedSegment",
    "Placed",
    "SegmentError",
    "SegmentInbox",
    "SegmentWriter",
    "layout",
    "map_tensors",
    "new_segment_id",
    "placements",
    "send_segment",
)

ALIGN = 64  # bytes: where each run of one dtype starts in a segment
_NAME = "sglang-weights"  # the memfd's name, as /proc/<pid>/maps shows it
_ID_BYTES = 16
_DATAGRAM = 64  # a datagram holds a segment id, nothing else
_MAX_FDS = 4  # descriptors read per datagram; any beyond these are closed by the kernel
_DRAIN = 64  # datagrams read per take: the queue is short, a peer cannot keep it busy

# dtypes a segment may hold, by the name the header gives them: those a CPU tensor travels in
SEGMENT_DTYPES = {f"torch.{name}": getattr(torch, name) for name in CPU_DTYPES}


class SegmentError(RuntimeError):
    """A segment that is missing, of the wrong kind, too small, or placed wrongly."""


def layout(
    shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[torch.dtype]
) -> Tuple[List[int], int]:
    """Each tensor's offset in a segment, and the segment's size: tensors of one dtype
    back to back (so a check can read them as one run), each dtype's run aligned."""
    offsets = [0] * len(shapes)
    end = 0
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, dtype in enumerate(dtypes):
        by_dtype.setdefault(dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):
        end = -(-end // ALIGN) * ALIGN
        for i in by_dtype[dtype]:
            offsets[i] = end
            n = dtype.itemsize
            for size in shapes[i]:
                n *= size
            end += n
    return offsets, end


class SegmentWriter:
    """The sender's segment, reused for the next update only once the engine answered the
    last one (``release``); ``allocate`` lays tensors out in it, ``write`` also copies
    them in, ``close`` drops it."""

    def __init__(self) -> None:
        self._fd: Optional[int] = None
        self._map: Optional[mmap.mmap] = None
        self._bytes: Optional[torch.Tensor] = None
        self._free = False  # the engine answered the update that read the segment
        self._views: List[torch.Tensor] = []  # what ``allocate`` handed out last
        self.offsets: List[int] = []  # and where
        self._key: Optional[tuple] = None  # and for which shapes and dtypes
        # the description they were laid out for (``allocate``'s ``described``), and
        # whether every view holds bytes
        self._described: Optional[object] = None
        self._all_hold = False

    def _reusable(self, described: Optional[object]) -> bool:
        """Whether the last views serve ``described`` (see ``allocate``) as they are."""
        return (
            described is not None
            and described is self._described
            and self._free
            and self._map is not None
        )

    def allocate(
        self,
        shapes: Optional[Sequence[Tuple[int, ...]]],
        dtypes: Sequence[torch.dtype],
        described: Optional[object] = None,
    ) -> Tuple[List[torch.Tensor], List[int]]:
        """Tensors of ``shapes`` and ``dtypes`` in the segment (a new one unless the last
        was released and is large enough), and their offsets; held until ``release`` or
        ``close``. A new segment's pages are allocated up front, so every byte counts as
        held whether or not it is written. ``described``: an object standing for
        ``shapes`` and ``dtypes`` (``ShardSender.send``'s ``layout``): when it is the last
        allocation's, so are the views, and ``shapes`` is not read (None will do)."""
        if self._reusable(described):
            self._free = False  # the same layout in the same segment: the same views
            return self._views, self.offsets
        key = (list(map(tuple, shapes)), list(dtypes))
        if self._free and self._map is not None and key == self._key:
            self._free = False  # the same layout in the same segment: the same views
            self._described = described
            return self._views, self.offsets
        offsets, size = layout(shapes, dtypes)
        if not (self._free and self._map is not None and len(self._map) >= size):
            self.close()
            self._open(max(size, 1))
        self._free = False
        self._key, self._described = key, described
        views = []
        for shape, dtype, off in zip(shapes, dtypes, offsets):
            n = dtype.itemsize
            for s in shape:
                n *= s
            views.append(self._bytes[off : off + n].view(dtype).view(shape))
        self._views, self.offsets = views, offsets
        self._all_hold = all(v.numel() for v in views)
        return views, offsets

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are the views ``allocate`` handed out last, in order."""
        return len(tensors) == len(self._views) and all(
            t is v or (t.data_ptr() == v.data_ptr() and t.shape == v.shape)
            for t, v in zip(tensors, self._views)
        )

    def write(
        self,
        tensors: Sequence[torch.Tensor],
        dtypes: Optional[Sequence[torch.dtype]] = None,
        described: Optional[object] = None,
    ) -> Tuple[int, List[int]]:
        """Lay ``tensors`` out in the segment and copy them in, each cast to its entry of
        ``dtypes`` (default: its own) on the way; returns the descriptor and the offsets.
        ``described``: see ``allocate``."""
        dtypes = dtypes if dtypes is not None else [t.dtype for t in tensors]
        shapes = (
            None if self._reusable(described) else [tuple(t.shape) for t in tensors]
        )
        views, offsets = self.allocate(shapes, dtypes, described)
        # one multi-tensor copy: a MoE model's shards are tens of thousands
        if self._all_hold and views:
            torch._foreach_copy_(views, list(tensors))
        else:
            pairs = [(view, t) for view, t in zip(views, tensors) if view.numel()]
            if pairs:
                torch._foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
        return self._fd, offsets

    @property
    def fd(self) -> Optional[int]:
        return self._fd

    @property
    def nbytes(self) -> int:
        """The segment's size (0 without one): shared memory the sender holds."""
        return len(self._map) if self._map is not None else 0

    def _open(self, size: int) -> None:
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def release(self) -> None:
        """The engine answered the update that read the segment: the next may reuse it."""
        self._free = self._map is not None

    def close(self) -> None:
        """Drop the segment (an engine still mapping it keeps its pages until it lets go)."""
        self._bytes = None
        self._views, self.offsets, self._key = [], [], None
        self._described, self._all_hold = None, False
        if self._map is not None:
            try:
                self._map.close()
            except (
                BufferError
            ):  # a view handed out is still alive: the mapping goes with it
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._free = False


def new_segment_id() -> str:
    return secrets.token_hex(_ID_BYTES)


def send_segment(path: str, segment_id: str, fd: int) -> bool:
    """Pass ``fd`` to the engine socket at ``path`` under ``segment_id``; False (nothing
    sent) when no engine listens there yet or its queue is full: the payload then travels
    inline. Never blocks."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.sendmsg(
            [segment_id.encode()],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
            socket.MSG_DONTWAIT,
            path,
        )
        return True
    except OSError as e:
        if e.errno in (
            errno.ENOENT,
            errno.ECONNREFUSED,
            errno.EAGAIN,
            errno.ENOTSOCK,
            errno.EPROTOTYPE,
            errno.ENOBUFS,
        ):
            return False
        raise
    finally:
        sock.close()


class SegmentInbox:
    """An engine rank's datagram socket for one channel: segments arrive here, before the
    headers that name them. It keeps the last segment it mapped (``mapped``): a sender
    writes each update into the same segment, so the mapping and its tensors serve the
    next update too, until the sender's segment or its layout changes or the channel
    closes."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise SegmentError(f"{path!r} is not a socket; refusing to replace it")
            os.unlink(path)  # left by an engine before this one, as ZeroMQ's ipc does
        self._sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
        )
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
        except BaseException:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._ino = os.lstat(path).st_ino
        # (the segment's device and inode, the entries that placed it, the names, its
        # tensors by name and its runs)
        self._kept: Optional[tuple] = None

    def mapped(
        self, segment_id: str, entries, names: Sequence[str]
    ) -> Tuple[FixedShards, List[torch.Tensor]]:
        """The tensors of ``map_tensors`` of the segment sent under ``segment_id``, by
        ``names`` (one each, in order), and its runs; or the last of these when it is the
        same segment placed by the same ``entries`` (the object a kept layout frame gives
        every update: ``protocol.LayoutFrames``). The same inode is the same segment while
        the kept mapping holds it open; sealed against shrinking, it cannot have lost a
        byte since it was checked. The tensors come as ``FixedShards``: the same mapping
        of the same views for as long as this one is kept."""
        fd = self.take(segment_id)
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise SegmentError(f"cannot read the segment: {e}") from None
        key = (st.st_dev, st.st_ino)
        kept = self._kept
        if (
            kept is not None
            and kept[0] == key
            and kept[1] is entries
            and kept[2] == names
        ):
            os.close(fd)
            return kept[3], kept[4]
        self._kept = None  # the sender's segment or layout changed: let the old one go
        found = map_tensors(fd, entries)
        if len(found.tensors) != len(names):
            raise SegmentError(
                f"the header places {len(found.tensors)} tensors and names {len(names)}"
            )
        shards = FixedShards(zip(names, found.tensors))
        self._kept = (key, entries, list(names), shards, found.runs)
        return shards, found.runs

    def take(self, segment_id: str) -> int:
        """The descriptor sent under ``segment_id`` (the caller owns it), or SegmentError.
        Every other segment waiting here is closed; nothing waits for one to arrive (the
        sender passes it before the header that names it)."""
        found: Optional[int] = None
        for _ in range(_DRAIN):
            try:
                data, ancillary, _, _ = self._sock.recvmsg(
                    _DATAGRAM,
                    socket.CMSG_SPACE(_MAX_FDS * 4),
                    socket.MSG_CMSG_CLOEXEC,
                )
            except (BlockingIOError, InterruptedError):
                break
            fds = _fds(ancillary)
            if found is None and data == segment_id.encode() and len(fds) == 1:
                found = fds.pop()
            for fd in fds:
                os.close(fd)
        if found is None:
            raise SegmentError(
                f"no shared-memory segment {segment_id[:12]} arrived before the header "
                "that names it"
            )
        return found

    def close(self) -> None:
        """Close the socket (the kernel closes segments still queued), let the kept
        mapping go and remove its path."""
        self._kept = None
        self._sock.close()
        try:
            if os.lstat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass


def _fds(ancillary) -> List[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


@dataclass(frozen=True)
class Placed:
    """One tensor of a segment as the header places it."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def placements(entries) -> List[Placed]:
    """The header's [dtype, shape, offset] entries, checked: known dtypes, offsets aligned
    to the dtype (so tensors can be viewed in place)."""
    out = []
    for dtype_name, shape, offset in entries:
        dtype = SEGMENT_DTYPES.get(dtype_name)
        if dtype is None:
            raise SegmentError(
                f"dtype {dtype_name!r} is not one of {sorted(SEGMENT_DTYPES)}"
            )
        if offset % dtype.itemsize:
            raise SegmentError(
                f"a {dtype_name} tensor at offset {offset}, not a multiple of {dtype.itemsize}"
            )
        out.append(Placed(dtype, tuple(shape), offset))
    return out


class MappedSegment(NamedTuple):
    """A segment's tensors, viewed in place, and ``runs``: 1-d views that cover exactly
    their bytes, tensors of one dtype that lie back to back joined into one (what a check
    of every element reads in a few operations, not one per tensor)."""

    tensors: List[torch.Tensor]
    runs: List[torch.Tensor]


def map_tensors(fd: int, entries) -> MappedSegment:
    """The tensors ``entries`` ([dtype, shape, offset] each) place in segment ``fd``,
    viewed in place in one mapping (one view each of the mapping in its dtype); ``fd`` is
    closed here whatever happens. The segment must be a memfd sealed against shrinking
    whose allocated pages cover every placed byte, so that no read of the mapping can
    fault; the mapping goes with the last tensor."""
    try:
        placed = placements(entries)
        end = max((p.offset + p.nbytes for p in placed), default=0)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError("the segment is not shared memory (not a regular file)")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise SegmentError(
                "the segment is not a memfd (it takes no seals)"
            ) from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SegmentError("the segment is not sealed against shrinking")
        if st.st_size < end or st.st_blocks * 512 < end:
            raise SegmentError(
                f"the segment holds {st.st_size} bytes ({st.st_blocks * 512} allocated), "
                f"the header places {end}"
            )
        if end == 0:
            return MappedSegment(
                [torch.empty(p.shape, dtype=p.dtype) for p in placed], []
            )
        # writable, so that nothing the engine does with a shard can fault; the segment is
        # the sender's copy for this update, which it overwrites only after the answer
        mapping = mmap.mmap(fd, end, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    typed: Dict[torch.dtype, torch.Tensor] = {}
    tensors, runs = [], []
    # [dtype's index, start, end] in the dtype's elements
    run: Optional[List[int]] = None
    for p in placed:
        if not p.nbytes:
            tensors.append(torch.empty(p.shape, dtype=p.dtype))
            continue
        size = p.dtype.itemsize
        view = typed.get(p.dtype)
        if view is None:
            view = typed[p.dtype] = whole[: end - end % size].view(p.dtype)
        start = p.offset // size
        tensors.append(view.as_strided(p.shape, contiguous_strides(p.shape), start))
        if run is not None and run[0] is view and run[2] == start:
            run[2] = start + p.nbytes // size
            continue
        if run is not None:
            runs.append(run[0][run[1] : run[2]])
        run = [view, start, start + p.nbytes // size]
    if run is not None:
        runs.append(run[0][run[1] : run[2]])
    return MappedSegment(tensors, runs)
