"""CPU payloads through shared memory (``weight_sync.shared_segment``): the bytes arrive
exactly, in place, with an explicit lifetime (nothing in /dev/shm, no descriptor or
mapping left behind), cast once where the engine keeps a smaller dtype, and every
hostile segment or header is refused without harming the next update."""

import array
import gc
import json
import os
import re
import socket
import tempfile
import weakref

import pytest
import torch
import zmq
from engine import SHM_PREFIXES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from payload_samples import every_dtype_and_shape

from sglang.srt.weight_sync.apply import nonfinite_buffers, nonfinite_tensors
from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.copy_program import FixedShards
from sglang.srt.weight_sync.delivery import DeliveryError, ShardReceiver, ShardSender
from sglang.srt.weight_sync.protocol import (
    decode_header,
    encode_header,
    make_channel,
    segment_socket_path,
    socket_path,
)
from sglang.srt.weight_sync.shared_segment import ALIGN, SegmentWriter, layout
from sglang.srt.weight_sync.source_layout import MeshSpec
from sglang.srt.weight_sync.target_layout import ParamTarget, Piece
from sglang.srt.weight_sync.wire_dtypes import (
    cast_problems,
    engine_dtypes,
    write_dtypes,
)


def _mappings() -> int:
    """This process's mappings of payload segments."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum("memfd:sglang-weights" in line for line in f)


def _in_segment(t: torch.Tensor) -> bool:
    """Whether ``t``'s data lies in a mapping of a payload segment."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            if "memfd:sglang-weights" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def _fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def test_a_kept_description_stands_for_its_dtypes_views_and_header(pair):
    """``send``'s ``layout`` (the trainer's kept description): while it is the same object
    the shards' dtypes, their views in the segment and the header are the last send's,
    with the new values in them; when the engine's dtypes change the casts follow at
    once, and another description object lays the shards out anew."""
    channel, receiver, sender = pair
    w, b = torch.randn(8, 4), torch.randn(4)
    shards = [("w", w, _full(w)), ("b", b, _full(b))]
    described, other = object(), object()

    def update(i, layout, bump=0.0):
        shards[0] = ("w", w + bump, shards[0][2])
        sender.send(f"u{i}", 0, {0: 0}, shards, layout=layout)
        payload = receiver.receive(channel, f"u{i}", timeout_s=30)
        got = {n: t.clone() for n, t in payload.tensors.items()}
        del payload
        sender.release()
        return got

    first = update(0, described)
    assert first["w"].dtype == torch.float32 and torch.equal(first["w"], w)
    views, built = sender._segment._views, sender._header[1]
    second = update(1, described, 1.0)
    assert torch.equal(second["w"], w + 1.0) and torch.equal(second["b"], b)
    assert sender._segment._views is views and sender._header[1] is built
    write_dtypes(channel, 0, "layout", {"w": torch.bfloat16})  # the engine's dtypes
    third = update(2, described, 2.0)
    assert third["w"].dtype == torch.bfloat16
    assert torch.equal(third["w"], (w + 2.0).bfloat16())
    assert sender._segment._views is not views and sender._header[1] is not built
    views, built = sender._segment._views, sender._header[1]
    assert torch.equal(update(3, described, 3.0)["w"], (w + 3.0).bfloat16())
    assert sender._segment._views is views and sender._header[1] is built
    fourth = update(4, other, 4.0)  # another description: laid out and built anew
    assert torch.equal(fourth["w"], (w + 4.0).bfloat16())
    assert sender._header[1] is not built


def _segment_fds() -> int:
    """This process's descriptors of payload segments (memfds named for them)."""
    return sum("memfd:sglang-weights" in link for link in _links().values())


def _links() -> dict[int, str]:
    """This process's open descriptors and what each refers to."""
    out = {}
    for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{os.getpid()}/fd/{fd}")
        except OSError:
            pass
    return out


def _holding(identity: tuple[int, int]) -> list[int]:
    """This process's descriptors that refer to the file ``identity`` (device, inode)."""
    out = []
    for fd in _links():
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        out += [fd] if (st.st_dev, st.st_ino) == identity else []
    return out


