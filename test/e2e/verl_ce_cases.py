"""What each process does in the verl checkpoint-engine test (``test_verl_checkpoint_engine``).

One gloo world of four processes is split in two, as verl deploys them: two actor
workers (FSDP2 fp32 trainer ranks, a world of their own) and two rollout workers (verl's
own ``CheckpointEngineWorker``, a world of their own, as verl's Ray workers are) beside a
TP-2 SGLang HTTP server started by the test in a process tree of its own. Each update
walks the steps verl's ``CheckpointEngineManager.update_weights`` takes for a
non-colocated backend (``prepare`` on every worker, ``build_topology``,
``init_process_group``, the actors' ``send_weights`` beside the rollout workers'
``update_weights``, ``finalize``); the manager's Ray dispatch is the stand-in: the workers
hand each other ``prepare``'s metadata through files and meet at file barriers.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from pathlib import Path

BACKEND = "sglang_remote"
MODULE = "sglang.srt.weight_sync.remote.verl_checkpoint_engine"


def _barrier(directory: Path, name: str, rank: int, world: int, timeout: float = 600):
    (directory / f"{name}.{rank}").touch()
    deadline = time.time() + timeout
    while not all((directory / f"{name}.{r}").exists() for r in range(world)):
        if time.time() > deadline:
            raise TimeoutError(f"barrier {name}: not every worker came")
        time.sleep(0.05)


def _all_gather(directory: Path, name: str, rank: int, world: int, value):
    with open(directory / f"{name}.value.{rank}.tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(
        directory / f"{name}.value.{rank}.tmp", directory / f"{name}.value.{rank}"
    )
    _barrier(directory, name, rank, world)
    return [
        pickle.loads((directory / f"{name}.value.{r}").read_bytes())
        for r in range(world)
    ]


def verl_ce_job(rank: int, world: int, job: dict):
    """Actor workers are ranks 0-1, rollout workers 2-3 (see the module's text)."""
    import torch.distributed as dist
    from verl.utils.import_utils import import_external_libs

    actors = job["actors"]
    directory = Path(job["dir"])
    dist.destroy_process_group()  # each side has a world of its own, as under Ray
    # verl imports the module named by checkpoint_engine.custom_backend_module on every worker
    import_external_libs(MODULE)
    if rank < actors:
        return _actor(rank, actors, world, job, directory)
    return _rollout(rank, actors, world, job, directory)


def _steps(rank, world, job, directory, ce_call, update):
    """verl's manager sequence per step, as seen from one worker."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    records = []
    for step, (kind, seed) in enumerate(job["steps"], start=1):
        metadata = _all_gather(
            directory, f"prepare{step}", rank, world, ce_call("prepare")
        )
        actor_kwargs, rollout_kwargs = CheckpointEngineRegistry.get(
            BACKEND
        ).build_topology(job["actors"], world - job["actors"], metadata)
        mine = actor_kwargs if rank < job["actors"] else rollout_kwargs
        index = rank if rank < job["actors"] else rank - job["actors"]
        ce_call("init_process_group", **{k: v[index] for k, v in mine.items()})
        records.append(update(step, kind, seed))
        ce_call("finalize")
        _barrier(directory, f"finalized{step}", rank, world)
        if rank == 0:
            from remote_cases import server_state

            records[-1]["state"] = server_state([job["url"]], job["prompts"][seed])
        _barrier(directory, f"recorded{step}", rank, world)
    return records


def _actor(rank, actors, world, job, directory):
    import torch.distributed as dist
    from ranks import gathers_allowed
    from remote_cases import fsdp2_model
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl_helpers import verl_producer

    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/actor_store",
        rank=rank,
        world_size=actors,
    )
    # as verl's ActorRolloutRefWorker builds it (engine_workers.py)
    ce = CheckpointEngineRegistry.new(
        BACKEND,
        is_master=(dist.get_rank() == 0),
        bucket_size=1 << 20,
        **job["engine_kwargs"],
    )

    def update(step, kind, seed):
        model = fsdp2_model(job["model_dir"], seed, actors)
        os.environ["VERL_ROLLOUT_LOCAL_SHARDS"] = "1" if kind == "patched" else "0"
        produced = verl_producer(
            job["verl_sources"][kind], model.state_dict(), model.config.model_type
        )
        send = ce.send_weights(produced, global_steps=step)
        if kind == "stock":
            with gathers_allowed():
                metrics = asyncio.run(send)
        else:
            metrics = asyncio.run(send)
        return {"kind": kind, "seed": seed, "metrics": metrics}

    return _steps(
        rank, world, job, directory, lambda m, **kw: getattr(ce, m)(**kw), update
    )


def _rollout(rank, actors, world, job, directory):
    import ray
    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.sglang_rollout import sglang_rollout
    from verl_helpers import ServerActor

    from sglang.srt.weight_sync.remote import endpoints as remote_endpoints

    rollout_rank = rank - actors
    host, port = job["url"].removeprefix("http://").split(":")
    os.environ.update(
        RANK=str(rollout_rank),
        WORLD_SIZE=str(world - actors),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["rollout_port"]),
        RAY_LOCAL_WORLD_SIZE=str(world - actors),
    )
    actor = ServerActor(int(port))
    ray.get_actor = lambda name: actor  # stand-in: the replica's SGLang server actor
    sglang_rollout.get_device_id = lambda: "cpu"  # stand-in: verl has no CPU platform
    config = RolloutConfig(
        name="sglang",
        mode="async",
        tensor_model_parallel_size=job["tp"],
        checkpoint_engine=CheckpointEngineConfig(
            backend=BACKEND,
            update_weights_bucket_megabytes=1,
            engine_kwargs={BACKEND: job["engine_kwargs"]},
            custom_backend_module=MODULE,
        ),
    )
    worker = CheckpointEngineWorker(config, HFModelConfig(path=job["model_dir"]))
    replies = []
    drive = remote_endpoints.drive_engine

    async def recording(engine, request):  # what the replica's engine answered
        reply = await drive(engine, request)
        if reply is not None:
            replies.append(reply)
        return reply

    remote_endpoints.drive_engine = recording
    held = []
    receive = worker.checkpoint_engine.receive_weights

    def watched(*args, **kwargs):  # what the rollout worker holds: never a weight
        for name, tensor in receive(*args, **kwargs):
            asks = remote_endpoints.engine_request([(name, tensor)])
            held.append(
                (name, tensor.numel(), asks is not None and asks["join"] is not None)
            )
            yield name, tensor

    worker.checkpoint_engine.receive_weights = watched

    def update(step, kind, seed):
        del replies[:], held[:]
        asyncio.run(worker.update_weights(global_steps=step))
        return {
            "kind": kind,
            "seed": seed,
            "replies": list(replies),
            "held": list(held),
            "steps_reported": list(actor.steps),
        }

    return _steps(
        rank,
        world,
        job,
        directory,
        lambda m, **kw: worker.execute_checkpoint_engine(m, **kw),
        update,
    )
