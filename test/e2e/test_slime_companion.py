"""slime's updates with the companion patch (``integrations/slime``): the trainer ranks hand
their Megatron-core local parameters to SGLang's distributed update instead of gathering full
HF tensors (``weight_sync.slime_sync``).

Two trainer ranks hold a real megatron-core ``GPTModel`` at TP 2 (``megatron_cases``, loaded
with a tiny Qwen2's weights) beside a TP-2 CPU server that slime's launcher starts
(``slime_client.start_server``). First slime's released colocated path (one version of other
weights, ``slime_client.colocated_update``), for its bytes and seconds. Then what the patched
updaters run, each inside rank 0's ``pause_generation`` / ``flush_cache`` ...
``continue_generation`` as released:

* colocated (``UpdateWeightFromTensor``): ``SlimeColocatedSync(url, ranks, group).update(model,
  vocab_size, version)``, control requests over ``/update_weights_distributed``;
* distributed (``UpdateWeightFromDistributed``): every rank joins the weight-sync group
  (``slime_remote_sync``) and sends with ``RemoteSync.update_megatron``.

After each: the server's parameters equal SGLang's slicing of the new weights bit for bit on
both TP ranks, greedy generation equals HF transformers', the version is reported, no process
called ``full_tensor``/``gather_object``/``all_gather_object`` during the update (the trainer
ranks refuse them, the engine's record them), and every engine rank received exactly the lower
bound of bytes (colocated: the engine's own figures, ``SGLANG_TEST_FIGURES_LOG``; distributed:
the group's reply).
"""

from __future__ import annotations

import os
import time

import requests
import tiny_models
from engine import WORKER_ENGINE_ARGS, stable_prompts
from ports import free_ports
from ranks import run_ranks
from update_cases import MAX_NEW, new_weights
from verl_helpers import check_server, wait_healthy

TP = 2
# megatron-core pads the vocab to a multiple of TP (the tiny Qwen2 has 512)
PADDED_VOCAB = 520
SEED = 5
RELEASED_SEED = 6  # the weights slime's released path sends first
REMOTE_SEED = 7  # the weights the distributed updater with the patch sends last
BUFFER_BYTES = 1 << 20  # slime's --update-weight-buffer-size, scaled to the tiny model


def companion_job(rank: int, world: int, job: dict) -> dict:
    import torch.distributed as dist
    from engine import omp_bind
    from megatron_cases import build_gpt, load_hf_weights
    from slime_client import SlimeEngine, colocated_update, start_server
    from update_cases import _forbidden_calls
    from update_checks import engine_figures

    from sglang.srt.weight_sync.remote.frameworks import slime_remote_sync
    from sglang.srt.weight_sync.slime_sync import SlimeColocatedSync

    os.environ.update(
        SGLANG_TEST_FORBIDDEN_LOG=job["forbidden_log"],
        SGLANG_TEST_FIGURES_LOG=job["figures_log"],
        SGLANG_CPU_OMP_THREADS_BIND=omp_bind(TP),
    )
    model_dir, port = job["model_dir"], job["ports"][0]
    config = tiny_models.tiny_config("qwen2")
    model = build_gpt(config, TP, 1, PADDED_VOCAB)
    load_hf_weights(model, new_weights(model_dir, SEED), config.vocab_size)
    stop = server = None
    if rank == 0:
        stop, server = start_server(model_dir, job["ports"], TP, WORKER_ENGINE_ARGS)
    record = {}
    try:
        wait_healthy(port)
        engine = SlimeEngine("127.0.0.1", port)
        group = dist.new_group(ranks=list(range(TP)), backend="gloo")
        url = f"http://127.0.0.1:{port}" if rank == 0 else None
        # slime's released colocated path first, on the same server: its bytes and seconds
        released = new_weights(model_dir, RELEASED_SEED)
        started = time.perf_counter()
        colocated_update(rank, engine, group, released, 1, BUFFER_BYTES)
        record["released_s"] = time.perf_counter() - started
        record["released_bytes"] = sum(
            t.numel() * t.element_size() for t in released.values()
        )
        # what its all_gather_param brings to this rank: the other TP ranks' shards
        record["released_gather_bytes"] = sum(
            p.numel() * p.element_size() * (TP - 1)
            for p in model.parameters()
            if getattr(p, "tensor_model_parallel", False)
        )
        sync = SlimeColocatedSync(url, list(range(TP)), group)
        started = time.perf_counter()
        if rank == 0:
            engine.pause_generation()
            engine.flush_cache()
        dist.barrier()
        before = _forbidden_calls(job["forbidden_log"])
        report = sync.update([model], config.vocab_size, "2")
        record.update(
            mode=report.mode,
            forbidden_calls=_forbidden_calls(job["forbidden_log"]) - before,
        )
        dist.barrier()
        sync.close()
        if rank == 0:
            engine.continue_generation()
        record["companion_s"] = time.perf_counter() - started
        if rank == 0:
            record["colocated"] = _server_state(engine, server, job["prompts"][SEED])
            record["figures"] = engine_figures(job["figures_log"])
        dist.barrier()
        # the distributed updater with the patch: every rank joins the weight-sync group and
        # sends its own regions (RemoteSync.update_megatron), inside slime's pause / continue
        load_hf_weights(model, new_weights(model_dir, REMOTE_SEED), config.vocab_size)
        remote = slime_remote_sync("slime", [url], "127.0.0.1")
        if rank == 0:
            engine.pause_generation()
            engine.flush_cache()
        dist.barrier()
        before = _forbidden_calls(job["forbidden_log"])
        report = remote.update_megatron([model], config.vocab_size, weight_version="3")
        record["remote_forbidden_calls"] = (
            _forbidden_calls(job["forbidden_log"]) - before
        )
        dist.barrier()
        if rank == 0:
            engine.continue_generation()
            record["remote"] = dict(
                _server_state(engine, server, job["prompts"][REMOTE_SEED]),
                success=report.success,
                message=report.message,
                engines=report.engines,
                seconds=report.seconds,
            )
        remote.close()
        dist.barrier()
    finally:
        if stop is not None:
            stop()
    return record


