"""Malformed and hostile input against a live TP-2 engine: each gets a clear refusal,
the engine keeps serving, and not one parameter changes.

Policy (docs/usage.md): fields are checked before any scheduler waits; a channel must
be a private ``sglang-weights-*`` directory of the engine's user (resolved, so every
spelling is one channel); messages pushed into an engine socket are parsed as a JSON
header before anything is unpickled; NaN/inf, duplicated names, unknown names
(including buffers that are not parameters) and 0-d tensors are refused; a consumed
update id is refused (no replay).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import zmq
from faults import TP, engine_fds, full_shards, generate, send, state, update
from hostile_pickles import SocketFromSender
from update_cases import new_weights
from update_checks import expected_checksums

PROMPTS = [[5, 17, 42, 7], [300, 2, 9, 11]]


@pytest.fixture(scope="module")
def baseline(engine):
    """The engine after one good update (seed 1): its state and generation."""
    from sglang.srt.weight_sync.protocol import make_channel

    eng, model_dir, config = engine
    weights = new_weights(model_dir, 1)
    success, message, _ = update(
        eng, make_channel(), "good-1", [full_shards(weights)] * TP, timeout_s=60
    )
    assert success, message
    checks = state(eng)
    assert checks == expected_checksums(config, weights, TP, 1)
    return dict(state=checks, generation=generate(eng, PROMPTS))


def assert_unchanged(eng, baseline):
    assert state(eng) == baseline["state"], "a parameter changed"
    assert generate(eng, PROMPTS) == baseline["generation"], (
        "the engine no longer serves the old weights"
    )


def _channel():
    from sglang.srt.weight_sync.protocol import make_channel

    return make_channel()


def _private_dir(tmp_path, name="sglang-weights-x", mode=0o700):
    d = tmp_path / name
    d.mkdir()
    os.chmod(d, mode)
    return str(d)


def _foreign_dir(tmp_path):
    """A private channel-like directory of another user (needs root to make one)."""
    if os.getuid() != 0:
        return None
    d = _private_dir(tmp_path, "sglang-weights-foreign")
    os.chown(d, 65534, 65534)
    return d


def _bad_channels(tmp_path):
    real = _private_dir(tmp_path)
    link = tmp_path / "sglang-weights-link"
    link.symlink_to(real)
    a_file = tmp_path / "sglang-weights-file"
    a_file.write_text("x")
    return {
        "does not exist": str(tmp_path / "sglang-weights-missing"),
        "is not a directory": str(a_file),
        "is a symlink": str(link),
        "has mode 0777": _private_dir(tmp_path, "sglang-weights-open", 0o777),
        "has mode 0750": _private_dir(tmp_path, "sglang-weights-group", 0o750),
        "must start with 'sglang-weights-'": _private_dir(tmp_path, "somebody-private"),
        "is owned by uid 65534": _foreign_dir(tmp_path),
        "ipc limit": _private_dir(tmp_path, "sglang-weights-" + "x" * 120),
        "must be a non-empty path string": "",
    }


def test_bad_fields_and_channels_are_refused_at_once(engine, baseline, tmp_path):
    eng, model_dir, _ = engine
    weights = full_shards(new_weights(model_dir, 2))
    cases = [
        (dict(timeout_s=-1), "timeout_s=-1"),
        (dict(timeout_s=2_147_484), "timeout_s=2147484"),
        (dict(timeout_s=float("nan")), "timeout_s=nan"),
        (dict(bucket_bytes=1), "bucket_bytes=1"),
        (dict(bucket_bytes=-1), "bucket_bytes=-1"),
    ]
    for kwargs, text in cases:
        success, message, took = update(
            eng, _channel(), f"bad-{text}", [weights] * TP, **kwargs
        )
        assert not success and text in message and "refused" in message, message
        assert took < 5, f"{text}: refused after {took:.1f}s"
    for text, channel in _bad_channels(tmp_path).items():
        if channel is None:
            continue
        success, message, took = update(
            eng, channel, f"bad-channel-{len(text)}", timeout_s=30
        )
        assert not success and "channel" in message and text in message, (text, message)
        assert took < 5, f"{text}: refused after {took:.1f}s"
    assert_unchanged(eng, baseline)


def test_a_non_socket_file_in_the_channel_is_never_replaced(engine, baseline):
    eng, _, _ = engine
    channel = _channel()
    victim = os.path.join(channel, "tp1.sock")
    with open(victim, "w") as f:
        f.write("precious")
    success, message, _ = update(eng, channel, "victim", timeout_s=5)
    assert not success and "which is not a socket; refusing to replace it" in message, (
        message
    )
    assert open(victim).read() == "precious"
    assert_unchanged(eng, baseline)


def _push_when_bound(channel: str, rank: int, messages, delay: float = 0.3):
    """Another process's view: push raw frames into engine rank ``rank``'s socket once it exists."""

    def run():
        path = os.path.join(channel, f"tp{rank}.sock")
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"ipc://{path}")
        time.sleep(delay)
        for frames in messages:
            sock.send_multipart(frames)
        sock.close()
        ctx.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/sglang-weights-pwned",))


def test_garbage_and_blocked_pickles_pushed_into_the_socket(engine, baseline):
    import pickle

    eng, _, _ = engine
    channel = _channel()
    garbage = [[b"\x00\xffgarbage"], [b"not json", b"x"], [b'{"update_id": 1}', b"x"]]
    threads = [_push_when_bound(channel, r, garbage) for r in range(TP)]
    success, message, took = update(eng, channel, "garbage", timeout_s=3)
    assert (
        not success and "engine rank 0: no payload for update 'garbage'" in message
    ), message
    assert "malformed message" in message and took < 3 + 5
    channel = _channel()
    evil = [[_header("evil", r), pickle.dumps(_Evil())] for r in range(TP)]
    threads += [_push_when_bound(channel, r, [evil[r]]) for r in range(TP)]
    success, message, took = update(eng, channel, "evil", timeout_s=10)
    assert not success and "cannot read the shards of trainer rank 0" in message, (
        message
    )
    assert not os.path.exists("/tmp/sglang-weights-pwned")
    for t in threads:
        t.join(10)
    assert_unchanged(eng, baseline)


def _tensor_path(eng, req):
    """``req`` through the tokenizer manager's tensor path, inside a weight-update session."""
    eng.begin_weight_update()
    try:
        return eng.loop.run_until_complete(
            eng.tokenizer_manager.update_weights_from_tensor(req, None)
        )[:2]
    finally:
        eng.end_weight_update()


