"""Deliver: each trainer rank hands only its own shards to the engine rank beside it.

The channel is a private directory (mode 0700) holding one ZeroMQ ``ipc://``
socket per engine TP rank. A trainer rank PUSHes one message: the update id,
which trainer rank it is, the map from trainer ranks to engine ranks, and its
local shards, each with the ``MeshSpec`` its layout derives from. Tensors go
through SGLang's ``MultiprocessingSerializer``: CUDA IPC handles on GPU, shared
memory on CPU, so no payload bytes are copied or gathered anywhere. The
engine's control request carries the update id only.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import zmq

from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.source_layout import MeshSpec

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


class DeliveryError(RuntimeError):
    """A payload that did not arrive, arrived late, or is malformed."""


def make_channel() -> str:
    """A new private channel directory (owner-only), for one trainer/engine pairing."""
    return tempfile.mkdtemp(prefix="sglang-weights-")


def _endpoint(channel: str, engine_rank: int) -> str:
    return f"ipc://{os.path.join(channel, f'tp{engine_rank}.sock')}"


def _check_private(channel: str) -> None:
    st = os.stat(channel)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DeliveryError(f"channel {channel!r} must be a directory owned by this user with mode 0700")


@dataclass
class Payload:
    """What one engine rank received. ``kind`` "shards": the trainer shards beside it and
    their layouts (engine-side resharding); "params": parameter-shaped buffers already in
    this rank's layout (trainer-side), carrying the HF ``names`` they were filled from and
    the manifest ``fingerprint`` they were planned against; "describe": a request to
    publish the engine's manifest (``manifest.py``)."""

    update_id: str
    trainer_rank: int
    rank_map: Dict[int, int]
    tensors: Dict[str, torch.Tensor]
    specs: Dict[str, MeshSpec]
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


class ShardSender:
    """Trainer side: one PUSH socket to one engine rank. Keeps the last shards alive
    until the next send or ``close()``, since the engine maps their memory."""

    def __init__(self, channel: str, engine_rank: int) -> None:
        _check_private(channel)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(_endpoint(channel, engine_rank))
        self._alive: List[torch.Tensor] = []

    def send(
        self,
        update_id: str,
        trainer_rank: int,
        rank_map: Mapping[int, int],
        shards: Sequence[Tuple[str, torch.Tensor, MeshSpec]],
    ) -> None:
        self._alive = [t for _, t, _ in shards]
        message = {
            "update_id": update_id,
            "trainer_rank": int(trainer_rank),
            "rank_map": {int(k): int(v) for k, v in rank_map.items()},
            "tensors": [(name, t.detach(), spec.to_wire()) for name, t, spec in shards],
        }
        self._sock.send(MultiprocessingSerializer.serialize(message))

    def send_params(
        self, update_id: str, trainer_rank: int, params: Mapping[str, torch.Tensor], names: Sequence[str], fingerprint: str
    ) -> None:
        """Parameter-shaped buffers for the engine rank, filled from the HF tensors ``names``."""
        self._alive = list(params.values())
        message = {
            "update_id": update_id, "kind": "params", "trainer_rank": int(trainer_rank), "rank_map": {},
            "params": [(name, t.detach()) for name, t in params.items()],
            "names": list(names), "fingerprint": fingerprint,
        }
        self._sock.send(MultiprocessingSerializer.serialize(message))

    def describe(self, update_id: str, trainer_rank: int) -> None:
        """Ask the engine rank to publish its manifest into the channel."""
        message = {"update_id": update_id, "kind": "describe", "trainer_rank": int(trainer_rank), "rank_map": {}}
        self._sock.send(MultiprocessingSerializer.serialize(message))

    def close(self) -> None:
        self._alive = []
        self._sock.close()
        self._ctx.term()


class ShardReceiver:
    """Engine side: a PULL socket per channel for this engine rank, bound on first use."""

    def __init__(self, engine_rank: int) -> None:
        self.engine_rank = engine_rank
        self._ctx = zmq.Context()
        self._socks: Dict[str, zmq.Socket] = {}

    def _socket(self, channel: str) -> zmq.Socket:
        if channel not in self._socks:
            _check_private(channel)
            sock = self._ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(_endpoint(channel, self.engine_rank))
            self._socks[channel] = sock
        return self._socks[channel]

    def receive(self, channel: str, update_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Payload:
        """This rank's payload for ``update_id``; payloads of other updates are dropped."""
        sock = self._socket(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms):
                raise DeliveryError(
                    f"engine rank {self.engine_rank}: no payload for update {update_id!r} within {timeout_s:g}s"
                )
            message = MultiprocessingSerializer.deserialize(sock.recv())
            if message.get("update_id") == update_id:
                return _payload(message, self.engine_rank)
            logger.warning(
                "engine rank %d: dropping a payload of update %r while waiting for %r",
                self.engine_rank, message.get("update_id"), update_id,
            )

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._ctx.term()


def _payload(message: dict, engine_rank: int) -> Payload:
    kind = message.get("kind", "shards")
    tensors, specs = {}, {}
    for item in message.get("tensors", ()) if kind == "shards" else message.get("params", ()):
        name, tensor = item[0], item[1]
        if name in tensors:
            raise DeliveryError(f"engine rank {engine_rank}: tensor {name!r} delivered twice")
        tensors[name] = tensor
        if kind == "shards":
            specs[name] = MeshSpec.from_wire(item[2])
    if kind not in ("shards", "params", "describe"):
        raise DeliveryError(f"engine rank {engine_rank}: unknown payload kind {kind!r}")
    return Payload(message["update_id"], message["trainer_rank"], dict(message["rank_map"]), tensors, specs,
                   kind, tuple(message.get("names", ())), message.get("fingerprint", ""))
