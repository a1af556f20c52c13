"""slime's three weight-update paths, made as its released code makes them
(``test/support/slime_client.py``, written from THUDM/slime at 624b824), against a real CPU
SGLang HTTP server of TP 2 from this wheel.

Two trainer ranks stand beside the server's two ranks, as slime's colocated placement has them.
slime's launcher starts the server where it can: ``ServerArgs`` built through
``dataclasses.fields(ServerArgs)`` in ``launch_server`` (0.5.15.post1, slime's pin; 0.5.23's
``ServerArgs`` is a msgspec struct and slime's launcher stops with ``TypeError`` there, so the
server is started by ``HttpServerEngineAdapter`` and the same calls follow). Then, one version
each:

* ``tensor`` (``UpdateWeightFromTensor``, ``--colocate``): rank 0 pauses and flushes; every
  rank packs each chunk in ``FlattenedTensorBucket``s, the engine's first rank gathers them and
  sends ``update_weights_from_tensor(load_format="flattened_bucket")``; rank 0 continues.
* ``distributed`` (``UpdateWeightFromDistributed``, nccl transport, gloo here): rank 0 joins
  the server to ``slime-pp_0`` (``init_weights_update_group``), pauses, flushes, then per chunk
  asks for ``update_weights_from_distributed`` while it broadcasts; continues; leaves the group.
* ``disk`` (``UpdateWeightFromDisk`` then ``RayTrainGroup``'s reload, full mode): rank 0 writes
  ``weight_v{N:06d}`` and the server reloads it (pause, flush, ``update_weights_from_disk``,
  the version check, continue).

After each: every TP rank's parameters equal SGLang's slicing of the new weights bit for bit
(SGLang's own weight checker), greedy generation equals HF transformers', and
``/get_weight_version`` reports the version slime sent. The routes of slime's own SGLang build:
``/post_process_weights`` succeeds with nothing to do on this unquantized model, and
``/pull_weights`` is refused with a message naming ``update_weights_from_disk``.

Stand-ins, only for what cannot run here: slime's Megatron model and its HF conversion (each
trainer rank holds the HF tensors that ``all_gather_param`` + ``convert_to_hf`` produce) and its
HF checkpoint saver (the same tensors written as a checkpoint), Ray, CUDA IPC and NCCL
(``slime_client`` says how).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import requests
import tiny_models
from engine import WORKER_ENGINE_ARGS
from ports import free_ports
from ranks import run_ranks
from update_cases import MAX_NEW, new_weights
from verl_helpers import check_server, llama_with_prompts, wait_healthy

TP = 2
STEPS = (("tensor", 1), ("distributed", 2), ("disk", 3))
# slime's --update-weight-buffer-size, small enough for several chunks of the tiny model
BUFFER_BYTES = 1 << 17


def _distributed_update(rank, engine, weights, version, group_port) -> None:
    """``UpdateWeightFromDistributed``: connect, update, disconnect (rank 0 sends)."""
    import torch.distributed as dist
    from slime_client import (
        chunks,
        connect_rollout_engines_from_distributed,
        update_weights_from_distributed,
    )

    name = "slime-pp_0"
    group = None
    if rank == 0:
        group = connect_rollout_engines_from_distributed(
            name, [engine], [TP], group_port
        )
        engine.pause_generation()
        engine.flush_cache()
    dist.barrier()
    if rank == 0:
        for chunk in chunks(sorted(weights.items()), BUFFER_BYTES):
            for ref in update_weights_from_distributed(
                name, group, version, [engine], chunk
            ):
                assert ref.result()["success"], ref.result()
    dist.barrier()
    if rank == 0:
        engine.continue_generation()
        engine.destroy_weights_update_group(name)
        dist.destroy_process_group(group)
    dist.barrier()


def _disk_update(rank, engine, model_dir, disk_dir, weights, version) -> None:
    """``UpdateWeightFromDisk.update_weights``, then the reload ``RayTrainGroup`` runs."""
    import torch.distributed as dist
    from slime_client import reload_from_disk

    version_dir = Path(disk_dir) / f"weight_v{version:06d}"
    if rank == 0:
        shutil.rmtree(version_dir, ignore_errors=True)
    dist.barrier()
    if rank == 0:  # stand-in for save_hf_model_to_path
        tiny_models.write_modified_checkpoint(model_dir, version_dir, weights)
    dist.barrier()
    if rank == 0:
        reload_from_disk([engine], str(version_dir), str(version))
        shutil.rmtree(version_dir, ignore_errors=True)
    dist.barrier()


def slime_job(rank: int, world: int, job: dict) -> list:
    import torch.distributed as dist
    from engine import omp_bind
    from slime_client import SlimeEngine, colocated_update, start_server
    from update_cases import checksums

    model_dir, port = job["model_dir"], job["ports"][0]
    stop = None
    if rank == 0:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(TP)
        stop, server = start_server(model_dir, job["ports"][:3], TP, WORKER_ENGINE_ARGS)
    records = []
    try:
        wait_healthy(port)
        engine = SlimeEngine("127.0.0.1", port)
        group = dist.new_group(ranks=list(range(TP)), backend="gloo")
        for version, (kind, seed) in enumerate(job["steps"], start=1):
            weights = new_weights(model_dir, seed)
            if kind == "tensor":
                colocated_update(rank, engine, group, weights, version, BUFFER_BYTES)
            elif kind == "distributed":
                _distributed_update(rank, engine, weights, version, job["ports"][3])
            else:
                _disk_update(rank, engine, model_dir, job["disk_dir"], weights, version)
            if rank != 0:
                continue
            params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
            out = requests.post(
                f"http://127.0.0.1:{port}/generate",
                json={"input_ids": job["prompts"][seed], "sampling_params": params},
                timeout=300,
            ).json()
            records.append(
                dict(
                    kind=kind,
                    seed=seed,
                    generation=[o["output_ids"] for o in out],
                    params=checksums(server),
                    weight_version=engine.get_weight_version(),
                )
            )
        if rank == 0:
            records.append(_framework_routes(engine, job["disk_dir"]))
        dist.barrier()
    finally:
        if stop is not None:
            stop()
    return records


def _framework_routes(engine, disk_dir: str) -> dict:
    """The routes of slime's own SGLang build, called as slime calls them."""
    post = engine.post_process_weights(
        restore_weights_before_load=True, post_process_quantization=False
    )
    try:
        engine.pull_weights(1, str(Path(disk_dir) / "local"), disk_dir)
        pulled = None
    except requests.HTTPError as e:
        pulled = (e.response.status_code, e.response.json()["message"])
    return dict(kind="routes", post_process=post, pull=pulled)