def _full(t: torch.Tensor) -> MeshSpec:
    return MeshSpec.full(tuple(t.shape), t.dtype, [0])


@pytest.fixture
def pair():
    """A bound receiver (engine rank 0) and a sender on a fresh channel."""
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    receiver._socket(channel)
    sender = ShardSender(channel, engine_rank=0)
    yield channel, receiver, sender
    sender.close()
    receiver.close()


def _send(sender, update_id, named):
    sender.send(update_id, 0, {0: 0}, [(n, t, _full(t)) for n, t in named])


def test_layout_puts_each_dtype_in_one_aligned_run():
    shapes = [(3,), (5,), (2, 2), (7,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    offsets, size = layout(shapes, dtypes)
    # bfloat16 first (by name), back to back; float32 from the next aligned byte
    assert offsets == [ALIGN, 0, ALIGN + 12, 10] and size == ALIGN + 12 + 16


def test_cpu_tensors_travel_through_one_segment_whose_mapping_serves_the_next_update(
    pair,
):
    channel, receiver, sender = pair
    sent = every_dtype_and_shape()
    before = _mappings()
    _send(sender, "u1", sent)
    payload = receiver.receive(channel, "u1", timeout_s=30)
    for name, t in sent:
        got = payload.tensors[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    # the engine's tensors are views of the segment the sender filled: no copy on the way
    assert all(_in_segment(t) for t in payload.tensors.values() if t.numel())
    assert _mappings() == before + 1 + 1  # the sender's mapping and the engine's
    assert payload.tensors["bf16"].untyped_storage().data_ptr() == (
        payload.tensors["ints"].untyped_storage().data_ptr()
    )
    payload.tensors["bf16"].add_(1)  # the engine may write what it received
    first = dict(payload.tensors)
    # the tensors come as FixedShards: the same mapping of the same views while kept
    assert isinstance(payload.tensors, FixedShards)
    shards = weakref.ref(payload.tensors)
    del payload, got
    gc.collect()
    # the channel keeps the engine's mapping: the sender fills the same segment next time
    assert _mappings() == before + 2
    sender.release()  # the engine answered
    resent = [(n, t + 1 if t.is_floating_point() else t) for n, t in sent]
    _send(sender, "u2", resent)
    payload = receiver.receive(channel, "u2", timeout_s=30)
    for name, t in resent:
        assert payload.tensors[name] is first[name], name  # mapped once, viewed once
        assert torch.equal(payload.tensors[name], t), name
    assert payload.tensors is shards()
    assert _mappings() == before + 2
    # another layout: the kept mapping goes, the new segment's is kept instead
    sender.release()
    del payload, first
    _send(sender, "u3", [("w", torch.arange(6.0))])
    payload = receiver.receive(channel, "u3", timeout_s=30)
    assert torch.equal(payload.tensors["w"], torch.arange(6.0))
    assert isinstance(payload.tensors, FixedShards) and shards() is None
    del payload
    gc.collect()
    assert _mappings() == before + 2
    receiver.close()  # the channel's mapping goes with it
    assert _mappings() == before + 1
    sender.close()
    assert _mappings() == before


def test_the_first_update_of_a_channel_travels_inline_and_later_ones_shared():
    channel = make_channel()
    sender = ShardSender(channel, engine_rank=0)  # before any engine listens
    receiver = ShardReceiver(engine_rank=0)
    try:
        w = torch.randn(4, 4)
        _send(sender, "u1", [("w", w)])
        first = receiver.receive(channel, "u1", timeout_s=30)
        assert torch.equal(first.tensors["w"], w)
        assert not _in_segment(first.tensors["w"])  # inline: the engine's own bytes
        sender.release()
        _send(sender, "u2", [("w", w + 1)])
        second = receiver.receive(channel, "u2", timeout_s=30)
        assert torch.equal(second.tensors["w"], w + 1)
        assert _in_segment(second.tensors["w"])
    finally:
        sender.close()
        receiver.close()


def test_a_segment_is_reused_only_after_the_answer(pair):
    channel, receiver, sender = pair
    w = torch.randn(64)
    _send(sender, "u1", [("w", w)])
    first = receiver.receive(channel, "u1", timeout_s=30).tensors["w"]
    # no answer yet: the next update gets a new segment, the first one's bytes stay
    _send(sender, "u2", [("w", w + 1)])
    second = receiver.receive(channel, "u2", timeout_s=30).tensors["w"]
    assert torch.equal(first, w) and torch.equal(second, w + 1)
    assert first.data_ptr() != second.data_ptr()
    del first, second
    gc.collect()
    sender.release()  # answered: the segment takes the next update
    fd = sender._segment.fd
    _send(sender, "u3", [("w", w + 2)])
    assert sender._segment.fd == fd
    assert torch.equal(
        receiver.receive(channel, "u3", timeout_s=30).tensors["w"], w + 2
    )


def test_many_updates_leave_no_descriptor_mapping_or_shm_file(pair):
    channel, receiver, sender = pair
    shm = set(os.listdir("/dev/shm"))
    w = torch.randn(1024)
    for i in range(3):  # the segment and the sockets exist from here on
        _send(sender, f"warm{i}", [("w", w)])
        receiver.receive(channel, f"warm{i}", timeout_s=30)
        sender.release()
    gc.collect()
    files, fds, maps = _segment_fds(), _fds(), _mappings()
    updates = 50
    for i in range(updates):
        _send(sender, f"u{i}", [("w", w + i)])
        payload = receiver.receive(channel, f"u{i}", timeout_s=30)
        assert torch.equal(payload.tensors["w"], w + i)
        del payload
        sender.release()
    gc.collect()
    # segments (memfds) and their mappings: exactly as before
    assert (_segment_fds(), _mappings()) == (files, maps)
    # sockets: none per update (in the full suite, sockets of engines and servers that earlier
    # tests left to the session close or open in their own time, so the count is not exact)
    assert _fds() - fds < updates, (fds, _fds())
    # no file in /dev/shm either (a segment is a memfd). /dev/shm is the machine's: under
    # pytest-xdist the other worker's engines and multiprocessing queues add SGLang's files
    # and named semaphores meanwhile (``engine.SHM_PREFIXES``), which this process never
    # makes; Python's own SharedMemory names ("psm_") stay counted, as a segment made that
    # way would take them
    others = tuple(p for p in SHM_PREFIXES if p != "psm_")
    new = set(os.listdir("/dev/shm")) - shm
    assert {n for n in new if not n.startswith(others)} == set(), new


def test_an_fp32_shard_travels_in_the_dtype_the_engine_keeps(pair):
    channel, receiver, sender = pair
    w, b = torch.randn(8, 4), torch.randn(4, dtype=torch.float64)
    write_dtypes(channel, 0, "layout", {"w": torch.bfloat16, "b": torch.float32})
    _send(sender, "u1", [("w", w), ("b", b), ("other", torch.randn(2))])
    payload = receiver.receive(channel, "u1", timeout_s=30)
    got = payload.tensors
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.bfloat16())
    assert got["b"].dtype == torch.float32 and torch.equal(got["b"], b.float())
    assert got["other"].dtype == torch.float32  # the engine said nothing about it
    # the layouts still say what the trainer holds: the engine sees the casts
    held = {n: s.dtype for n, s in payload.specs.items()}
    assert held["w"] == torch.float32
    kept = {"w": torch.bfloat16, "b": torch.float32}
    assert cast_problems(got, held, kept, 0) == []
    (problem,) = cast_problems(got, held, {"b": torch.float32}, 3)
    assert problem.startswith(
        "tensor 'w': trainer rank 3 holds it in torch.float32 and sent it cast to "
        "torch.bfloat16, but the engine keeps it in several dtypes or none"
    )


def test_engine_dtypes_name_only_tensors_kept_in_one_floating_dtype():
    def target(name, dtype, *tensors):
        pieces = tuple(
            Piece(t, Box((0,), (2,)), (), (2 * i,)) for i, t in enumerate(tensors)
        )
        return ParamTarget(name, (2 * len(tensors),), dtype, pieces)

    ranks = [
        [target("p", torch.bfloat16, "a", "b"), target("q", torch.float32, "c")],
        [target("p", torch.bfloat16, "a"), target("r", torch.bfloat16, "c")],
        [target("s", torch.int8, "d")],
    ]
    kept = engine_dtypes(ranks, {"alias_of_a": "a"})
    assert kept == {
        "a": torch.bfloat16,
        "b": torch.bfloat16,
        "alias_of_a": torch.bfloat16,
    }


def test_finite_checks_read_a_segment_run_at_once_and_still_name_the_tensor(pair):
    channel, receiver, sender = pair
    sent = [(f"t{i}", torch.randn(100)) for i in range(6)]
    sent[4][1][17] = float("nan")
    sent.append(("h", torch.full((5,), 60000.0).half()))  # sums past float16's range
    _send(sender, "u1", sent)
    got = receiver.receive(channel, "u1", timeout_s=30).tensors
    assert nonfinite_tensors(got) == ["t4"]
    got = dict(got)
    got.pop("t4")
    assert nonfinite_tensors(got) == []
    big = {"x": torch.full((4,), 3e38), "y": torch.full((4,), -torch.inf)}
    assert nonfinite_tensors({"x": big["x"]}) == []  # finite, though its sum is not
    assert nonfinite_tensors(big) == ["y"]
    buf = torch.zeros(4, 4)
    buf[3, 3] = float("inf")  # outside the delivered region: not read
    target = ParamTarget(
        "p", (4, 4), torch.float32, (Piece("w", Box((0, 0), (2, 4)), (), (0, 0)),)
    )
    assert nonfinite_buffers([target], {"p": buf}) == []
    buf[1, 0] = float("nan")
    assert nonfinite_buffers([target], {"p": buf}) == ["p"]


# ---------------------------------------------------------------- hostile segments


def _push(channel, header: dict, segment_id=None, fd=None, extra_fds=()):
    """A header into engine rank 0's socket, and ``fd`` (with ``extra_fds``) into its
    segment socket under ``segment_id``."""
    if fd is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendmsg(
            [segment_id.encode()],
            [
                (
                    socket.SOL_SOCKET,
                    socket.SCM_RIGHTS,
                    array.array("i", [fd, *extra_fds]),
                )
            ],
            0,
            segment_socket_path(os.path.realpath(channel), 0),
        )
        sock.close()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{socket_path(os.path.realpath(channel), 0)}")
    push.send_multipart([json.dumps(header).encode()])
    push.close(linger=5000)
    ctx.term()


def _shared_header(update_id, segment_id, entries):
    return json.loads(
        encode_header(
            update_id,
            0,
            {0: 0},
            [("w", _full(torch.zeros(4)).to_wire())],
            [],
            "shards",
            [],
            "",
            None,
            (segment_id, entries),
        )
    )


def _memfd(nbytes: int, seal=True, write=True) -> int:
    fd = os.memfd_create("sglang-weights", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if write:
        os.write(fd, torch.arange(nbytes // 4, dtype=torch.float32).numpy().tobytes())
    if seal:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def _regular_file() -> int:
    f = tempfile.TemporaryFile()
    f.write(b"\x00" * 16)
    f.flush()
    return os.dup(f.fileno())


def _pipe() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


F32 = [["torch.float32", [4], 0]]
# case: (the descriptor sent, the id it is sent under, the header's placements, send it
# twice in one datagram, what the refusal says)
HOSTILE = {
    "a pipe": (_pipe, "ffff", F32, False, "not shared memory"),
    "a file": (_regular_file, "ffff", F32, False, "not a memfd|not sealed"),
    "not sealed": (lambda: _memfd(16, seal=False), "ffff", F32, False, "not sealed"),
    "too small": (lambda: _memfd(8), "ffff", F32, False, "the segment holds 8 bytes"),
    "sparse": (
        lambda: _memfd(1 << 30, write=False),
        "ffff",
        [["torch.float32", [1 << 28], 0]],
        False,
        r"\(0 allocated\)",
    ),
    "misaligned": (
        lambda: _memfd(64),
        "ffff",
        [["torch.float32", [4], 2]],
        False,
        "not a multiple of 4",
    ),
    "unknown dtype": (
        lambda: _memfd(64),
        "ffff",
        [["torch.complex64", [2], 0]],
        False,
        "dtype 'torch.complex64'",
    ),
    "another id": (lambda: _memfd(64), "eeee", F32, False, "no shared-memory segment"),
    "two descriptors": (
        lambda: _memfd(64),
        "ffff",
        F32,
        True,
        "no shared-memory segment",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_segment_is_refused_and_the_next_update_succeeds(pair, case):
    channel, receiver, sender = pair
    make, sent_id, entries, twice, text = HOSTILE[case]
    fd = make()
    st = os.fstat(fd)
    sent = (st.st_dev, st.st_ino)
    header = _shared_header("bad", "ffff", entries)
    _push(channel, header, sent_id, fd, extra_fds=(fd,) if twice else ())
    os.close(fd)
    with pytest.raises(
        DeliveryError, match="cannot read the shards of trainer rank 0"
    ) as e:
        receiver.receive(channel, "bad", timeout_s=30)
    assert re.search(text, str(e.value)), str(e.value)
    gc.collect()
    # every descriptor that came with it is closed (other descriptors are not counted: in
    # the full suite, threads of earlier tests' engines open and close their own)
    assert _holding(sent) == []
    w = torch.randn(4)
    _send(sender, "good", [("w", w)])
    assert torch.equal(receiver.receive(channel, "good", timeout_s=30).tensors["w"], w)


SHARED_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=SHARED_VALUES, inline=st.booleans())
def test_a_shared_field_decodes_only_as_its_exact_shape(value, inline):
    header = _shared_header("u", "ffff", [["torch.float32", [4], 0]])
    header["shared"] = value
    if inline:
        header["inline"] = [["torch.float32", [4]]]
    frames = [json.dumps(header).encode()] + ([b"\x00" * 16] if inline else [])
    try:
        decoded = decode_header(frames)
    except DeliveryError:
        return
    shared = decoded["shared"]
    assert shared is None or (
        decoded["inline"] is None
        and isinstance(shared[0], str)
        and len(shared[1]) == 1
        and all(type(o) is int and o >= 0 for _, _, o in shared[1])
    )


def test_a_released_segment_hands_out_the_same_views_for_the_same_layout():
    """After the answer, the same shapes and dtypes get the views handed out last (a MoE
    model's tens of thousands are not cut again every update); another layout, or an
    unanswered segment, gets new ones, and what each holds is what was written."""
    writer = SegmentWriter()
    try:
        shapes, dtypes = [(4, 2), (3,)], [torch.float32, torch.bfloat16]
        first, _ = writer.allocate(shapes, dtypes)
        writer.release()
        again, _ = writer.allocate(shapes, dtypes)
        assert all(a is b for a, b in zip(first, again))
        fresh, _ = writer.allocate(shapes, dtypes)  # not released: a new segment
        assert fresh[0] is not first[0]
        writer.release()
        other, _ = writer.allocate([(2, 4), (3,)], dtypes)
        assert other[0].shape == (2, 4)
        writer.release()
        values = [torch.arange(8.0).view(2, 4), torch.ones(3)]
        fd, _ = writer.write(values, dtypes)
        assert torch.equal(writer._views[0], values[0])
        assert torch.equal(writer._views[1], values[1].bfloat16())
    finally:
        writer.close()


def test_a_sender_builds_a_layout_once_and_anew_when_a_spec_changes(pair):
    """The header of a payload in the segment is built once per layout (names, spec
    objects, placements) and reused with a new head; another spec object for the same
    tensor is another layout, which the engine then reads."""
    channel, receiver, sender = pair
    w = torch.randn(8, 4)
    rows = MeshSpec.full((8, 4), torch.float32, [0])
    shared = MeshSpec.full((8, 4), torch.float32, [0, 1])
    for i, spec in enumerate((rows, rows, shared, shared)):
        sender.send(f"u{i}", 0, {0: 0}, [("w", w + i, spec)])
        payload = receiver.receive(channel, f"u{i}", timeout_s=30)
        assert torch.equal(payload.tensors["w"], w + i)
        assert payload.specs["w"] == spec, (i, payload.specs["w"])
        del payload
        sender.release()
    built = sender._header[1]
    sender.send("u4", 0, {0: 0}, [("w", w, shared)])
    assert sender._header[1] is built  # the same layout: built once
    assert receiver.receive(channel, "u4", timeout_s=30).update_id == "u4"
