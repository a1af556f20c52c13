"""What a peer can push into an engine rank's socket, at unit level: the header decoder
is bounded (nesting, size, integers, keys, types) and raises nothing but DeliveryError,
a receiver drops every malformed message and still takes the next good payload, and a
pickled frame names nothing beyond CUDA IPC's rebuild of a tensor (nothing on CPU).
Channel paths with NUL or undecodable bytes are refused by name, and the tensors only
some trainer ranks delivered are named (``delivered``)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import uuid
from re import escape as re_escape

import pytest
import torch
import zmq
from hostile_pickles import SocketFromSender
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.weight_sync.delivered import missing_deliveries
from sglang.srt.weight_sync.delivery import ShardReceiver, unpickle_handles
from sglang.srt.weight_sync.protocol import (
    CUDA_IPC_GLOBALS,
    ChannelError,
    DeliveryError,
    LayoutFrames,
    PayloadKind,
    decode_header,
    encode_header,
    make_channel,
    request_problems,
    resolve_channel,
)
from sglang.srt.weight_sync.source_layout import MeshSpec

# isort: split
# pr: scale
from sglang.srt.weight_sync.protocol import Fp8Region, Fp8RegionKind

# pr: scale end

NESTED = b"[" * 400_000 + b"]" * 400_000  # the issue's input: 400,000 levels


def _good_header(update_id: str = "u", kind=PayloadKind.SHARDS) -> dict:
    spec = MeshSpec.sharded((4, 2), torch.float32, 0, [[0, 1], [2, 3]]).to_wire()
    return json.loads(
        encode_header(
            update_id,
            0,
            {0: 0, 1: 1},
            [("w", spec)],
            [],
            kind,
            ["w"],
            "f" * 16,
            [("torch.float32", [2, 2])],
        )
    )


def _issue_inputs():
    """The issue's headers: 400,000 nesting levels; ``1e400`` where ranks go."""
    overflow = json.dumps(_good_header()).replace(
        '"trainer_rank": 0', '"trainer_rank": 1e400'
    )
    ranks = json.dumps(_good_header()).replace(
        '"rank_map": [[0, 0]', '"rank_map": [[1e400, 0]'
    )
    assert "1e400" in overflow and "1e400" in ranks
    return {
        "nested": [NESTED, b"x"],
        "1e400 as the trainer rank": [overflow.encode(), b"x" * 16],
        "1e400 in the rank map": [ranks.encode(), b"x" * 16],
    }


@pytest.mark.parametrize("case", sorted(_issue_inputs()))
def test_the_issues_headers_are_refused_as_malformed(case):
    with pytest.raises(DeliveryError) as e:
        decode_header(_issue_inputs()[case])
    assert ("deeper than" if case == "nested" else "1e400 is not an integer") in str(
        e.value
    )


def test_a_good_header_decodes():
    header = decode_header([json.dumps(_good_header()).encode(), b"x" * 16])
    assert header["rank_map"] == {0: 0, 1: 1} and header["kind"] == PayloadKind.SHARDS
    assert header["tensors"][0][0] == "w" and header["inline"] == [
        ["torch.float32", [2, 2]]
    ]


@pytest.mark.parametrize(
    "field,value,text",
    [
        ("trainer_rank", -1, "header field 'trainer_rank' is -1"),
        ("trainer_rank", True, "header field 'trainer_rank' is True"),
        ("rank_map", [[0, 0], [0, 1]], "each trainer rank once"),
        ("kind", ["shards"], "header field 'kind'"),
        ("update_id", "", "header field 'update_id'"),
        ("inline", [["torch.float32", [-1]]], "header field 'inline'"),
        (
            "tensors",
            [["w", [[4], "float32", [0, "1"], [["R"]]]]],
            "header field 'tensors'",
        ),
        (
            "pieces",
            [["q", ["holders", [4], "float32", [[0]]]]],
            "header field 'pieces'",
        ),
        ("surplus", 1, "unknown ['surplus']"),
        # a layout names its mesh by index into "meshes" (one here)
        ("tensors", [["w", [[4], "float32", 1, [["R"]]]]], "mesh index below 1"),
        ("tensors", [["w", [[4], "float32", True, [["R"]]]]], "header field 'tensors'"),
        ("meshes", [[0, "1"]], "header field 'meshes'"),
        ("meshes", {"0": [0]}, "header field 'meshes'"),
    ],
)
def test_header_fields_are_checked_by_type_and_range(field, value, text):
    header = dict(_good_header(), **{field: value})
    with pytest.raises(DeliveryError, match="header") as e:
        decode_header([json.dumps(header).encode(), b"x" * 16])
    assert text in str(e.value)


