"""What each trainer rank does in the end-to-end tests.

``engine_job`` runs on every rank of a gloo world of trainer processes. The first
rank of each engine's mesh hosts a real CPU ``sglang.Engine``
(``hosted_engine.HostedEngine``, or the job's ``host``: anything with its interface). The
job runs a list of steps: weight updates through each public entry point and trainer
layout ("verl": every rank hands the host its tensors, as verl calls ``VerlEngine``),
and bad updates that must be refused. After every step rank 0 records the engine's greedy
generation and its per-rank parameter checksums (SGLang's own weight checker), which the test
compares with HF transformers and with SGLang's slicing of the new weights.
Every trainer process runs with ``full_tensor``, ``gather_object`` and
``all_gather_object`` replaced by functions that raise.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

# isort: split
# pr: safety
import json
from typing import Optional

# pr: safety end

MAX_NEW = 8
BAD_NAME = "model.layers.0.self_attn.no_such_proj.weight"


def new_weights(model_dir, seed: int) -> Dict[str, torch.Tensor]:
    """The same 'trained' weights on every rank: each checkpoint tensor moved by 20% of its own
    spread, as a (large) training step would."""
    import tiny_models

    ckpt = tiny_models.load_checkpoint(model_dir)
    return {
        n: (
            t.float() + 0.2 * tiny_models.random_like(t, seed=seed * 1000 + i).float()
        ).to(t.dtype)
        for i, (n, t) in enumerate(sorted(ckpt.items()))
    }


def _row_parallel(name: str) -> bool:
    return "o_proj.weight" in name or "down_proj.weight" in name


def placements(name: str, layout: str) -> tuple:
    """Placements of one tensor on the trainer's mesh (see ``as_layout``)."""
    from torch.distributed.tensor import Replicate, Shard

    if layout in ("fsdp", "fsdp32"):
        return (Shard(0),)
    if layout == "hsdp":
        return (Replicate(), Shard(0))
    if "norm" in name or name.endswith("mlp.gate.weight"):
        return (Replicate(),)
    return (Shard(1) if _row_parallel(name) else Shard(0),)


