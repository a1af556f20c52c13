"""An SGLang engine hosted by the trainer ranks that update it, through the series' entry points.

Every rank of a 1-D CPU (gloo) mesh over the trainer ranks beside one engine's TP ranks
builds a ``HostedEngine``; the first rank of each node starts the engine (``tp_size`` the
mesh's size, with its ``node_rank`` and ``nnodes``), as SGLang 0.4.7's ``VerlEngine`` did.
An update is ``trainer_flow.update_flow`` served by ``trainer_flow.drive``, each control
request answered by the host's ``update_weights_distributed`` (``Engine``'s, or
``HttpServerEngineAdapter``'s over POST /update_weights_distributed): only what the first
pull request adds, so the end-to-end and reliability cases that use it run from each pull
request's own tree. (This repository's ``VerlEngine``, ``entrypoints/verl_engine.py``, is
not part of the series; it has its own test.)
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, List, Literal, Optional, Tuple

import torch
import torch.distributed as dist
from engine import _env, weight_update_session
from torch.distributed.device_mesh import DeviceMesh

from sglang.srt.weight_sync.control_plane import ControlGroup
from sglang.srt.weight_sync.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    check_timeout,
)
from sglang.srt.weight_sync.trainer_flow import (
    ControlRequest,
    Mode,
    TrainerSync,
    UpdateReport,
    as_reply,
    drive,
    update_flow,
)

__all__ = ["HostedEngine", "engine_start_env"]

# What torchrun (torch elastic) sets in its workers: every ``tcp://`` rendezvous then uses the
# agent's store, so torch's ``_create_c10d_store`` makes a client on every rank.
AGENT_STORE_FLAG = "TORCHELASTIC_USE_AGENT_STORE"
# Read by ``Engine`` at launch: "0" keeps an engine on a node past the first from blocking in
# its constructor (a Python API caller, not a server).
BLOCK_CHILDREN = "SGLANG_BLOCK_NONZERO_RANK_CHILDREN"

Backend = Literal["engine", "server"]


def engine_start_env() -> ContextManager[None]:
    """This process's environment while a trainer rank starts an engine, as it is afterwards.

    Without torchrun's agent-store flag: the engine's processes rendezvous on SGLang's own
    port, where with the flag no rank starts the store's server, and even a TP-1 engine hangs
    at startup (the trainer keeps the flag). With ``BLOCK_CHILDREN`` "0", so that the engine
    of a node past the first returns to its caller.
    """
    return _env({AGENT_STORE_FLAG: None, BLOCK_CHILDREN: "0"})


class HostedEngine:
    """An engine over the trainer ranks of ``mesh``, started on the first rank of each node.

    Every rank of the mesh calls every method together (SPMD). ``engine_kwargs`` are the
    engine's arguments (``Engine``'s, or ``HttpServerEngineAdapter``'s for
    ``backend="server"``, hosted by the mesh's first rank only); the ``weight_sync_*`` ones
    are the update's (``trainer_flow.update_flow``): where resharding runs, the cap on the
    trainer side's staging and buffers, the bound on every wait. Named as ``VerlEngine``'s
    (``weight_sync_bucket_bytes``...), so that a case passes the same arguments to either.
    ``session``: each request in a weight-update session of its own
    (``begin_weight_update``/``end_weight_update``), which SGLang 0.5.23 requires of every
    update; False opens none, as ``VerlEngine`` does, for the scheduler's one-shot session
    (the second pull request's ``weight_sync.sessions``).
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        nnodes: int = 1,
        backend: Backend = "engine",
        weight_sync_mode: Mode = "auto",
        weight_sync_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S,
        session: bool = True,
        # pr: remote
        weight_sync_delta: bool = False,
        # pr: remote end
        **engine_kwargs: Any,
    ) -> None:
        if backend not in ("engine", "server"):
            raise ValueError(f"backend={backend!r}: 'engine' or 'server'")
        self._group = mesh.get_group()
        self._ranks = [int(r) for r in mesh.mesh.tolist()]
        self._mode, self._bucket_bytes = weight_sync_mode, weight_sync_bucket_bytes
        self._timeout_s = check_timeout(weight_sync_timeout_s)
        self._session = session
        self._control = ControlGroup(self._group, "hosted-engine")
        self._sync = TrainerSync()
        # pr: remote
        if weight_sync_delta:  # the trainer-side hop sends only what changed
            from sglang.srt.weight_sync.reshard_delta import ReshardDelta

            self._sync.delta = ReshardDelta(digest=True)
        # pr: remote end
        tp_rank, per_node = mesh.get_local_rank(), mesh.size() // nnodes
        args = dict(
            engine_kwargs,
            tp_size=mesh.size(),
            node_rank=tp_rank // per_node,
            nnodes=nnodes,
        )
        self._engine = None
        if backend == "engine" and tp_rank % per_node == 0:
            from sglang.srt.entrypoints.engine import Engine

            with engine_start_env():
                self._engine = Engine(**args)
        elif backend == "server" and tp_rank == 0:
            from sglang.srt.entrypoints.http_server_engine import (
                HttpServerEngineAdapter,
            )

            with engine_start_env():
                self._engine = HttpServerEngineAdapter(**args)
        self._control.barrier(None, self._waiting("starting the engine"))

    @property
    def engine(self) -> Optional[Any]:
        """The engine this rank hosts (``Engine`` or ``HttpServerEngineAdapter``); None elsewhere."""
        return self._engine

    @property
    def sync(self) -> TrainerSync:
        """This rank's channels to the engine (and plans), kept between updates."""
        return self._sync

    def update(self, named_tensors: List[Tuple[str, torch.Tensor]]) -> UpdateReport:
        """Update the engine from ``named_tensors`` (DTensors: their local shards; plain
        tensors: full on every rank), the same names on every rank: ``update_flow``'s
        control requests served by the engine's ``update_weights_distributed``. Returns
        this rank's report; raises ``RuntimeError`` on every rank if the engine refused the
        update."""
        flow = update_flow(
            self._sync,
            named_tensors,
            self._ranks,
            self._group,
            self._mode,
            self._bucket_bytes,
            self._timeout_s,
        )
        report = drive(
            flow, self._ranks, self._group, self._serve, timeout_s=self._timeout_s
        )
        if not report.success:
            raise RuntimeError(
                f"weight update {report.update_id} failed: {report.message}"
            )
        return report

    def _serve(self, request: ControlRequest) -> Tuple[bool, str]:
        opened = (
            weight_update_session(self._engine)
            if self._session
            else contextlib.nullcontext()
        )
        with opened:
            result = self._engine.update_weights_distributed(
                request.update_id,
                request.channel,
                flush_cache=request.final,
                timeout_s=self._timeout_s,
            )
        return as_reply(result, request)

    def generate(self, **request: Any) -> Any:
        """``generate(**request)`` on the mesh's first rank; its output on every rank."""
        return self.call("generate", **request)

    def call(self, method: str, **kwargs: Any) -> Any:
        """The engine's ``method(**kwargs)`` on the mesh's first rank (``flush_cache``,
        ``release_memory_occupation``...); every rank waits for it and returns its (small,
        picklable) result. Work of unknown length: bounded by the mesh group's own timeout."""
        result = None
        if dist.get_rank() == self._ranks[0]:
            result = getattr(self._engine, method)(**kwargs)
        return self._control.broadcast_object(
            result, self._ranks[0], None, self._waiting(method)
        )

    def shutdown(self) -> None:
        """Close this rank's channels; shut the engine down where this rank hosts it."""
        self._sync.close()
        if self._engine is not None:
            self._engine.shutdown()

    def _waiting(self, what: str) -> str:
        return f"trainer rank {dist.get_rank()}: waiting for rank {self._ranks[0]} ({what})"