def test_slime_launcher_reads_server_args_as_a_dataclass():
    """slime's ``_compute_server_args`` lists ``dataclasses.fields(ServerArgs)``: it works on
    slime's pin and every base before 0.5.23, whose ``ServerArgs`` is a msgspec struct."""
    import sglang
    from sglang.srt.server_args import ServerArgs

    if sglang.__version__.split("+")[0] == "0.5.23":
        with pytest.raises(TypeError, match="dataclass"):
            dataclasses.fields(ServerArgs)
    else:
        assert "model_path" in {f.name for f in dataclasses.fields(ServerArgs)}


def test_slime_updates_a_tp2_server(tmp_path):
    model_dir, config, prompts = llama_with_prompts(
        tmp_path / "llama", [seed for _, seed in STEPS]
    )
    job = dict(
        model_dir=str(model_dir),
        ports=free_ports(4),
        steps=STEPS,
        prompts=prompts,
        disk_dir=str(tmp_path / "disk"),
    )
    records, _ = run_ranks(TP, slime_job, job, timeout=560)  # inside pytest's 600 s
    *updates, routes = records
    assert [(r["kind"], r["seed"]) for r in updates] == list(STEPS)
    for version, record in enumerate(updates, start=1):
        check_server(
            record, model_dir, config, TP, prompts, f"slime {record['kind']} update"
        )
        assert record["weight_version"] == str(version), record["weight_version"]
    assert routes["post_process"]["success"], routes["post_process"]
    status, message = routes["pull"]
    assert status == 501 and "/update_weights_from_disk" in message, routes["pull"]
