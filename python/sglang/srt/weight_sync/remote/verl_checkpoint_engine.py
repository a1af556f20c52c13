"""verl 0.9.1's checkpoint engine ``sglang_remote``: trainer ranks send their own shards
straight to the remote SGLang engines' ranks, through a weight-sync group.

verl imports this module on every worker when ``checkpoint_engine.custom_backend_module``
names it, which registers the backend; ``checkpoint_engine.backend=sglang_remote`` then
selects it with no verl patch (``docs/frameworks/verl.md``). verl's
``CheckpointEngineManager`` calls, every update, ``prepare`` on every actor and rollout
worker, ``build_topology`` with what they returned, ``init_process_group`` with its
answer, then ``send_weights`` (actors) and ``CheckpointEngineWorker.update_weights``
(rollout workers, which call ``receive_weights`` and hand the result to verl's
``ServerAdapter.update_weights``), then ``finalize``.

* The group's members are the actor ranks (trainer ranks ``0..N-1``) and the SGLang
  engines' TP ranks (replica ``i`` at ``N + i * tp``), not the rollout workers: no rollout
  worker ever holds a weight. ``build_topology`` places them and keeps the membership
  epoch while the replicas and the group stay the same (a new epoch after a failed update
  or when replicas change); ``init_process_group`` only records it.
* ``send_weights`` (every actor rank, verl's ``(name, tensor)`` generator: DTensors with
  the companion producer patch, ``integrations/verl``, else full tensors) joins the epoch
  when it is new and runs the update (``RemoteSync``, ``drive=False``); it returns verl's
  metrics (bytes each actor rank sent, the update's seconds).
* ``receive_weights`` (every rollout worker) yields one engine request
  (``remote.endpoints.request_tensor``); verl's ``ServerAdapter.update_weights`` hands it
  to ``sglang.srt.weight_sync.utils.update_weights``, whose replica leader asks its server
  to join (once per epoch) and to take part in the update; the engine ranks receive their
  own pieces while serving and write them in a short pause.
* The group persists across updates: ``finalize`` keeps it.

``engine_kwargs`` (``checkpoint_engine.engine_kwargs.sglang_remote``): ``rollout_tp`` (the
replicas' TP size, required), ``group_name``, ``timeout_s``, ``staging_bytes``, ``port``
(the group's store port on actor rank 0; default: a free one), ``backend``, ``delta``
(send only what changed since the last update, ``RemoteSync(delta=True)``; default off)
and ``digest_every`` (how often the engines check what they hold, with ``delta``).
"""

from __future__ import annotations

import logging
import socket
from typing import Dict, List, Optional

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from sglang.srt.weight_sync.protocol import DEFAULT_TIMEOUT_S
from sglang.srt.weight_sync.remote.endpoints import request_tensor
from sglang.srt.weight_sync.remote.protocol import Membership
from sglang.srt.weight_sync.remote.rendezvous import free_port
from sglang.srt.weight_sync.remote.trainer import RemoteSync

__all__ = ("BACKEND", "SGLangRemoteCheckpointEngine")

BACKEND = "sglang_remote"

logger = logging.getLogger(__name__)


