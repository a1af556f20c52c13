"""The per-rank channel: a trainer process's shards reach the engine rank's process intact."""

import multiprocessing as mp
import os

import pytest
import torch
from payload_samples import every_dtype_and_shape
from torch.distributed.tensor.placement_types import Shard

from sglang.srt.weight_sync.box import Box
from sglang.srt.weight_sync.delivery import DeliveryError, ShardReceiver, ShardSender
from sglang.srt.weight_sync.protocol import make_channel
from sglang.srt.weight_sync.source_layout import Holder, HoldersSpec, MeshSpec

# A fused local buffer (Megatron linear_qkv-like): rows 0:2 are q rows 2:4, rows 2:3 are k row 1.
FUSED = {
    "q": HoldersSpec(
        (4, 4),
        torch.float32,
        (Holder(5, Box((2, 0), (2, 4)), "chunk0/qkv", (0, 0), (3, 4)),),
    ),
    "k": HoldersSpec(
        (2, 4),
        torch.float32,
        (
            Holder(5, Box((1, 0), (1, 4)), "chunk0/qkv", (2, 0), (3, 4)),
            Holder(9, Box((0, 0), (1, 4)), "chunk0/qkv", (2, 0), (3, 4)),
        ),
    ),
}


def _trainer(channel, ready, done):
    sender = ShardSender(channel, engine_rank=1)
    stale = torch.zeros(2)
    sender.send(
        "old",
        5,
        {4: 0, 5: 1},
        [("w", stale, MeshSpec.full((2,), torch.float32, [4, 5]))],
    )
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100
    sender.send(
        "u1",
        5,
        {4: 0, 5: 1},
        [
            ("w", w, MeshSpec.sharded((6, 4), torch.float32, 0, [4, 5])),
            ("chunk0/qkv", torch.ones(3, 4), None),
        ],
        FUSED,
    )
    ready.set()
    done.wait(60)
    sender.close()


def test_shards_travel_between_processes_and_stale_updates_are_dropped():
    channel = make_channel()
    assert os.stat(channel).st_mode & 0o777 == 0o700
    receiver = ShardReceiver(engine_rank=1)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_trainer, args=(channel, ready, done))
    proc.start()
    try:
        payload = receiver.receive(channel, "u1", timeout_s=60)
        assert payload.trainer_rank == 5 and payload.rank_map == {4: 0, 5: 1}
        assert torch.equal(
            payload.tensors["w"],
            torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100,
        )
        assert payload.specs["w"].placements == (Shard(0),)
        assert [
            (h.rank, h.box.offsets)
            for h in payload.specs["w"].describe("w", payload.rank_map).holders
        ] == [(0, (0, 0)), (1, (3, 0))]
        assert (
            torch.equal(payload.tensors["chunk0/qkv"], torch.ones(3, 4))
            and "chunk0/qkv" not in payload.specs
        )
        assert payload.specs["q"] == FUSED["q"] and payload.specs["k"] == FUSED["k"]
        k = payload.specs["k"].describe(
            "k", payload.rank_map
        )  # rank 9 is beside no engine rank here: dropped
        assert [(h.rank, h.box, h.buffer, h.offsets) for h in k.holders] == [
            (1, Box((1, 0), (1, 4)), "chunk0/qkv", (2, 0))
        ]
    finally:
        done.set()
        proc.join(30)
        receiver.close()


def test_missing_payload_times_out_naming_rank_and_update():
    receiver = ShardReceiver(engine_rank=3)
    with pytest.raises(
        DeliveryError, match="engine rank 3: no payload for update 'u9' within 0.2s"
    ):
        receiver.receive(make_channel(), "u9", timeout_s=0.2)
    receiver.close()


def test_channel_must_be_private():
    channel = make_channel()
    os.chmod(channel, 0o755)
    with pytest.raises(DeliveryError, match="has mode 0755; it must be 0700"):
        ShardSender(channel, 0)
    os.rmdir(channel)


