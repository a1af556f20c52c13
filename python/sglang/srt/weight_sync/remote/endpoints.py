"""How a trainer reaches the engines of a weight-sync group, and the engine request verl's
rollout workers hand to their engines.

``EngineEndpoint``: one engine's three control requests (join, update, leave) as the
trainer's first rank sends them: ``HttpEndpoint`` (an SGLang HTTP server) or
``LocalEndpoint`` (an ``Engine`` in this process).

verl 0.9.1's rollout workers reach their engines only through verl's
``ServerAdapter.update_weights``, which hands ``(name, tensor)`` buckets to
``sglang.srt.weight_sync.utils.update_weights`` on every rollout worker (the replica's
leader holds the engine's HTTP client). Our checkpoint engine's rollout side
(``remote.verl_checkpoint_engine``) therefore yields one **engine request** instead of weights: a
small uint8 tensor under ``ENGINE_REQUEST`` holding the engine's part of the group (JSON).
``utils.update_weights`` recognises it (``engine_request``) and the leader asks its engine
to join the group's epoch when it has not yet, then to take part in the update
(``drive_engine``): no rollout worker ever holds a weight; the engine ranks receive their
own pieces straight from the trainer ranks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional, Sequence, Tuple

import torch

from sglang.srt.weight_sync.remote.protocol import Membership

__all__ = (
    "ENGINE_REQUEST",
    "EngineEndpoint",
    "HttpEndpoint",
    "LocalEndpoint",
    "RemoteSyncError",
    "drive_engine",
    "engine_request",
    "request_tensor",
)

ENGINE_REQUEST = "__sglang_weight_sync_remote__"


class RemoteSyncError(RuntimeError):
    """A join or an update of a weight-sync group that failed; the message names the ranks
    and phases, on every trainer rank alike."""


class EngineEndpoint:
    """How the trainer's first rank reaches one engine: ``name`` (used in messages and as
    the member's name), its TP size, whether it answers, and its three control requests
    (each a dict like the HTTP routes' JSON bodies)."""

    name: str = ""

    def tp_size(self) -> int:
        raise NotImplementedError

    def alive(self, timeout_s: float) -> bool:
        """Whether the engine answers within ``timeout_s``."""
        return True

    def join(self, body: dict, timeout_s: float) -> dict:
        raise NotImplementedError

    def update(self, body: dict, timeout_s: float) -> dict:
        raise NotImplementedError

    def leave(self, body: dict, timeout_s: float) -> dict:
        raise NotImplementedError


class HttpEndpoint(EngineEndpoint):
    """An SGLang HTTP server (``http://host:port``)."""

    def __init__(self, url: str, tp_size: Optional[int] = None) -> None:
        self.url = self.name = url.rstrip("/")
        self._tp = tp_size

    def _post(self, route: str, body: dict, timeout_s: float) -> dict:
        import requests

        reply = requests.post(f"{self.url}/{route}", json=body, timeout=timeout_s)
        if reply.status_code == 404:
            raise RemoteSyncError(
                f"engine {self.url} has no /{route}: weight-sync groups with remote engines "
                "need this wheel on the servers (upstream SGLang does not serve them)"
            )
        if reply.status_code not in (200, 400):
            reply.raise_for_status()
        return reply.json()

    def tp_size(self) -> int:
        if self._tp is None:
            import requests

            info = requests.get(f"{self.url}/server_info", timeout=30).json()
            self._tp = int(info["tp_size"])
        return self._tp

    def alive(self, timeout_s: float) -> bool:
        """``/health`` answers 200 (SGLang generates one token for it: a busy engine takes
        a while, so the caller's bound applies, not a shorter one of its own)."""
        import requests

        try:
            return (
                requests.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
            )
        except requests.RequestException:
            return False

    def join(self, body: dict, timeout_s: float) -> dict:
        return self._post("join_weight_sync_group", body, timeout_s)

    def update(self, body: dict, timeout_s: float) -> dict:
        return self._post("update_weights_remote", body, timeout_s)

    def leave(self, body: dict, timeout_s: float) -> dict:
        return self._post("leave_weight_sync_group", body, timeout_s)


class LocalEndpoint(EngineEndpoint):
    """An ``sglang.Engine`` in this process (its schedulers are processes of their own)."""

    def __init__(self, engine, name: str = "local") -> None:
        self.engine, self.name = engine, name

    def tp_size(self) -> int:
        return int(self.engine.server_args.tp_size)

    def join(self, body: dict, timeout_s: float) -> dict:
        return self.engine.join_weight_sync_group(**body)

    def update(self, body: dict, timeout_s: float) -> dict:
        return self.engine.update_weights_remote(**body)

    def leave(self, body: dict, timeout_s: float) -> dict:
        return self.engine.leave_weight_sync_group(**body)


def request_tensor(
    membership: Membership,
    replica: int,
    join: bool,
    timeout_s: float,
    staging_bytes: Optional[int],
) -> Tuple[str, torch.Tensor]:
    """The ``(name, tensor)`` a rollout worker yields for engine ``replica`` of ``membership``."""
    member = membership.engines[replica]
    body = {
        "join": membership.join_request(member, timeout_s) if join else None,
        "update": dict(
            group_name=membership.group_name,
            timeout_s=timeout_s,
            staging_bytes=staging_bytes,
        ),
    }
    raw = json.dumps(body).encode()
    return ENGINE_REQUEST, torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def engine_request(params_batch: Sequence[Tuple[str, torch.Tensor]]) -> Optional[dict]:
    """The engine request a bucket carries, or None for a bucket of weights."""
    if (
        not isinstance(params_batch, (list, tuple))
        or len(params_batch) != 1
        or params_batch[0][0] != ENGINE_REQUEST
    ):
        return None
    return json.loads(bytes(params_batch[0][1].cpu().tolist()))


async def drive_engine(engine, request: dict) -> Optional[dict]:
    """On the rollout worker holding the engine's HTTP client (``engine``, verl's
    ``AsyncHttpServerAdapter``; None on the others, which do nothing): join when asked,
    then take part in the group's update. Raises with the engine's message on failure."""
    if engine is None:
        return None
    args = engine.server_args
    endpoint = HttpEndpoint(f"http://{args.host}:{args.port}")
    if request["join"] is not None:
        joined = await asyncio.to_thread(
            endpoint.join, request["join"], request["join"]["timeout_s"] * 3
        )
        if not joined.get("success"):
            raise RuntimeError(f"{endpoint.url} did not join: {joined.get('message')}")
    reply = await asyncio.to_thread(endpoint.update, request["update"], None)
    if not reply.get("success"):
        raise RuntimeError(f"{endpoint.url}: {reply.get('message')}")
    return reply
