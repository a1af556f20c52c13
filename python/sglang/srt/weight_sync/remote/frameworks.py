"""Glue between the RL frameworks' own update paths and a weight-sync group with remote engines.

* verl 0.9.1: ``remote.verl_checkpoint_engine`` registers the ``sglang_remote`` checkpoint
  engine (its rollout side hands the engines ``remote.endpoints``' engine requests).
* AReaL 1.0.4 (``integrations/areal``): ``areal_sync`` makes the ``RemoteSync`` of an
  ``FSDPEngine`` from its rollout client's server addresses (the first rank's) and its
  weight-update meta.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.weight_sync.remote.endpoints import HttpEndpoint
from sglang.srt.weight_sync.remote.trainer import RemoteSync

__all__ = ("areal_sync",)


def areal_sync(
    rollout_engine, meta, timeout_s: float = 120.0, delta: Optional[bool] = None
) -> RemoteSync:
    """The ``RemoteSync`` of an AReaL trainer (every trainer rank calls it): the group meets
    at the first rank's ``meta.nccl_master_address``/``nccl_master_port``, heard by every
    rank; its engines are the first rank's rollout client's servers. Joins them. ``delta``
    (default: ``AREAL_SGLANG_WEIGHT_SYNC_DELTA=1`` in the environment, beside the patch's
    own switch): send only what changed since the last update."""
    import os

    import torch.distributed as dist

    from sglang.srt.weight_sync.control_plane import ControlGroup

    mine = None
    if dist.get_rank() == 0:
        client = getattr(rollout_engine, "_engine", rollout_engine)
        mine = (
            meta.nccl_master_address,
            int(meta.nccl_master_port),
            list(client.addresses),
        )
    address, port, servers = ControlGroup(None, "areal-weight-sync").broadcast_object(
        mine,
        0,
        timeout_s,
        f"trainer rank {dist.get_rank()}: hearing where the group meets",
    )
    sync = RemoteSync(
        meta.nccl_group_name or "areal",
        address,
        port,
        engines=[HttpEndpoint(f"http://{s}") for s in servers],
        timeout_s=timeout_s,
        delta=(
            os.environ.get("AREAL_SGLANG_WEIGHT_SYNC_DELTA") == "1"
            if delta is None
            else delta
        ),
    )
    sync.join()
    return sync