def test_reserved_tensor_format_with_unreadable_control_payloads(engine, baseline):
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.engine_update import DISTRIBUTED_LOAD_FORMAT

    eng, _, _ = engine
    cases = {
        "lacks ['update_id']": MultiprocessingSerializer.serialize(
            {"channel": _channel()}
        ),
        "unreadable 'distributed_shards' control payload": b"\x80garbage",
        "not a dict": MultiprocessingSerializer.serialize(["a", "list"]),
    }
    for text, payload in cases.items():
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * TP, load_format=DISTRIBUTED_LOAD_FORMAT
        )
        success, message = _tensor_path(eng, req)
        assert not success and text in message and "engine rank 1" in message, message
    assert_unchanged(eng, baseline)


def test_tensor_policy_nonfinite_duplicates_zero_dim_buffers(engine, baseline):
    from sglang.srt.weight_sync.source_layout import MeshSpec

    eng, model_dir, _ = engine
    weights = new_weights(model_dir, 3)
    name = "model.layers.0.mlp.down_proj.weight"
    nan, inf = dict(weights), dict(weights)
    nan[name] = weights[name].clone()
    nan[name][1, 2] = float("nan")
    inf[name] = weights[name].clone()
    inf[name][0, 0] = float("-inf")
    full = full_shards(weights)
    zero_d = (
        "model.norm.weight",
        torch.tensor(1.0),
        MeshSpec.full((), torch.float32, [0, 1]),
    )
    without_norm = [s for s in full if s[0] != "model.norm.weight"]
    buffer = (
        "model.layers.0.self_attn.k_cache_scale",
        torch.ones(1),
        MeshSpec.full((1,), torch.float32, [0, 1]),
    )
    cases = {
        f"tensor {name!r}: the shard from trainer rank 0 holds NaN or inf": [
            full_shards(nan)
        ]
        * TP,
        f"tensor {name!r}: the shard from trainer rank 1 holds NaN or inf": [
            full,
            full_shards(inf),
        ],
        "delivered twice by trainer rank 0": [full + full[:1], full],
        "tensor 'model.norm.weight': global shape ()": [without_norm + [zero_d]] * TP,
        "unknown tensor 'model.layers.0.self_attn.k_cache_scale'": [full + [buffer]]
        * TP,
    }
    for i, (text, per_rank) in enumerate(cases.items()):
        success, message, _ = update(
            eng, _channel(), f"policy-{i}", per_rank, timeout_s=30
        )
        assert not success and text in message and "no parameter changed" in message, (
            text,
            message,
        )
    assert_unchanged(eng, baseline)


