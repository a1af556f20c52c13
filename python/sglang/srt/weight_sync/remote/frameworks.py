"""Glue between the RL frameworks' own update paths and a weight-sync group with remote engines.

* verl 0.9.1: ``remote.verl_checkpoint_engine`` registers the ``sglang_remote`` checkpoint
  engine (its rollout side hands the engines ``remote.endpoints``' engine requests).
* AReaL 1.0.4 (``integrations/areal``): ``areal_sync`` makes the ``RemoteSync`` of an
  ``FSDPEngine`` from its rollout client's server addresses (the first rank's) and its
  weight-update meta.
* slime (``integrations/slime``): ``slime_remote_sync`` makes and joins the ``RemoteSync`` of
  its distributed updater (its colocated updater's glue is ``slime_sync``, outside this
  package: it needs no remote engine).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang.srt.weight_sync.protocol import DEFAULT_TIMEOUT_S
from sglang.srt.weight_sync.remote.endpoints import HttpEndpoint
from sglang.srt.weight_sync.remote.trainer import RemoteSync

__all__ = ("areal_sync", "slime_remote_sync")


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


def slime_remote_sync(
    group_name: str,
    engine_urls: Sequence[Optional[str]],
    address: str,
    sync: Optional[RemoteSync] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RemoteSync:
    """The joined ``RemoteSync`` of a slime trainer; every trainer rank calls it. Rank 0's
    ``engine_urls`` (slime's ``SGLangEngine.get_url()``; None for node ranks other than 0, skipped)
    and ``address`` (its node's IP) count; it picks the group's port and every rank hears both.
    With ``sync`` (slime reconnecting engines) the engines join that group's next epoch."""
    import torch.distributed as dist

    from sglang.srt.weight_sync.control_plane import ControlGroup
    from sglang.srt.weight_sync.remote.rendezvous import free_port

    endpoints = [HttpEndpoint(u) for u in engine_urls if u]
    if sync is not None:
        sync.join(endpoints)
        return sync
    mine = (address, free_port()) if dist.get_rank() == 0 else None
    address, port = ControlGroup(None, f"slime-{group_name}").broadcast_object(
        mine,
        0,
        timeout_s,
        f"trainer rank {dist.get_rank()}: hearing where the weight-sync group meets",
    )
    sync = RemoteSync(group_name, address, port, engines=endpoints, timeout_s=timeout_s)
    sync.join()
    return sync
