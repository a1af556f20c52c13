"""AReaL 1.0.4's released SGLang client as its trainer's rank 0 drives it, for the tests
that run AReaL's own code (``test/e2e/test_areal_release.py``, ``areal_remote_cases.py``).

* ``areal_client``: ``RemoteSGLangEngine`` on one server, its name records in a folder.
* ``join_broadcast_group``: ``FSDPEngine._init_weight_update_from_distributed`` on rank 0:
  the server joins AReaL's ``update_weight_group`` (``/init_weights_update_group``) while
  rank 0 creates its end (gloo here); returns the update's meta and the group.
"""

from __future__ import annotations

from typing import Any, Tuple

__all__ = ["areal_client", "join_broadcast_group"]

GROUP_NAME = "update_weight_group"


def areal_client(address: str, name_resolve_root: str, fileroot: str, trial: str):
    """AReaL's ``RemoteSGLangEngine`` initialized on the server at ``address`` (host:port)."""
    from areal.api.cli_args import InferenceEngineConfig, NameResolveConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve

    name_resolve.reconfigure(
        NameResolveConfig(type="nfs", nfs_record_root=name_resolve_root)
    )
    client = RemoteSGLangEngine(
        InferenceEngineConfig(
            experiment_name="weight-sync",
            trial_name=trial,
            fileroot=fileroot,
            backend="sglang:d1t1",
        )
    )
    client.initialize(addr=[address])
    return client


def join_broadcast_group(client, port: int) -> Tuple[Any, Any]:
    """The server and rank 0 join AReaL's broadcast group on ``port``: (meta, group)."""
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.core.distributed import init_custom_process_group

    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation.from_str("sglang:d1t1"),
        nccl_master_address="127.0.0.1",
        nccl_master_port=port,
        nccl_group_name=GROUP_NAME,
    )
    joined = client.init_weights_update_group(meta)
    group = init_custom_process_group(
        backend="gloo",
        world_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        group_name=GROUP_NAME,
    )
    joined.result()
    return meta, group