def test_replayed_update_id_is_refused(engine, baseline):
    eng, model_dir, config = engine
    channel = _channel()
    weights = new_weights(model_dir, 4)
    success, message, _ = update(
        eng, channel, "once", [full_shards(weights)] * TP, timeout_s=30
    )
    assert success, message
    updated = state(eng)
    assert updated == expected_checksums(config, weights, TP, 1)
    replay = full_shards(new_weights(model_dir, 1))
    success, message, took = update(eng, channel, "once", [replay] * TP, timeout_s=30)
    assert (
        not success
        and "update id 'once' was already consumed; a replay is refused" in message
    ), message
    assert took < 5 and state(eng) == updated
    # back to the baseline for the other tests (a fresh id)
    success, message, _ = update(eng, channel, "back", [replay] * TP, timeout_s=30)
    assert success, message
    assert_unchanged(eng, baseline)


def test_one_socket_per_resolved_channel_and_a_bounded_number(engine, baseline):
    """Spellings of one directory ('..', trailing slash, './') share one socket, and distinct
    channels beyond MAX_CHANNELS retire the oldest: the engine's fds stay flat (the issue saw
    a server stop answering after 200 spellings)."""
    from sglang.srt.weight_sync.delivery import MAX_CHANNELS

    eng, _, _ = engine
    for i in range(MAX_CHANNELS):  # fill the engine's channel table
        assert not update(eng, _channel(), f"fill-{i}", timeout_s=0.1)[0]
    channel = _channel()
    parent, name = os.path.split(channel)
    spellings = [
        channel,
        channel + "/",
        os.path.join(parent, ".", name),
        os.path.join(channel, "..", name),
        os.path.join(channel, ".", ""),
    ]
    assert not update(eng, channel, "warm", timeout_s=0.1)[0]
    fds = engine_fds()
    for i, spelled in enumerate(spellings * 2):
        success, message, took = update(eng, spelled, f"spell-{i}", timeout_s=0.1)
        assert not success and "no payload" in message and took < 5, message
    for i in range(4):
        assert not update(eng, _channel(), f"more-{i}", timeout_s=0.1)[0]
    assert engine_fds() <= fds, "sockets accumulate in the engine"
    assert_unchanged(eng, baseline)


# ------------------------------------------------------------------------------------------
# Issue 24 ("holes found from outside"): each input, then a good update that succeeds, with
# generation served throughout.


def _good_update(eng, model_dir, baseline, update_id, channel=None):
    """A good update (the baseline's weights, a fresh id) succeeds, and the engine serves."""
    weights = full_shards(new_weights(model_dir, 1))
    success, message, _ = update(
        eng, channel or _channel(), update_id, [weights] * TP, timeout_s=60
    )
    assert success, message
    assert_unchanged(eng, baseline)