def _server_state(engine, server, prompts) -> dict:
    """The server after an update: greedy generation of ``prompts``, every rank's checksums,
    the weight version it reports."""
    from update_cases import checksums

    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    out = requests.post(
        f"{server.server_args.url()}/generate",
        json={"input_ids": prompts, "sampling_params": params},
        timeout=300,
    ).json()
    return dict(
        generation=[o["output_ids"] for o in out],
        params=checksums(server),
        weight_version=engine.get_weight_version(),
    )


def test_slime_companion_sends_megatron_local_parameters(tmp_path):
    model_dir, config = tiny_models.make_tiny_model("qwen2", tmp_path / "qwen2")
    prompts = {
        seed: stable_prompts([(model_dir, new_weights(model_dir, seed))], 3, MAX_NEW)
        for seed in (SEED, REMOTE_SEED)
    }
    for name in ("forbidden", "figures"):
        (tmp_path / name).mkdir()
    job = dict(
        model_dir=str(model_dir),
        ports=free_ports(3),
        prompts=prompts,
        forbidden_log=str(tmp_path / "forbidden"),
        figures_log=str(tmp_path / "figures"),
    )
    first, second = run_ranks(TP, companion_job, job, timeout=560)
    # colocated (UpdateWeightFromTensor with the patch)
    assert first["mode"] == second["mode"] == "engine", (first["mode"], second["mode"])
    assert first["forbidden_calls"] == second["forbidden_calls"] == 0
    colocated = dict(first["colocated"], seed=SEED)
    check_server(
        colocated, model_dir, config, TP, prompts, "slime companion, colocated"
    )
    assert colocated["weight_version"] == "2", colocated["weight_version"]
    figures = first["figures"]
    assert {row[1] for row in figures} == set(range(TP)), figures
    assert all(received == lower for _, _, received, lower, _ in figures), figures
    # distributed (UpdateWeightFromDistributed with the patch)
    remote = dict(first["remote"], seed=REMOTE_SEED)
    assert remote["success"], remote["message"]
    assert first["remote_forbidden_calls"] == second["remote_forbidden_calls"] == 0
    check_server(remote, model_dir, config, TP, prompts, "slime companion, distributed")
    assert remote["weight_version"] == "3", remote["weight_version"]
    (reply,) = remote["engines"].values()
    assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
    print(
        f"slime colocated, same model and server: released path all-gathers "
        f"{first['released_gather_bytes']} bytes per trainer rank and hands "
        f"{first['released_bytes']} bytes to each engine rank, in {first['released_s']:.2f} s; "
        f"companion {[(row[1], row[2]) for row in figures]} (engine rank, bytes = lower bound) "
        f"in {first['companion_s']:.2f} s. slime distributed with the patch: engine ranks "
        f"received {reply['bytes_received']} (lower bound {reply['lower_bound_bytes']}) "
        f"in {remote['seconds']:.2f} s"
    )