def test_cpu_tensors_travel_inline_in_every_dtype_and_shape():
    """CPU payloads need no shared-memory manager or authkey: bytes inline, exact, nothing
    pickled."""
    # pr: scale
    # A sender whose engine rank has not bound its segment socket yet (the first update of
    # a channel) sends inline; later ones share memory (test_shared_segment.py).
    # pr: scale end
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    sent = every_dtype_and_shape()
    sender = ShardSender(channel, engine_rank=0)
    try:
        sender.send(  # ZeroMQ's PUSH socket connects once the engine rank binds
            "u",
            0,
            {0: 0},
            [(n, t, MeshSpec.full(tuple(t.shape), t.dtype, [0])) for n, t in sent],
        )
        got = receiver.receive(channel, "u", timeout_s=30).tensors
        for name, t in sent:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        got["bf16"].add_(1)  # the engine owns its copy
    finally:
        sender.close()
        receiver.close()


def _receive_one(inline, frame: bytes, timeout_s: float) -> str:
    """Push one message with header field ``inline`` and ``frame`` into a fresh receiver's
    socket, then wait for update 'u': the ``DeliveryError`` it raises, as text."""
    import json

    import zmq

    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    receiver._socket(channel)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{os.path.join(channel, 'tp0.sock')}")
    shape, dtype, mesh, placements = MeshSpec.full((4,), torch.float32, [0]).to_wire()
    header = {
        "update_id": "u",
        "trainer_rank": 0,
        "rank_map": [[0, 0]],
        "pieces": [],
        "inline": inline,
        "meshes": [mesh],  # a layout names its mesh by index (protocol.encode_header)
        "tensors": [["w", [shape, dtype, 0, placements]]],
    }
    sock.send_multipart([json.dumps(header).encode(), frame])
    try:
        with pytest.raises(DeliveryError) as e:
            receiver.receive(channel, "u", timeout_s=timeout_s)
        return str(e.value)
    finally:
        sock.close(0)
        ctx.term()
        receiver.close()


@pytest.mark.parametrize(
    "inline,frame,problem",
    [
        (
            [["torch.float32", [4]]],
            b"\x00" * 15,
            "15 bytes for a torch.float32 tensor of shape [4] (16 bytes)",
        ),
        (
            [["torch.complex64", [1]]],
            b"\x00" * 8,
            "dtype 'torch.complex64' is not one of",
        ),
    ],
)
def test_inline_frames_that_disagree_with_their_description_are_refused(
    inline, frame, problem
):
    message = _receive_one(inline, frame, timeout_s=30)
    assert "cannot read the shards of trainer rank 0" in message
    assert problem in message


def test_a_negative_size_in_the_header_drops_the_message():
    """A header that describes a tensor of size -1 is malformed: dropped on arrival (and
    named when the update times out), never read as the awaited payload."""
    message = _receive_one([["torch.float32", [-1]]], b"", timeout_s=1)
    assert "no payload for update 'u'" in message
    assert (
        "malformed message: header field 'inline' is [['torch.float32', [-1]]]"
        in message
    )