def _http_post(eng, monkeypatch, body: bytes):
    """POST /update_weights_distributed to SGLang's own HTTP app, served on the engine's
    event loop over its tokenizer manager: (status, JSON body)."""
    import types

    import httpx

    import sglang.srt.entrypoints.http_server as http_server

    monkeypatch.setattr(
        http_server,
        "_global_state",
        types.SimpleNamespace(
            tokenizer_manager=eng.tokenizer_manager,
            template_manager=None,
            scheduler_info={},
        ),
    )

    async def post():
        transport = httpx.ASGITransport(app=http_server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return await c.post(
                "/update_weights_distributed",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )

    response = eng.loop.run_until_complete(post())
    return response.status_code, response.json()


def _header(update_id, rank, **fields) -> bytes:
    import json

    from sglang.srt.weight_sync.source_layout import MeshSpec

    shape, dtype, mesh, placements = MeshSpec.full(
        (4,), torch.float32, [0, 1]
    ).to_wire()
    header = {
        "update_id": update_id,
        "trainer_rank": rank,
        "rank_map": [[0, 0], [1, 1]],
        "meshes": [mesh],  # a layout names its mesh by index (protocol.encode_header)
        "tensors": [["model.norm.weight", [shape, dtype, 0, placements]]],
        "pieces": [],
        **fields,
    }
    return json.dumps(header).encode()


def _issue_messages(rank: int):
    """The issue's inputs 2 and 3, as pushed into engine rank ``rank``'s socket."""
    overflow = (
        _header("someone-else", 0)
        .replace(b'"trainer_rank": 0', b'"trainer_rank": 1e400')
        .replace(b'"rank_map": [[0, 0]', b'"rank_map": [[1e400, 0]')
    )
    assert overflow.count(b"1e400") == 2
    return {
        "nested": [b"[" * 400_000 + b"]" * 400_000, b"x"],
        "1e400": [overflow, b"\x00" * 16],
    }


@pytest.mark.parametrize("case", ["nested", "1e400"])
def test_malformed_headers_left_in_the_socket_never_touch_the_next_update(
    engine, baseline, case
):
    """Issue 24, items 2 and 3: a header nested 400,000 levels deep, or with 1e400 where
    ranks go, is dropped on arrival; the next good update on that channel succeeds."""
    eng, model_dir, _ = engine
    channel = _channel()
    assert not update(eng, channel, f"bind-{case}", timeout_s=0.1)[
        0
    ]  # binds the sockets
    threads = [
        _push_when_bound(channel, r, [_issue_messages(r)[case]], delay=0.1)
        for r in range(TP)
    ]
    for t in threads:
        t.join(30)
    assert generate(eng, PROMPTS) == baseline["generation"]
    _good_update(eng, model_dir, baseline, f"after-{case}", channel)


def test_nul_in_the_channel_is_refused_naming_it_on_every_route(
    engine, baseline, monkeypatch
):
    """Issue 24, item 1: a NUL byte in the channel path is a 4xx naming the channel through
    HTTP, the Engine method and the tensor path (never a 500)."""
    import json

    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.engine_update import DISTRIBUTED_LOAD_FORMAT

    eng, model_dir, _ = engine
    channel = _channel() + "\x00tail"
    expected = f"channel {channel!r} holds a NUL byte"
    status, body = _http_post(
        eng,
        monkeypatch,
        json.dumps({"update_id": "nul-http", "channel": channel}).encode(),
    )
    assert status == 400 and expected in body["message"], (status, body)
    success, message, took = update(eng, channel, "nul-engine", timeout_s=30)
    assert not success and expected in message and took < 5, message
    control = {"update_id": "nul-tensor", "channel": channel, "timeout_s": 30}
    req = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(control)] * TP,
        load_format=DISTRIBUTED_LOAD_FORMAT,
    )
    success, message = _tensor_path(eng, req)
    assert not success and expected in message, message
    assert generate(eng, PROMPTS) == baseline["generation"]
    _good_update(eng, model_dir, baseline, "after-nul")


