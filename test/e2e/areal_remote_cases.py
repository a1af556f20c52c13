"""What each trainer rank does in the AReaL side-by-side test (``test_areal_remote``).

Two FSDP2 fp32 trainer ranks and a TP-1 SGLang HTTP server (a process tree of its own),
reached through AReaL 1.0.4's own ``RemoteSGLangEngine`` client (the first rank's). First
AReaL's released ``xccl`` path: every rank takes part in ``full_tensor()`` (what
``FSDPEngine._update_weights_from_distributed`` runs), then the first rank broadcasts each
tensor into the group ``init_weights_update_group`` made (AReaL's own
``init_custom_process_group``), as the existing AReaL test does. Then the companion patch's
path: ``FSDPEngine._init_weight_update_from_distributed`` and
``_update_weights_from_distributed`` compiled from AReaL's file with
``integrations/areal/0001-fsdp-weight-sync-group.patch`` applied, run with
``AREAL_SGLANG_WEIGHT_SYNC=1`` on a stand-in ``self`` (the FSDP2 model, the client, AReaL's
own ``_get_model_name_parameters``): every rank sends its own shard.
"""

from __future__ import annotations

import ast
import os
import time

import torch
import torch.distributed as dist

METHODS = (
    "_init_weight_update_from_distributed",
    "_update_weights_from_distributed",
    "_get_model_name_parameters",
)


def fsdp_engine_methods(source: str) -> dict:
    """The methods ``METHODS`` of AReaL's ``FSDPEngine`` from ``source`` (its file, patched),
    compiled as they are (decorators left out: AReaL's tracing), with the module-level
    names they use here."""
    from typing import Iterator

    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils.network import find_free_ports, gethostip

    cls = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "FSDPEngine"
    )
    defs = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in METHODS:
            node.decorator_list = []
            defs.append(node)
    module = ast.Module(
        body=[ast.ImportFrom("__future__", [ast.alias("annotations")], 0)] + defs,
        type_ignores=[],
    )
    scope = dict(
        os=os,
        gethostip=gethostip,
        find_free_ports=find_free_ports,
        WeightUpdateMeta=WeightUpdateMeta,
        Iterator=Iterator,
        nn=torch.nn,
    )
    exec(
        compile(
            ast.fix_missing_locations(module), "areal/engine/fsdp_engine.py", "exec"
        ),
        scope,
    )
    return {name: scope[name] for name in METHODS}


class StandIn:
    """What the methods read of ``self``: the model, its kind, the rollout client."""

    def __init__(self, model, rollout_engine, methods):
        self.model, self.rollout_engine = model, rollout_engine
        self.is_vision_model = False
        self._methods = methods

    def __getattr__(self, name):
        if name in self.__dict__.get("_methods", {}):
            return self._methods[name].__get__(self)
        raise AttributeError(name)


def areal_side_by_side_job(rank: int, world: int, job: dict) -> dict:
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import ParamSpec, WeightUpdateMeta
    from areal_client import areal_client, join_broadcast_group
    from ranks import gathers_allowed
    from remote_cases import fsdp2_model, server_state

    address = job["url"].removeprefix("http://")
    client = None
    if rank == 0:
        client = areal_client(
            address, job["name_resolve"], job["fileroot"], "areal-remote"
        )
    out = {}

    def fsdp_model(seed):
        return fsdp2_model(job["model_dir"], seed, world)

    # AReaL as released: full_tensor() on every rank, broadcast from the first
    model = fsdp_model(job["broadcast_seed"])
    started = time.monotonic()
    with gathers_allowed():
        full = [
            (n, p.full_tensor().to(torch.bfloat16)) for n, p in model.named_parameters()
        ]
    gather_s = time.monotonic() - started
    if rank == 0:
        meta, group = join_broadcast_group(client, job["broadcast_port"])
        started = time.monotonic()
        specs = [
            ParamSpec(name=n, shape=tuple(t.shape), dtype="bfloat16") for n, t in full
        ]
        applied = client.update_weights_from_distributed(meta, specs)
        for _, tensor in full:
            dist.broadcast(tensor, src=0, group=group)
        applied.result()
        out["broadcast"] = dict(
            gather_s=gather_s,
            update_s=time.monotonic() - started,
            bytes=sum(t.numel() * t.element_size() for _, t in full),
            state=server_state([job["url"]], job["prompts"][job["broadcast_seed"]]),
        )
    dist.barrier()

    # with the companion patch: every rank sends its own shard; with its delta switch,
    # the first update of the group is full and the next ones send what changed
    os.environ["AREAL_SGLANG_WEIGHT_SYNC"] = "1"
    os.environ["AREAL_SGLANG_WEIGHT_SYNC_DELTA"] = "1" if job.get("delta") else "0"
    self = StandIn(fsdp_model(job["seed"]), client, fsdp_engine_methods(job["patched"]))
    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation.from_str("sglang:d1t1"),
        nccl_group_name="areal-remote",
    )
    self._init_weight_update_from_distributed(meta)
    sync = self.weight_sync
    reports = []
    update = sync.update

    def recorded(*args, **kwargs):  # the patch's update, its report kept
        reports.append(update(*args, **kwargs))
        return reports[-1]

    sync.update = recorded
    started = time.monotonic()
    self._update_weights_from_distributed(meta)
    out["ours_s"] = time.monotonic() - started
    out["patched_report"] = dict(reports[0].__dict__)
    dist.barrier()
    if rank == 0:
        out["state"] = server_state([job["url"]], job["prompts"][job["seed"]])
    out["report"] = dict(
        sync.update(self._get_model_name_parameters(meta)).__dict__
    )  # the group persists
    dist.barrier()
    sync.close()
    if client is not None:
        client.destroy()
    return out