# pr: scale
def _params_header(regions) -> dict:
    """A "params" payload of one e4m3 region (16 x 16 of a 128-block weight) and one staged."""
    return json.loads(
        encode_header(
            "u",
            0,
            {0: 0},
            [("fp8-region/0", None), ("fp8-region/1", None)],
            [],
            PayloadKind.PARAMS,
            ["w"],
            "f" * 16,
            [("torch.uint8", [16 * 16 + 4]), ("torch.bfloat16", [16, 16])],
            fp8_regions=regions,
        )
    )


REGIONS = [
    Fp8Region(
        "fp8-region/0", Fp8RegionKind.QUANTIZED, "w", (), (0, 0), (16, 16), (128, 128)
    ),
    Fp8Region(
        "fp8-region/1", Fp8RegionKind.STAGED, "w", (1,), (0, 0), (16, 16), (128, 128)
    ),
]


def test_fp8_regions_decode_as_they_were_encoded():
    header = decode_header([json.dumps(_params_header(REGIONS)).encode(), b"", b""])
    assert header["fp8_regions"] == tuple(REGIONS)
    assert REGIONS[0].quantized_bytes == 16 * 16 + 4


@pytest.mark.parametrize(
    "regions,text",
    [
        ([["fp8-region/0", "e5m2", "w", [], [0, 0], [16, 16], [128, 128]]], "kind"),
        ([["fp8-region/9", "e4m3", "w", [], [0, 0], [16, 16], [128, 128]]], "once"),
        ([["fp8-region/0", "e4m3", "w", [], [0], [16], [128, 128]]], "fp8_regions"),
        (
            [["fp8-region/0", "e4m3", "w", [], [0, 0], [16, 16], [0, 128]]],
            "fp8_regions",
        ),
        (
            [["fp8-region/0", "e4m3", "w", [], [0, -1], [16, 16], [128, 128]]],
            "fp8_regions",
        ),
        ([["fp8-region/0", "e4m3", "w", [], [0, 0], [16, 16], [128, 128]]] * 2, "once"),
        ({"fp8-region/0": 1}, "fp8_regions"),
    ],
)
def test_fp8_regions_are_checked_by_type_range_and_key(regions, text):
    header = dict(_params_header(REGIONS), fp8_regions=regions)
    with pytest.raises(DeliveryError, match="header field 'fp8_regions'") as e:
        decode_header([json.dumps(header).encode(), b"", b""])
    assert text in str(e.value)


def test_fp8_regions_only_in_a_params_payload():
    header = dict(_params_header(REGIONS), kind=PayloadKind.SHARDS.value)
    with pytest.raises(DeliveryError, match='none outside a "params" payload'):
        decode_header([json.dumps(header).encode(), b"", b""])


# pr: scale end
@pytest.mark.parametrize(
    "raw,text",
    [
        (b'{"update_id": "a", "update_id": "b"}', "repeats a key"),
        (b'{"trainer_rank": NaN}', "NaN is not an integer"),
        (b'{"trainer_rank": -Infinity}', "-Infinity is not an integer"),
        (b'{"trainer_rank": 1.5}', "1.5 is not an integer"),
        (b'{"trainer_rank": ' + b"9" * 5000 + b"}", "out of range"),
        (b"\xff\xfe garbage", "unreadable header"),
        (b'"\\ud800"', "not an object"),
        (b"x" * ((1 << 20) + 1), "reads at most 1048576 bytes"),
    ],
)
def test_unreadable_or_unbounded_headers_are_refused(raw, text):
    with pytest.raises(DeliveryError) as e:
        decode_header([raw, b"x"])
    assert text in str(e.value)


def test_frame_count_must_match_the_header():
    raw = json.dumps(_good_header()).encode()
    for frames in ([raw], [raw, b"x" * 16, b"y"]):
        with pytest.raises(DeliveryError, match="expected a header and 1 more"):
            decode_header(frames)
    with pytest.raises(DeliveryError, match="an empty message"):
        decode_header([])


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
HEADER_KEYS = sorted(_good_header())


@st.composite
def hostile_messages(draw):
    """Any byte string, any JSON value, or a good header with one field replaced by any
    JSON value (or removed), each with any number of further frames."""
    choice = draw(st.sampled_from(["bytes", "json", "field", "deep"]))
    if choice == "bytes":
        head = draw(st.binary(max_size=256))
    elif choice == "json":
        head = json.dumps(draw(JSON_VALUES)).encode()
    elif choice == "deep":
        depth = draw(st.integers(30, 5000))
        head = b'{"update_id": ' + b"[" * depth + b"]" * depth + b"}"
    else:
        header = _good_header(draw(st.text(max_size=8)))
        key = draw(st.sampled_from(HEADER_KEYS))
        if draw(st.booleans()):
            header.pop(key)
        else:
            header[key] = draw(JSON_VALUES)
        head = json.dumps(header).encode()
    rest = draw(st.lists(st.binary(max_size=32), max_size=3))
    return [head, *rest]