def test_schema_errors_are_answered_400_as_documented(engine, baseline, monkeypatch):
    """Issue 24, item 6: a body the server's schema refuses is answered 400 (SGLang's
    server replaces FastAPI's 422), as docs/usage.md says; then a good update over HTTP."""
    import json

    eng, model_dir, _ = engine
    for body in (
        {"update_id": 7, "channel": _channel()},
        {"update_id": "u", "channel": _channel(), "timeout_s": "soon"},
        {"channel": _channel()},
    ):
        status, reply = _http_post(eng, monkeypatch, json.dumps(body).encode())
        assert status == 400, (status, reply)
    assert generate(eng, PROMPTS) == baseline["generation"]
    channel = _channel()
    senders = send(
        channel, "schema-good", [full_shards(new_weights(model_dir, 1))] * TP
    )
    try:
        status, reply = _http_post(
            eng,
            monkeypatch,
            json.dumps(
                {"update_id": "schema-good", "channel": channel, "timeout_s": 60}
            ).encode(),
        )
    finally:
        for s in senders:
            s.close()
    assert status == 200 and reply["success"], reply
    assert_unchanged(eng, baseline)


def _fsdp_shards(weights):
    """Each trainer rank's FSDP shard (dim 0, torch's chunking) of every tensor."""
    from sglang.srt.weight_sync.source_layout import MeshSpec

    return [
        [
            (
                n,
                t.chunk(TP, dim=0)[r].contiguous(),
                MeshSpec.sharded(t.shape, t.dtype, 0, list(range(TP))),
            )
            for n, t in sorted(weights.items())
        ]
        for r in range(TP)
    ]


@pytest.mark.parametrize("layout", ["full", "fsdp"])
def test_a_tensor_only_some_trainer_ranks_deliver_is_named(engine, baseline, layout):
    """Issue 24, item 4: the refusal names the tensor and the trainer ranks that did and
    did not deliver it (not a plan mismatch)."""
    eng, model_dir, _ = engine
    weights = new_weights(model_dir, 2)
    name = "model.layers.0.mlp.down_proj.weight"
    per_rank = (
        [full_shards(weights)] * TP if layout == "full" else _fsdp_shards(weights)
    )
    per_rank = [per_rank[0], [s for s in per_rank[1] if s[0] != name]]
    success, message, _ = update(
        eng, _channel(), f"partial-{layout}", per_rank, timeout_s=30
    )
    expected = (
        f"tensor {name!r} was delivered by trainer rank(s) [0] but not by trainer "
        "rank(s) [1]"
    )
    assert not success and expected in message and "no parameter changed" in message, (
        message
    )
    assert_unchanged(eng, baseline)
    if layout == "fsdp":  # the same layout, complete, goes through
        success, message, _ = update(
            eng,
            _channel(),
            "fsdp-good",
            _fsdp_shards(new_weights(model_dir, 1)),
            timeout_s=60,
        )
        assert success, message
        assert_unchanged(eng, baseline)
    else:
        _good_update(eng, model_dir, baseline, f"after-partial-{layout}")


def test_a_pickled_socket_is_refused_at_once_and_generation_goes_on(
    engine, baseline, tmp_path
):
    import pickle
    import socket

    eng, model_dir, _ = engine
    address = str(tmp_path / "listener")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    listener.setblocking(False)
    channel = _channel()
    try:
        hostile = [_header("dupfd", 0), pickle.dumps([SocketFromSender(address)])]
        thread = _push_when_bound(channel, 0, [hostile], delay=0.1)
        from sglang.srt.weight_sync.delivery import ShardSender

        beside = ShardSender(channel, 1)  # rank 1's trainer delivers properly
        beside.send("dupfd", 1, {0: 0, 1: 1}, full_shards(new_weights(model_dir, 1)))
        try:
            success, message, took = update(eng, channel, "dupfd", timeout_s=20)
        finally:
            beside.close()
        thread.join(10)
        assert not success and "cannot read the shards of trainer rank 0" in message, (
            message
        )
        assert "a pickled payload is refused" in message and took < 10, (took, message)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the engine never connected
    finally:
        listener.close()
    assert generate(eng, PROMPTS) == baseline["generation"]
    _good_update(eng, model_dir, baseline, "after-dupfd")