def hsdp_ranks(world: int) -> List[List[int]]:
    """HSDP mesh (replica, shard) whose replicas interleave: [[0, 2], [1, 3]] for 4 ranks, so
    ranks 0 and 1 (one engine of TP 2) hold the same shard and no engine is covered."""
    return [list(range(r, world, world // 2)) for r in range(world // 2)]


def as_layout(
    weights: Dict[str, torch.Tensor], layout: str, mesh
) -> List[Tuple[str, torch.Tensor]]:
    """How a trainer holds them: "fsdp" (FSDP2-style Shard(0) DTensors; "fsdp32" the same in
    fp32, as FSDP2 keeps its sharded parameters), "hsdp" (Shard(0) within each of 2 replicas),
    "tp" (Megatron-style DTensors: Shard(0) column, Shard(1) row, norms replicated) or "full"
    (plain tensors). ``mesh`` is 1-d over the world, ``hsdp_ranks`` for "hsdp"."""
    from torch.distributed.tensor import distribute_tensor

    out = []
    for name, t in sorted(weights.items()):
        if layout == "full":
            out.append((name, t))
            continue
        t = t.float() if layout == "fsdp32" else t
        out.append(
            (
                name,
                distribute_tensor(
                    t, mesh, placements(name, layout), src_data_rank=None
                ),
            )
        )
    return out


class VerlLikeClient:
    """What verl hands ``weight_sync.utils.update_weights`` as ``engine``: an async
    ``update_weights_from_tensor(req)`` and ``flush_cache()``, no new method."""

    def __init__(self, engine):
        self._engine = engine

    async def update_weights_from_tensor(self, req):
        return await self._engine.tokenizer_manager.update_weights_from_tensor(
            req, None
        )

    async def flush_cache(self):
        return await self._engine.tokenizer_manager.flush_cache()


# SGLang releases whose weight checker cannot give every TP rank's checksums: 0.5.10.post1 has no
# "checksum" action (and compares on CUDA only); 0.5.12 replies with TP rank 0's only.
NO_CHECKSUMS = ("0.5.10.post1", "0.5.12")
# Releases whose weight checker calls all_gather_object in the engine: what shows the recorder is live.
GATHERING_CHECKER = ("0.5.23", "0.5.15.post1")


def _saved_checksums(engine) -> Dict[int, Dict[str, str]]:
    """Per-rank parameter checksums of what SGLang's own ShardedStateLoader saves of the live
    model (``Engine.save_sharded_model``), for the releases in ``NO_CHECKSUMS``."""
    import tempfile

    from safetensors.torch import load_file

    out: Dict[int, Dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as directory:
        engine.save_sharded_model(
            params={"path": directory, "pattern": None, "max_size": None}
        )
        for f in sorted(
            os.listdir(directory)
        ):  # model-rank-{rank}-part-{part}.safetensors
            rank = int(f.split("-")[2])
            out.setdefault(rank, {}).update(
                {
                    n: checksum(t)
                    for n, t in load_file(os.path.join(directory, f)).items()
                }
            )
    return out


def _written_checksums(url: str, timeout: float = 120) -> Dict[int, Dict[str, str]]:
    """Per-rank parameter checksums of a server on a release in ``NO_CHECKSUMS``: its weight
    checker's test-only ``checksums_to:<dir>`` action (``sitecustomize``), every TP rank's
    file awaited (the server answers once TP rank 0 has written its own)."""
    import json
    import tempfile
    import time

    import requests

    with tempfile.TemporaryDirectory() as directory:
        body = requests.post(
            f"{url}/weights_checker", json={"action": f"checksums_to:{directory}"}
        ).json()
        assert body["success"], body
        deadline = time.monotonic() + timeout
        while True:
            files = [f for f in os.listdir(directory) if f.endswith(".json")]
            ranks = int(files[0].split("of")[1].split(".")[0]) if files else -1
            if len(files) == ranks:
                break
            assert time.monotonic() < deadline, (
                f"checksum files after {timeout}s: {files}"
            )
            time.sleep(0.1)
        out = {}
        for f in files:
            with open(os.path.join(directory, f)) as fh:
                out[int(f[len("rank") :].split("of")[0])] = json.load(fh)
        return out


def checksum(t: torch.Tensor) -> str:
    """A tensor's checksum as SGLang's weight checker reports it."""
    from sglang.srt.managers.mm_utils import tensor_hash

    return f"{tensor_hash(t):016x}"


def checksums(engine) -> Dict[int, Dict[str, str]]:
    """Per-rank parameter checksums from SGLang's own weight checker, in-process or over HTTP
    (0.5.23 replies (ok, message, ranks, extra), 0.5.12 (ok, message, ranks))."""
    import msgspec
    import requests

    import sglang

    if sglang.__version__.split("+")[0] in NO_CHECKSUMS:
        if hasattr(engine, "tokenizer_manager"):
            return _saved_checksums(engine)
        return _written_checksums(engine.server_args.url())

    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    if hasattr(engine, "tokenizer_manager"):
        ok, message, ranks = engine.loop.run_until_complete(
            engine.tokenizer_manager.check_weights(
                CheckWeightsReqInput(action="checksum"), None
            )
        )[:3]
    else:  # HttpServerEngineAdapter: the server's /weights_checker route
        body = requests.post(
            f"{engine.server_args.url()}/weights_checker", json={"action": "checksum"}
        ).json()
        ok, message, ranks = body["success"], body["message"], body.get("ranks")
    assert ok, message
    infos = []
    while ranks:  # one entry per rank (and runner role), possibly nested in lists
        item = ranks.pop()
        ranks.extend(item) if isinstance(item, list) else infos.append(item)
    infos = [
        msgspec.to_builtins(r) for r in infos
    ]  # 0.5.23: msgspec ChecksumInfo; 0.5.12: plain dicts
    # one target runner per rank; parallelism_info is one entry per runner role on 0.5.23, a single one on 0.5.12
    par = [i["parallelism_info"] for i in infos]
    return {
        (p[0] if isinstance(p, list) else p)["tp_rank"]: i["checksums"]
        for p, i in zip(par, infos)
    }


# pr: safety
def _data_groups(host, leader: bool, groups_dir: str) -> Optional[List]:
    """The name of every engine TP rank's data group (None where it holds none), on the
    engine's leader rank (None elsewhere): a new group has a new name."""
    if not leader:
        return None
    tag = f"groups-{time.monotonic_ns()}"
    host.engine.collective_rpc("test_dump_data_group", tag=tag)
    names = sorted(f for f in os.listdir(groups_dir) if f.startswith(tag + "."))
    return [json.load(open(os.path.join(groups_dir, f))) for f in names]


# pr: safety end
def _forbidden_calls(log_dir: str) -> int:
    """Calls of full_tensor/gather_object/all_gather_object recorded so far by any process."""
    return sum(
        len(open(os.path.join(log_dir, f)).readlines()) for f in os.listdir(log_dir)
    )


def _generate(host, prompts) -> List[List[int]]:
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    return [
        o["output_ids"]
        for o in host.generate(input_ids=prompts, sampling_params=params)
    ]


def _direct(
    host,
    ranks,
    group,
    shards,
    update_id=None,
    request_id=None,
    timeout_s=120.0,
    send=True,
):
    """Deliver ``shards`` (name, local tensor, MeshSpec) by hand and call
    ``Engine.update_weights_distributed``; returns its reply (success, message and the
    figures per engine rank) on every rank."""
    chan = host.sync.channel(ranks, group)  # the channel the host's own updates use
    update_id = update_id or chan.next_update_id()
    if send:
        chan.sender.send(update_id, dist.get_rank(), chan.rank_map, shards)
    return _request(host, ranks, group, chan, request_id or update_id, timeout_s)


def _request(host, ranks, group, chan, update_id, timeout_s=120.0):
    """``Engine.update_weights_distributed`` for what every rank delivered; (success, message) on every rank."""
    from engine import weight_update_session

    dist.barrier(group=group)
    result = None
    if dist.get_rank() == ranks[0]:
        with weight_update_session(host.engine):
            result = host.engine.update_weights_distributed(
                update_id, chan.channel, timeout_s=timeout_s
            )
    box = [result]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    return box[0]


def _bad_shards(kind: str, weights, mesh) -> list:
    """Shards of a refused update: every rank sends them (rank 1 sends none for "missing")."""
    from sglang.srt.weight_sync.source_layout import MeshSpec
    from sglang.srt.weight_sync.trainer_flow import prepare_shards

    shards = prepare_shards(as_layout(weights, "fsdp", mesh))
    name, local, spec = shards[0]
    if kind == "unknown_name":
        shards.append(
            (
                BAD_NAME,
                local,
                MeshSpec(spec.shape, spec.dtype, spec.mesh, spec.placements),
            )
        )
    elif kind == "wrong_shape":
        shape = (spec.shape[0] + dist.get_world_size(),) + tuple(spec.shape[1:])
        shards[0] = (
            name,
            torch.cat([local, local[:1]]),
            MeshSpec(shape, spec.dtype, spec.mesh, spec.placements),
        )
    elif kind == "bad_dtype":
        shards[0] = (
            name,
            local.to(torch.int32),
            MeshSpec(spec.shape, torch.int32, spec.mesh, spec.placements),
        )
    elif (
        kind == "not_covered"
    ):  # claims a second holder (rank 99) that is not beside the engine
        from torch.distributed.tensor import Shard

        full = MeshSpec(
            spec.shape,
            spec.dtype,
            list(range(dist.get_world_size())) + [99],
            (Shard(0),),
        )
        box = full.describe(name).box_of(dist.get_rank())
        shards[0] = (name, weights[name][box.slices()].clone(), full)
    return shards


def _write_report(job: dict, rank: int, step, report, seconds=None) -> None:
    """This rank's runtime counters of one update, for the test to check against the lower
    bound, and its phases with the wall time measured around the update."""
    import json

    if job.get("reports_dir"):
        with open(os.path.join(job["reports_dir"], f"rank{rank}.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    dict(
                        step=list(step),
                        mode=report.mode,
                        bytes_received=report.bytes_received,
                        lower_bound_bytes=report.lower_bound_bytes,
                        peak_staging_bytes=report.peak_staging_bytes,
                        peak_buffer_bytes=report.peak_buffer_bytes,
                        chunks=report.chunks,
                        # pr: scale
                        described=report.described,
                        # pr: scale end
                        # pr: remote
                        delta=report.delta,
                        # pr: remote end
                        phases=report.phases,
                        seconds=seconds,
                    )
                )
                + "\n"
            )


def engine_job(rank: int, world: int, job: dict) -> dict:
    from engine import WORKER_ENGINE_ARGS, omp_bind, weight_update_session
    from hosted_engine import HostedEngine
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from sglang.srt.weight_sync import utils as weight_sync_utils

    tp = job[
        "tp"
    ]  # engines of `tp` ranks side by side; the trainer's mesh spans the whole world
    os.environ["SGLANG_TEST_FORBIDDEN_LOG"] = job[
        "forbidden_log"
    ]  # read by the engine's processes (sitecustomize)
    groups_dir = job["forbidden_log"] + "-groups"  # each rank's data group, by step
    # pr: safety
    # whose data group every step records: jobs that release the engine's memory
    tracks_groups = any(step[0] == "memory" for step in job["steps"])
    # pr: safety end
    os.makedirs(groups_dir, exist_ok=True)
    os.environ["SGLANG_TEST_PARAM_PTRS"] = groups_dir  # (sitecustomize)
    if tp > 1:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(tp)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    meshes = (
        {
            "hsdp": DeviceMesh(
                "cpu", hsdp_ranks(world), mesh_dim_names=("replicate", "shard")
            )
        }
        if world >= 4
        else {}
    )
    engines = init_device_mesh(
        "cpu", (world // tp, tp, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp")
    )
    engine_mesh = engines["infer_tp"]
    group, ranks = engine_mesh.get_group(), [int(r) for r in engine_mesh.mesh.tolist()]
    leader = rank == ranks[0]
    host = (job.get("host") or HostedEngine)(
        engine_mesh,
        model_path=str(job["model_dir"]),
        **{**WORKER_ENGINE_ARGS, **job.get("engine_kwargs", {})},
    )
    prompts = job["prompts"][
        "start"
    ]  # per weight set: no bf16 near-tie on their greedy paths
    generate = (
        (lambda: _generate(host, prompts))
        if job.get("generate", True)
        else (lambda: None)
    )  # noqa: E731
    records = [dict(step="start", generation=generate())]
    try:
        for step in job["steps"]:
            kind, arg, seed = step
            record = dict(step=step)
            calls_before = _forbidden_calls(job["forbidden_log"])
            if kind == "verl":
                shards = as_layout(
                    new_weights(job["model_dir"], seed), arg, meshes.get(arg, mesh)
                )
                start = time.perf_counter()
                report = host.update(shards)
                record["seconds"] = time.perf_counter() - start
                record["phases"], record["engine_phases"] = (
                    report.phases,
                    report.engine_phases,
                )
                record["inline_bytes"] = report.inline_bytes
                record["success"] = True
                _write_report(job, rank, step, report, record["seconds"])
            # pr: safety
            elif (
                kind == "memory"
            ):  # the host's other duties: the same model must come back
                # the data group (NCCL's buffers) goes with the released memory
                record["data_group_before"] = _data_groups(host, leader, groups_dir)
                host.call("release_memory_occupation")
                record["data_group_released"] = _data_groups(host, leader, groups_dir)
                host.call("resume_memory_occupation")
                host.call("flush_cache")
                record["success"] = True
            elif kind == "released":
                # an update while the memory saver has released the weights is refused on
                # every rank; once resumed, the old weights serve
                host.call("release_memory_occupation")
                try:
                    host.update(
                        as_layout(new_weights(job["model_dir"], seed), arg, mesh)
                    )
                    record["success"] = True
                except RuntimeError as e:
                    record["success"], record["message"] = False, str(e)
                host.call("resume_memory_occupation")
                host.call("flush_cache")
            # pr: safety end
            elif (
                kind == "verl_bad"
            ):  # a refused update raises on every rank, whatever the backend
                bad = as_layout(new_weights(job["model_dir"], seed), arg, mesh)
                bad.append((BAD_NAME, bad[0][1]))
                try:
                    host.update(bad)
                    record["success"] = True
                except RuntimeError as e:
                    record["success"], record["message"] = False, str(e)
            elif kind == "utils":
                client = VerlLikeClient(host.engine) if leader else None
                params = as_layout(
                    new_weights(job["model_dir"], seed), arg, mesh
                )  # DTensors on the trainer's mesh
                call = weight_sync_utils.update_weights(
                    client, params, "infer_tp", engines, flush_cache=False
                )
                if leader:
                    with weight_update_session(host.engine):
                        out = host.engine.loop.run_until_complete(call)
                    host.engine.flush_cache()
                    record["success"], record["message"] = out
                else:
                    asyncio.run(call)
            elif kind == "engine":
                from sglang.srt.weight_sync.trainer_flow import prepare_shards

                shards = prepare_shards(
                    as_layout(new_weights(job["model_dir"], seed), arg, mesh)
                )
                record.update(_direct(host, ranks, group, shards))
            elif kind == "fail":
                weights = new_weights(job["model_dir"], seed)
                shards = _bad_shards(arg, weights, mesh)
                if arg == "missing":
                    record.update(
                        _direct(host, ranks, group, shards, timeout_s=3, send=rank != 1)
                    )
                elif arg == "stale":
                    record.update(
                        _direct(
                            host,
                            ranks,
                            group,
                            shards,
                            update_id="stale-1",
                            request_id="stale-2",
                            timeout_s=3,
                        )
                    )
                else:
                    record.update(_direct(host, ranks, group, shards))
            else:
                raise ValueError(kind)
            record["forbidden_calls"] = (
                _forbidden_calls(job["forbidden_log"]) - calls_before
            )
            if kind not in (
                "fail",
                "verl_bad",
                # pr: safety
                "memory",
                "released",
                # pr: safety end
            ) and job.get("generate", True):
                prompts = job["prompts"][seed]
            record["generation"] = generate()
            if leader:
                record["checksums"] = checksums(host.engine)
            # pr: safety
            if tracks_groups:  # (through Engine.collective_rpc: not the HTTP adapter)
                record["data_group"] = _data_groups(host, leader, groups_dir)
            # pr: safety end
            dist.barrier()  # every engine's weight checker (it gathers) is done before the next step counts
            records.append(record)
    finally:
        dist.barrier()
        host.shutdown()
    return records if leader else []