@settings(max_examples=400, deadline=None)
@given(frames=hostile_messages())
def test_decoder_raises_nothing_but_delivery_error(frames):
    try:
        header = decode_header(frames)
    except DeliveryError:
        return
    # accepted: every field has the type later code reads it as
    assert isinstance(header["update_id"], str) and isinstance(
        header["trainer_rank"], int
    )
    assert all(
        isinstance(k, int) and isinstance(v, int) for k, v in header["rank_map"].items()
    )
    assert isinstance(header["kind"], PayloadKind)


@pytest.fixture(scope="module")
def pushed():
    """A receiver (engine rank 0) on a fresh channel and a PUSH socket into it."""
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    receiver._socket(channel)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{os.path.join(channel, 'tp0.sock')}")
    yield channel, receiver, sock
    sock.close(0)
    ctx.term()
    receiver.close()


def _good_message(update_id: str):
    header = _good_header(update_id)
    header["rank_map"] = [[0, 0], [1, 1]]
    return [json.dumps(header).encode(), torch.arange(4.0).numpy().tobytes()]


def test_the_issues_headers_are_dropped_and_the_next_update_succeeds(pushed):
    channel, receiver, sock = pushed
    for frames in _issue_inputs().values():
        sock.send_multipart(frames)
    update_id = f"good-{uuid.uuid4().hex}"
    sock.send_multipart(_good_message(update_id))
    payload = receiver.receive(channel, update_id, timeout_s=30)
    assert torch.equal(payload.tensors["w"], torch.arange(4.0).reshape(2, 2))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(messages=st.lists(hostile_messages(), min_size=1, max_size=3))
def test_after_any_message_the_next_good_payload_is_taken(pushed, messages):
    channel, receiver, sock = pushed
    for frames in messages:
        sock.send_multipart(frames)
    update_id = f"good-{uuid.uuid4().hex}"
    sock.send_multipart(_good_message(update_id))
    payload = receiver.receive(channel, update_id, timeout_s=30)
    assert payload.update_id == update_id and payload.trainer_rank == 0


def test_a_malformed_header_is_dropped_and_named_when_nothing_else_comes(pushed):
    channel, receiver, sock = pushed
    sock.send_multipart(_issue_inputs()["nested"])
    with pytest.raises(DeliveryError, match="no payload for update 'never'") as e:
        receiver.receive(channel, "never", timeout_s=1)
    assert "malformed message: the header nests deeper than 32 levels" in str(e.value)


# ---------------------------------------------------------------- pickled frames


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("kind", list(PayloadKind))
def test_a_pickled_socket_is_refused_without_connecting(tmp_path, cuda, kind):
    address = str(tmp_path / "listener")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    listener.setblocking(False)
    try:
        data = pickle.dumps([SocketFromSender(address)], protocol=4)
        with pytest.raises(pickle.UnpicklingError) as e:
            unpickle_handles(data, kind, cuda=cuda)
        tensorless = ()  # kinds that carry no tensors, so no handles
        # pr: scale
        tensorless = (PayloadKind.DESCRIBE,)
        # pr: scale end
        if cuda and kind not in tensorless:
            assert "refused (allowed: CUDA IPC handles only)" in str(e.value)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


@pytest.mark.parametrize(
    "module,name",
    [
        ("multiprocessing.resource_sharer", "DupFd"),
        ("multiprocessing.reduction", "_rebuild_socket"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("functools", "partial"),
        ("builtins", "getattr"),
        ("os", "system"),
    ],
)
def test_cuda_handles_name_only_what_rebuilds_a_cuda_tensor(module, name):
    assert (module, name) not in CUDA_IPC_GLOBALS
    data = _global_pickle(module, name)
    with pytest.raises(pickle.UnpicklingError, match=f"global {module}.{name} refused"):
        unpickle_handles(data, PayloadKind.SHARDS, cuda=True)


def _global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle whose only content is the global ``module.name``."""

    def unicode(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return (
        b"\x80\x04" + unicode(module) + unicode(name) + b"\x93."
    )  # STACK_GLOBAL, STOP


def test_cuda_ipc_globals_load_and_nothing_loads_on_cpu():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    data = pickle.dumps(
        [torch.Size([2, 3]), torch.bfloat16, torch.Tensor, rebuild_cuda_tensor]
    )
    carrying = [PayloadKind.SHARDS]  # kinds whose CUDA tensors travel as IPC handles
    # pr: scale
    carrying.append(PayloadKind.PARAMS)
    # pr: scale end
    for kind in carrying:
        assert unpickle_handles(data, kind, cuda=True) == [
            torch.Size([2, 3]),
            torch.bfloat16,
            torch.Tensor,
            rebuild_cuda_tensor,
        ]
    refused = [(PayloadKind.SHARDS, False)]
    # pr: scale
    refused.append((PayloadKind.DESCRIBE, True))  # it carries no tensors
    # pr: scale end
    for kind, cuda in refused:
        with pytest.raises(pickle.UnpicklingError, match="refused"):
            unpickle_handles(data, kind, cuda=cuda)


# ---------------------------------------------------------------- channel paths


@pytest.mark.parametrize(
    "channel,text",
    [
        ("/tmp/sglang-weights-a\x00b", "holds a NUL byte"),
        ("/tmp/sglang-weights-\udcff", "is not valid UTF-8"),
    ],
)
def test_channel_paths_with_nul_or_undecodable_bytes_are_refused_by_name(channel, text):
    with pytest.raises(ChannelError) as e:
        resolve_channel(channel)
    assert f"channel {channel!r}" in str(e.value) and text in str(e.value)
    req = type(
        "Req",
        (),
        dict(update_id="u", channel=channel, timeout_s=1.0, bucket_bytes=None),
    )
    assert any(f"channel {channel!r}" in p and text in p for p in request_problems(req))


# ---------------------------------------------------------------- who delivered what


def test_tensors_only_some_trainer_ranks_delivered_are_named():
    assert missing_deliveries([(0, ["a", "b"]), (1, ["b", "a"])]) == []
    assert missing_deliveries([(0, ["a", "b"]), (1, ["b"]), (2, ["b"])]) == [
        "tensor 'a' was delivered by trainer rank(s) [0] but not by trainer rank(s) [1, 2]"
    ]
    assert missing_deliveries([(3, ["b"]), (1, ["a"])]) == [
        "tensor 'a' was delivered by trainer rank(s) [1] but not by trainer rank(s) [3]",
        "tensor 'b' was delivered by trainer rank(s) [3] but not by trainer rank(s) [1]",
    ]


def _split(update_id: str = "u"):
    """``_good_header`` as the sender sends it: a head and a layout frame (``LayoutFrames``)."""
    return LayoutFrames().encode(_good_header(update_id)) + [b"x" * 16]


def test_a_layout_read_before_is_taken_as_it_was_checked():
    """The same layout frame in a later update is parsed and checked once: the receiver's
    memo gives back the lists it checked, and the decoded header equals the one-frame
    header's; the sender encodes equal fields once (the very same bytes)."""
    sender, memo = LayoutFrames(), LayoutFrames()
    first = sender.encode(_good_header("u1"))
    second = sender.encode(_good_header("u2"))
    assert first[1] is second[1] and first[0] != second[0]
    one = decode_header(first + [b"x" * 16], layouts=memo)
    two = decode_header(second + [b"x" * 16], layouts=memo)
    assert two["tensors"] is one["tensors"] and two["update_id"] == "u2"
    plain = decode_header([json.dumps(_good_header("u2")).encode(), b"x" * 16])
    assert {k: v for k, v in two.items() if k != "data_at"} == {
        k: v for k, v in plain.items() if k != "data_at"
    }
    assert (two["data_at"], plain["data_at"]) == (2, 1)


@pytest.mark.parametrize(
    "case, text",
    [
        ("no layout frame", "no second frame"),
        ("unknown head key", "header keys: unknown ['tensors']"),
        ("unknown layout key", "layout keys: unknown ['update_id']"),
        ("layout not an object", "is a JSON list, not an object"),
        ("bad tensors in a layout", "header field 'tensors'"),
        # pr: scale
        ("segment without placements", "header field 'segment' is 'seg'"),
        # pr: scale end
        ("frames", "expected a header, its layout and 1 more"),
    ],
)
def test_malformed_split_headers_are_refused(case, text):
    """A head and layout frame are checked as the one-frame header is, each on its own
    keys; a layout that differs from one read before is read in full (a memo that held a
    good layout lets nothing malformed through)."""
    memo = LayoutFrames()
    decode_header(_split(), layouts=memo)  # a good layout kept
    head, layout, data = _split()
    h, lay = json.loads(head), json.loads(layout)
    frames = {
        "no layout frame": lambda: [head],
        "unknown head key": lambda: [
            json.dumps({**h, "tensors": []}).encode(),
            layout,
            data,
        ],
        "unknown layout key": lambda: [
            head,
            json.dumps({**lay, "update_id": "x"}).encode(),
            data,
        ],
        "layout not an object": lambda: [head, b"[1, 2]", data],
        "bad tensors in a layout": lambda: [
            head,
            json.dumps({**lay, "tensors": [["w", [1]]]}).encode(),
            data,
        ],
        # pr: scale
        "segment without placements": lambda: [
            json.dumps({**h, "segment": "seg"}).encode(),
            layout,
            data,
        ],
        # pr: scale end
        "frames": lambda: [head, layout],
    }[case]()
    with pytest.raises(DeliveryError, match=re_escape(text)):
        decode_header(frames, layouts=memo)