@CheckpointEngineRegistry.register(BACKEND)
class SGLangRemoteCheckpointEngine(CheckpointEngine):
    """See the module's text. Actor workers are made with ``is_master`` (verl passes it to
    actors only); rollout workers without it."""

    def __init__(
        self,
        bucket_size: int,
        is_master: Optional[bool] = None,
        rollout_tp: int = 1,
        group_name: str = "verl",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        staging_bytes: Optional[int] = None,
        port: Optional[int] = None,
        backend: Optional[str] = None,
        delta: bool = False,
        digest_every: int = 8,
    ) -> None:
        self.bucket_size = max(int(bucket_size), 1 << 20)
        self.actor = is_master is not None
        self.is_master = bool(is_master)
        self.rollout_tp = int(rollout_tp)
        self.group_name, self.timeout_s = group_name, timeout_s
        self.staging_bytes, self.port, self.backend = staging_bytes, port, backend
        self.delta, self.digest_every = bool(delta), int(digest_every)
        self.sync: Optional[RemoteSync] = None
        self.membership: Optional[Membership] = None
        self.joined_epoch = -1  # rollout side: the epoch this worker's engine joined
        self.rank = -1

    # ------------------------------------------------------------ topology

    def prepare(self) -> Dict:
        """Actor rank 0: where the group meets and its current epoch (and whether the last
        update broke it); everyone else: its role."""
        if not self.actor:
            return {"role": "rollout", "tp": self.rollout_tp}
        if not self.is_master:
            return {"role": "actor"}
        if self.port is None:
            self.port = free_port()
        sync = self.sync
        return {
            "role": "actor",
            "group": self.group_name,
            "address": socket.gethostbyname(socket.gethostname()),
            "port": self.port,
            "epoch": sync.epoch if sync is not None else 0,
            "healthy": sync is not None and sync.group is not None and not sync.broken,
            "members": self.membership.to_json().decode() if self.membership else None,
            "backend": self.backend
            or ("nccl" if torch.cuda.is_available() else "gloo"),
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: List[Dict]
    ):
        """The epoch's membership, the same for every worker: the actor ranks first, then
        each rollout replica's engine ranks. The epoch stays while the group is healthy and
        its members are the same; else it is the next one."""
        master = metadata[0]
        tp = metadata[actor_wg_world_size]["tp"] if rollout_world_size else 1
        if rollout_world_size % tp:
            raise ValueError(
                f"{rollout_world_size} rollout workers are not replicas of TP {tp}"
            )
        engines = [(f"replica{i}", tp) for i in range(rollout_world_size // tp)]

        def at(epoch: int) -> Membership:
            return Membership.of(
                master["group"],
                epoch,
                master["address"],
                master["port"],
                master["backend"],
                actor_wg_world_size,
                engines,
            )

        membership = at(master["epoch"])
        previous = master["members"]
        same = (
            previous is not None
            and Membership.from_json(previous.encode()) == membership
        )
        if not (same and master["healthy"]):
            membership = at(master["epoch"] + 1)
        wire = membership.to_json().decode()
        return (
            {
                "membership": [wire] * actor_wg_world_size,
                "rank": list(range(actor_wg_world_size)),
            },
            {
                "membership": [wire] * rollout_world_size,
                "rank": list(range(rollout_world_size)),
            },
        )

    def init_process_group(self, membership: str, rank: int) -> None:
        """Record the epoch; the group meets in ``send_weights``/``receive_weights``, which
        verl runs on both sides together (here each side would wait for the other)."""
        self.membership = Membership.from_json(membership.encode())
        self.rank = rank

    def finalize(self) -> None:
        """The group persists across updates."""

    # ------------------------------------------------------------ an update

    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """Every actor rank: join the epoch when it is new, then send this rank's regions."""
        m = self.membership
        if self.sync is None:
            self.sync = RemoteSync(
                m.group_name,
                m.address,
                m.port,
                backend=m.backend,
                timeout_s=self.timeout_s,
                delta=self.delta,
                digest_every=self.digest_every,
            )
        if self.sync.group is None or self.sync.broken or self.sync.epoch != m.epoch:
            self.sync.join(membership=m)
        named = [(n, t) async for n, t in _pairs(weights)]
        report = self.sync.update(
            named,
            bucket_bytes=self.bucket_size,
            staging_bytes=self.staging_bytes,
            drive=False,
        )
        if not report.success:
            raise RuntimeError(f"weight sync step {global_steps}: {report.message}")
        metrics = {
            "weight_sync/seconds": report.seconds,
            "weight_sync/bytes_sent_max": max(report.bytes_sent),
            "weight_sync/bytes_sent_min": min(report.bytes_sent),
        }
        if report.delta:
            metrics["weight_sync/delta"] = float(report.delta["mode"] == "delta")
            metrics["weight_sync/density"] = report.delta["density"]
        return metrics

    def receive_weights(self, global_steps: Optional[int] = None):
        """Every rollout worker: one engine request for its replica's engine (joining the
        epoch first when the engine has not), no weights."""
        m = self.membership
        join = self.joined_epoch != m.epoch
        self.joined_epoch = m.epoch
        yield request_tensor(
            m, self.rank // self.rollout_tp, join, self.timeout_s, self.staging_bytes
        )


async def _pairs(weights):
    """verl's weights, a generator or an async generator of (name, tensor)."""
    if hasattr(weights, "__aiter__"):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair
