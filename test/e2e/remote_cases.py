"""What each trainer rank does in the remote-engine tests (``test_remote_engines``).

Trainer ranks (a gloo world of their own, ``full_tensor``/``gather_object`` refused) meet
SGLang HTTP servers started in process trees of their own (``servers.py``) in a
weight-sync group (``remote.trainer.RemoteSync``): FSDP2-style fp32 ``Shard(0)`` DTensors
(``update_cases.as_layout``) or a real megatron-core ``GPTModel`` at TP 2 x PP 2
(``megatron_cases``). The trainer's first rank also runs upstream's broadcast path on the
same servers (``init_weights_update_group`` + ``update_weights_from_distributed``: it
gathers every tensor, as stock callers do, and broadcasts each one to every engine rank),
timed beside ours.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Dict, List

import torch
import torch.distributed as dist


def _report(report) -> dict:
    return dict(report.__dict__)


class _Url:
    """What ``update_cases.checksums`` reads of a server: its URL."""

    def __init__(self, url: str):
        self.server_args = type("Args", (), {"url": lambda _: url})()


def fsdp2_model(model_dir, seed: int, world: int):
    """The tiny model with the weights of ``seed``, fp32, FSDP2-sharded over the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from update_cases import new_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.load_state_dict(
        {n: t.float() for n, t in new_weights(model_dir, seed).items()}, strict=False
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def group_of(job: dict, **kwargs):
    """This trainer rank's ``RemoteSync`` of the job's group, servers and port (``kwargs``:
    ``RemoteSync``'s others, e.g. ``delta``)."""
    from sglang.srt.weight_sync.remote import HttpEndpoint, RemoteSync

    return RemoteSync(
        job["group"],
        "127.0.0.1",
        job["port"],
        engines=[HttpEndpoint(u) for u in job["urls"]],
        timeout_s=job["timeout"],
        **kwargs,
    )


def server_state(urls, prompts) -> list:
    """Every server's per-rank parameter checksums and greedy continuations of ``prompts``."""
    import requests
    from update_cases import MAX_NEW, checksums

    out = []
    for url in urls:
        body = {
            "input_ids": prompts,
            "sampling_params": {
                "max_new_tokens": MAX_NEW,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        reply = requests.post(f"{url}/generate", json=body, timeout=300)
        generated = (
            [o["output_ids"] for o in reply.json()]
            if reply.status_code == 200
            else reply.text
        )
        out.append({"checksums": checksums(_Url(url)), "generation": generated})
    return out


def fsdp_trainer_job(rank: int, world: int, job: dict) -> dict:
    """Join the servers, then one update per seed (FSDP2 fp32 shards); returns the reports,
    and on the first rank the timings of upstream's broadcast path on seed
    ``job["broadcast_seed"]``."""
    from ranks import gathers_allowed
    from torch.distributed.device_mesh import init_device_mesh
    from update_cases import as_layout, new_weights

    mesh = init_device_mesh("cpu", (world,))
    sync = group_of(job)
    out: Dict[str, List] = {"ours": [], "broadcast": None}
    joined = time.monotonic()
    sync.join()
    out["join_s"] = time.monotonic() - joined
    for seed in job["seeds"]:
        tensors = as_layout(new_weights(job["model_dir"], seed), "fsdp32", mesh)
        out["ours"].append(
            _report(
                sync.update(
                    tensors,
                    bucket_bytes=job["bucket"],
                    staging_bytes=job.get("staging"),
                )
            )
        )
    dist.barrier()
    if rank == 0:
        out["state"] = server_state(job["urls"], job["prompts"])
    seeds = job.get("broadcast_seeds") or [job.get("broadcast_seed")]
    ports = job.get("broadcast_ports") or [job.get("broadcast_port")]
    for seed, port in zip(seeds, ports):
        if seed is None:
            continue
        tensors = as_layout(new_weights(job["model_dir"], seed), "fsdp32", mesh)
        with gathers_allowed():
            out["broadcast"] = upstream_broadcast(
                rank, tensors, dict(job, broadcast_port=port)
            )
        if rank == 0:
            out.setdefault("broadcasts", []).append(out["broadcast"])
    dist.barrier()
    sync.close()
    return out


def upstream_broadcast(rank: int, tensors, job: dict):
    """Upstream's path: every trainer rank takes part in ``full_tensor()`` of every tensor
    (the gather stock trainers run), then the first rank casts each to the engines' dtype
    and broadcasts it into a group with every engine rank, which each receive it whole
    (``/init_weights_update_group``, ``/update_weights_from_distributed``). Returns the
    seconds of both parts and the bytes, on the first rank."""
    import requests

    from sglang.srt.utils.common import init_custom_process_group

    started = time.monotonic()
    full = [(n, t.full_tensor().to(torch.bfloat16)) for n, t in tensors]
    gathered_s = time.monotonic() - started
    dist.barrier()
    if rank != 0:
        return None
    tp = job["tp"]
    urls, port = job["urls"], job["broadcast_port"]
    world = 1 + tp * len(urls)
    pool = concurrent.futures.ThreadPoolExecutor(len(urls))
    started = time.monotonic()
    joins = [
        pool.submit(
            requests.post,
            f"{url}/init_weights_update_group",
            json=dict(
                master_address="127.0.0.1",
                master_port=port,
                rank_offset=1 + i * tp,
                world_size=world,
                group_name="upstream",
                backend="gloo",
            ),
        )
        for i, url in enumerate(urls)
    ]
    group = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=world,
        rank=0,
        group_name="upstream",
    )
    assert all(j.result().status_code == 200 for j in joins), [
        j.result().text for j in joins
    ]
    joined_s = time.monotonic() - started
    body = dict(
        names=[n for n, _ in full],
        dtypes=["bfloat16"] * len(full),
        shapes=[list(t.shape) for _, t in full],
        group_name="upstream",
    )
    started = time.monotonic()
    applied = [
        pool.submit(requests.post, f"{url}/update_weights_from_distributed", json=body)
        for url in urls
    ]
    for _, t in full:
        dist.broadcast(t, src=0, group=group)
    replies = [a.result().json() for a in applied]
    update_s = time.monotonic() - started
    for url in urls:
        requests.post(
            f"{url}/destroy_weights_update_group", json={"group_name": "upstream"}
        )
    dist.destroy_process_group(group)
    model_bytes = sum(t.numel() * t.element_size() for _, t in full)
    return dict(
        replies=replies,
        gather_s=gathered_s,
        join_s=joined_s,
        update_s=update_s,
        model_bytes=model_bytes,
        # the root sends every tensor once per receiver at least (gloo's broadcast), every
        # engine rank receives every tensor whole
        sent_by_rank0=model_bytes * (world - 1),
        received_per_engine_rank=model_bytes,
    )


def megatron_trainer_job(rank: int, world: int, job: dict) -> dict:
    """A megatron-core GPTModel at TP x PP (local spec, CPU), loaded with the weights of
    ``job["seed"]``, updates the servers through the group."""
    import tiny_models
    from megatron_cases import build_gpt, load_hf_weights
    from update_cases import new_weights

    hf_config = tiny_models.tiny_config("qwen2")
    model = build_gpt(hf_config, job["tp"], job["pp"], job["padded_vocab"])
    load_hf_weights(
        model, new_weights(job["model_dir"], job["seed"]), hf_config.vocab_size
    )
    sync = group_of(job)
    sync.join()
    report = sync.update_megatron(
        [model], hf_config.vocab_size, bucket_bytes=job["bucket"]
    )
    dist.barrier()
    out = _report(report)
    if rank == 0:
        out["state"] = server_state(job["urls"], job["prompts"])
    sync.close()
    return out
