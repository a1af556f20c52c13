"""Payload headers at the size of real MoE models: within the engine's bound, through a real
channel, and a header over the bound refused at once with the size, the bound and why.

The tensors are the HF checkpoints' own (names and shapes from ``transformers``' classes
built on the meta device, so no data): Qwen3-30B-A3B (18,432 expert tensors), DeepSeek-V3
(44,544) and Kimi-K2 (69,120). The old fixed bound (1 MiB) refused each of them.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
from real_moe_configs import REAL_MOE, checkpoint_shapes

from sglang.srt.weight_sync.delivery import ShardReceiver, ShardSender
from sglang.srt.weight_sync.protocol import (
    HEADER_BYTES,
    HEADER_BYTES_PER_TENSOR,
    DeliveryError,
    HeaderBound,
    PayloadKind,
    decode_header,
    encode_header,
    make_channel,
)
from sglang.srt.weight_sync.remote.protocol import (
    HEADER_LIMIT,
    LAYOUT_LIMIT,
    UpdateHeader,
    layout_wire,
    read_layout,
)
from sglang.srt.weight_sync.source_layout import MeshSpec

TRAINERS = 256  # FSDP over 256 ranks: every tensor's mesh lists them all


@functools.lru_cache(maxsize=None)
def _shapes(model: str):
    return checkpoint_shapes(model)


def _trainer_header(shapes, update_id: str = "u") -> bytes:
    """Trainer rank 0's header: every tensor FSDP ``Shard(0)`` over ``TRAINERS`` ranks,
    its bytes in a shared-memory segment, as ``ShardSender`` writes it for CPU shards."""
    mesh = list(range(TRAINERS))
    tensors, placed, offset = [], [], 0
    for name, shape in shapes.items():
        spec = MeshSpec.sharded(shape, torch.float32, 0, mesh)
        local = [-(-shape[0] // TRAINERS), *shape[1:]]
        tensors.append((name, spec.to_wire()))
        placed.append(("torch.bfloat16", local, offset))
        offset += 2 * max(1, int(torch.tensor(local).prod()))
    return encode_header(
        update_id,
        0,
        {r: r % 8 for r in range(TRAINERS)},
        tensors,
        [],
        PayloadKind.SHARDS,
        [],
        "f" * 16,
        None,
        ("s" * 32, placed),
    )


@pytest.mark.parametrize("model", sorted(REAL_MOE))
def test_real_moe_headers_fit_the_engines_bound(model):
    shapes = _shapes(model)
    assert len(shapes) >= REAL_MOE[model].expert_tensors
    raw = _trainer_header(shapes)
    bound = HeaderBound(len(shapes))
    assert HEADER_BYTES < len(raw) <= bound.bytes, (model, len(raw), str(bound))
    # a fourfold margin over a real entry, mesh and shared-memory placement included
    assert len(raw) / len(shapes) * 4 < HEADER_BYTES_PER_TENSOR, len(raw) / len(shapes)
    assert len(json.loads(raw)["meshes"]) == 1  # the 256-rank mesh is written once
    header = decode_header([raw], bound)
    assert [n for n, _ in header["tensors"]] == list(shapes)
    name, wire = header["tensors"][-1]
    spec = MeshSpec.from_wire(wire)
    assert spec.shape == shapes[name] and list(spec.mesh) == list(range(TRAINERS))


def _sender(channel: str, shapes, update_id: str) -> ShardSender:
    """A trainer rank that sends one element of each tensor (metadata-sized shards)."""
    sender = ShardSender(channel, engine_rank=0)
    mesh = list(range(TRAINERS))
    sender.send(
        update_id,
        0,
        {0: 0},
        [
            (n, torch.full((1,), float(i)), MeshSpec.sharded(s, torch.float32, 0, mesh))
            for i, (n, s) in enumerate(shapes.items())
        ],
    )
    return sender


def test_a_kimi_k2_sized_payload_travels_through_the_channel():
    shapes = _shapes("kimi-k2")
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    sender = _sender(channel, shapes, "k2")
    try:
        payload = receiver.receive(channel, "k2", 120, HeaderBound(len(shapes)))
        assert list(payload.tensors) == list(shapes)
        last = len(shapes) - 1
        assert payload.tensors[list(shapes)[last]].item() == float(last)
        assert all(payload.specs[n].shape == s for n, s in shapes.items())
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("known", [100, 0])
def test_a_header_over_the_bound_is_refused_at_once(known):
    """Qwen3-30B-A3B's payload sent to an engine whose model has ``known`` tensors (0: not
    known yet): refused in well under the update's timeout, naming size, bound and why."""
    shapes = _shapes("qwen3-30b-a3b")
    channel, receiver = make_channel(), ShardReceiver(engine_rank=0)
    sender = _sender(channel, shapes, "big")
    start = time.monotonic()
    try:
        with pytest.raises(DeliveryError) as e:
            receiver.receive(channel, "big", 120, HeaderBound(known))
        assert time.monotonic() - start < 30
    finally:
        sender.close()
        receiver.close()
    text = str(e.value)
    # the layout frame is the part of a header that grows with the model (LayoutFrames)
    size = int(text.split("a payload header's layout frame of ")[1].split()[0])
    assert size > HeaderBound(known).bytes
    assert text.startswith("engine rank 0: a message on channel")
    assert f"reads at most {HeaderBound(known).bytes} bytes" in text
    assert "describes at most the model's tensors" in text
    if known:
        assert f"{HEADER_BYTES_PER_TENSOR} for each of the {known} tensors" in text
    else:
        assert "its model's tensors are not known" in text


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2"])
def test_the_remote_groups_descriptions_at_real_moe_sizes(model):
    """The weight-sync group describes an update by a small header broadcast to every
    member and the trainer's source layout (every tensor's spec): both read back within
    their bounds at a real MoE model's tensor count, FSDP over 256 ranks."""
    shapes = _shapes(model)
    mesh = list(range(TRAINERS))
    specs = {n: MeshSpec.sharded(s, torch.float32, 0, mesh) for n, s in shapes.items()}
    raw = layout_wire(specs)
    assert len(raw) <= LAYOUT_LIMIT
    assert read_layout(raw) == specs
    header = UpdateHeader("u", "d" * 64, len(raw), 64 << 20, len(specs)).encode()
    assert len(header) <= HEADER_LIMIT
    assert UpdateHeader.decode(header).tensors == len(shapes)