# pr: scale
def test_a_params_payload_carries_its_fp8_regions():
    """A trainer-side payload into a block-FP8 engine: a parameter buffer, an e4m3 region
    (bytes, then scales) and a bf16 region, listed in the header; the same regions and
    bytes arrive, update after update."""
    # inline on the first update and through shared memory on the next
    from sglang.srt.weight_sync.protocol import Fp8Region, Fp8RegionKind, PayloadKind

    regions = (
        Fp8Region(
            "fp8-region/0", Fp8RegionKind.QUANTIZED, "w", (), (0, 0), (2, 4), (2, 2)
        ),
        Fp8Region(
            "fp8-region/1", Fp8RegionKind.STAGED, "w", (), (2, 0), (2, 4), (2, 2)
        ),
    )
    tensors = {
        "b": torch.arange(4, dtype=torch.bfloat16),
        "fp8-region/0": torch.arange(8 + 4 * 2, dtype=torch.uint8),
        "fp8-region/1": torch.ones(2, 4, dtype=torch.bfloat16),
    }
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    sender = ShardSender(channel, engine_rank=0)
    try:
        for update in ("u1", "u2"):
            sender.send(
                update,
                0,
                {0: 0},
                [(n, t, None) for n, t in tensors.items()],
                kind=PayloadKind.PARAMS,
                names=["w", "b"],
                fingerprint="f" * 16,
                fp8_regions=regions,
            )
            payload = receiver.receive(channel, update, timeout_s=30)
            assert payload.fp8_regions == regions
            for name, t in tensors.items():
                got = payload.tensors[name]
                assert got.dtype == t.dtype and torch.equal(got, t), (update, name)
            shared = payload.runs is not None
            sender.release()
        assert shared  # the second update came through the segment
    finally:
        sender.close()
        receiver.close()


# pr: scale end


def test_a_parameters_local_shard_is_its_own_local_tensor():
    """FSDP2 holds parameters as ``nn.Parameter`` DTensors, for which torch's ``to_local()``
    makes a new view on every call. The trainer reads the DTensor's own local tensor
    instead: the same object update after update (so what a trainer checked last update by
    identity stays checked), the same bytes, and never an autograd view."""
    from ranks import one_rank_world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from sglang.srt.weight_sync.delivery import local_shard
    from sglang.srt.weight_sync.source_layout import MeshRanks

    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        plain = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
        param = torch.nn.Parameter(
            distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
        )
        ranks = MeshRanks()
        for tensor in (plain, param):
            with torch.enable_grad():
                first, spec = local_shard(tensor, ranks=ranks)
                second, again = local_shard(tensor, ranks=ranks)
            assert first is second and again is spec
            assert first.data_ptr() == tensor.to_local().data_ptr()
            assert first.grad_fn is None
            assert torch.equal(first, tensor.to_local().detach())
        # both are laid out alike: one MeshSpec for them
        assert local_shard(plain, ranks=ranks)[1] is local_shard(param, ranks=ranks)[1]


# pr: scale
def test_prepare_shards_kept_answers_as_a_fresh_one_whatever_changed():
    """``KeptShards`` hands the last answer back only while every DTensor, its local
    tensor and its layout are the same objects: after each change below (a local tensor
    replaced as FSDP2 does, a DTensor redistributed, renamed, dropped, a plain tensor
    among them) the answer is what ``prepare_shards`` reads afresh."""
    from ranks import one_rank_world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from sglang.srt.weight_sync.source_layout import MeshRanks
    from sglang.srt.weight_sync.trainer_flow import KeptShards, prepare_shards

    def same(got, want):
        assert [n for n, _, _ in got] == [n for n, _, _ in want]
        assert all(a is b for (_, a, _), (_, b, _) in zip(got, want))
        assert [s for _, _, s in got] == [s for _, _, s in want]

    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        named = [
            (f"w{i}", distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]))
            for i in range(5)
        ]
        ranks, kept = MeshRanks(), KeptShards()
        first = prepare_shards(named, ranks, kept)
        same(first, prepare_shards(named, MeshRanks()))
        assert kept.get(named) is not None  # the same tensors: kept
        steps = [
            lambda n: setattr(n[1][1], "_local_tensor", torch.randn(4, 2)),
            lambda n: n.__setitem__(
                2, ("w2", distribute_tensor(torch.randn(4, 2), mesh, [Replicate()]))
            ),
            lambda n: n.__setitem__(0, ("renamed", n[0][1])),
            lambda n: n.pop(),
            lambda n: n.append(("plain", torch.randn(3))),
        ]
        for step in steps:
            step(named)
            assert kept.get(named) is None
            same(prepare_shards(named, ranks, kept), prepare_shards(named, MeshRanks()))
        # a plain tensor among them: nothing kept, every answer fresh
        assert kept.get(named) is None


# pr: scale end
