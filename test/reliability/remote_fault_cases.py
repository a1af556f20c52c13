"""What each trainer rank does in the remote-engine fault tests (``test_remote_faults``).

Two trainer ranks (FSDP2 fp32 shards) and TP-1 SGLang HTTP servers, each in a process tree
of its own, in one weight-sync group. The job runs the steps it is given and records, on
every rank, each update's report or the error it raised, with the seconds it took; the
test reads the servers' state itself between runs.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def remote_steps_job(rank: int, world: int, job: dict) -> list:
    """Steps: ("update", seed), ("arm", fault file) creates a fault file (first rank; the
    engine named by it acts on it), ("join", url) lets a (restarted) engine join,
    ("die", seed): trainer rank 1 dies inside its first executor round of that update,
    ("nan", seed): that update with a NaN in trainer rank 0's shard of its first tensor,
    ("state", urls): the first rank records those servers' checksums and generation.
    ``job["delta"]``: the group sends delta updates (``RemoteSync(delta=True)``)."""
    from remote_cases import group_of
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    from sglang.srt.weight_sync import executor
    from sglang.srt.weight_sync.remote.trainer import HttpEndpoint

    mesh = init_device_mesh("cpu", (world,))
    sync = group_of(job, delta=job.get("delta", False))
    records = []
    for kind, arg in job["steps"]:
        started = time.monotonic()
        if kind == "arm":
            if rank == 0:
                open(arg, "w").close()
            dist.barrier()
            continue
        if kind == "state":
            from remote_cases import server_state

            records.append(
                {
                    "kind": kind,
                    "state": server_state(arg, [[5, 17, 42, 7]]) if rank == 0 else None,
                }
            )
            dist.barrier()
            continue
        if kind == "join":
            sync.join([HttpEndpoint(arg)])
            records.append({"kind": kind, "epoch": sync.epoch})
            continue
        tensors = as_layout(new_weights(job["model_dir"], arg), "fsdp32", mesh)
        if kind == "nan" and rank == 0:
            tensors[0][1].to_local().view(-1)[0] = float("nan")
        if kind == "die" and rank == 1:
            original = executor._start_round

            def die(*args, **kwargs):
                os._exit(0)  # killed in the middle of sending its regions

            executor._start_round = die
        try:
            report = sync.update(tensors, bucket_bytes=job["bucket"]).__dict__
        except Exception as e:  # noqa: BLE001 - the test reads the message
            report = {"success": False, "raised": f"{type(e).__name__}: {e}"}
        if kind == "die" and rank == 1:
            executor._start_round = original
        report.update(kind=kind, seed=arg, seconds_here=time.monotonic() - started)
        records.append(report)
    if all(r.get("success", True) for r in records[-1:]):
        sync.close()
    return records
