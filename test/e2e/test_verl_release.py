"""verl 0.9.1's released ``ServerAdapter.update_weights`` against a real CPU HTTP server from this wheel.

Installed from PyPI (``scripts/requirements-verl.txt``, ``--no-deps``), verl's own code runs
unchanged: ``ServerAdapter`` builds its ``AsyncHttpServerAdapter`` (which 0.5.23's abstract
``begin/end_weight_update`` used to break), buckets the weights, calls
``sglang.srt.weight_sync.utils.update_weights(device_mesh_key="infer_tp")`` on every trainer
rank without opening a session (the server runs it in a one-shot session), and its leader
flushes the cache. Trainer ranks are FSDP2 (``fully_shard``, ``Shard(0)``) over gloo.

Two producers feed it, as ``FSDPEngine.get_per_tensor_param`` does: stock verl 0.9.1
(``full_tensor()`` per DTensor) and verl with ``integrations/verl/0001-fsdp-rollout-local-shards.patch``
(DTensors handed over). After each update the servers' parameters must equal SGLang's slicing
bit for bit and their greedy generation must equal HF's; with the patch no process may call
``full_tensor``/``gather_object`` and every rank must receive exactly the lower bound.

Two topologies: one server of TP 2 (the ranks beside it cover it: the engine reshards), and
verl's most common one, FSDP over all ranks feeding one TP-1 server per rank (the shards beside
a server cover half of it: the trainer ranks reshard in one hop). The second runs on every
SGLang base this project ships (``make smoke``), the releases verl pins included: its parameters
are read with ``/get_weights_by_name``, which every base serves completely at TP 1.

Stand-ins, only for what cannot run here:
* ``ServerActor``: verl finds its SGLang server as a Ray actor (``ray.get_actor``) and reports
  the step to it; the stand-in answers with the server's address.
* verl's device id: verl 0.9.1 has no CPU platform, so ``sglang_rollout.get_device_id`` is "cpu".
* verl's FSDP engine object: importing ``verl.workers.engine`` pulls in torchtitan, datasets and
  peft, so ``verl_producer`` takes the statements of ``FSDPEngine.get_per_tensor_param`` that turn
  the FSDP state dict into (name, tensor) pairs (``device = get_device_id()`` ...
  ``unfuse_moe_params(...)``) from the installed ``transformer_impl.py``, stock or with the patch
  applied (``--fuzz=0``), and runs them unchanged with the module's state dict as ``params`` and a
  stand-in ``self`` (no QAT, the model's ``model_type``).
"""

from __future__ import annotations

import os

import tiny_models
import torch
from engine import WORKER_ENGINE_ARGS, stable_prompts
from ports import free_ports
from ranks import run_ranks
from update_cases import MAX_NEW, new_weights
from update_checks import engine_figures
from verl_helpers import (
    ServerActor,
    check_server,
    give_tokenizer,
    params_at_tp1,
    verl_producer,
    verl_sources,
    wait_healthy,
)

STEPS = [("stock", 1), ("patched", 2)]


def verl_job(rank: int, world: int, job: dict):
    """One trainer rank of verl: servers of ``job["tp"]`` ranks, each started by its first rank."""
    import asyncio
    import logging

    import ray
    import torch.distributed as dist
    from engine import omp_bind
    from ranks import gathers_allowed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from update_cases import _forbidden_calls, checksums

    tp, model_dir = job["tp"], job["model_dir"]
    port = job["ports"][rank // tp]
    leader = rank % tp == 0
    cores = omp_bind(world).split(
        "|"
    )  # each trainer rank's server ranks on their own core(s)
    os.environ.update(
        RANK=str(rank),
        RAY_LOCAL_WORLD_SIZE=str(world),
        SGLANG_TEST_FORBIDDEN_LOG=job["forbidden_log"],
        SGLANG_TEST_FIGURES_LOG=job["figures_log"],
        SGLANG_CPU_OMP_THREADS_BIND="|".join(cores[rank : rank + tp]),
    )
    trainer_lines = []  # this rank's (received, lower bound) of trainer-side updates

    class _TrainerFigures(logging.Handler):
        def emit(self, record):
            report = getattr(record, "weight_update_report", None)
            if report is not None and report.mode == "trainer":
                trainer_lines.append((report.bytes_received, report.lower_bound_bytes))

    trainer_log = logging.getLogger("sglang.srt.weight_sync.trainer_flow")
    trainer_log.setLevel(logging.INFO)
    trainer_log.addHandler(_TrainerFigures())
    server = None
    if leader:
        from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter

        server = HttpServerEngineAdapter(
            model_path=model_dir,
            tp_size=tp,
            host="127.0.0.1",
            port=port,
            **WORKER_ENGINE_ARGS,
        )
    records = []
    try:  # the server is shut down whatever fails from here on
        wait_healthy(
            port
        )  # over HTTP, not a gloo barrier: the server may take minutes to start here

        from verl.workers.config import (
            CheckpointEngineConfig,
            HFModelConfig,
            RolloutConfig,
        )
        from verl.workers.rollout.sglang_rollout import sglang_rollout

        actor = ServerActor(port)
        ray.get_actor = lambda name: (
            actor
        )  # stand-in: the Ray actor of this rank's server ("sglang_server_<replica>_0")
        sglang_rollout.get_device_id = lambda: (
            "cpu"
        )  # stand-in: verl has no CPU platform
        config = RolloutConfig(
            name="sglang",
            mode="async",
            tensor_model_parallel_size=tp,
            checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=1),
        )
        mesh = init_device_mesh(
            "cpu", (world // tp, tp, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp")
        )
        adapter = sglang_rollout.ServerAdapter(
            config, HFModelConfig(path=model_dir), mesh
        )

        for step, (kind, seed) in enumerate(job["steps"], start=1):
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, torch_dtype=torch.float32
            )
            model.load_state_dict(
                {n: t.float() for n, t in new_weights(model_dir, seed).items()},
                strict=False,
            )
            fsdp_mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=fsdp_mesh)
            fully_shard(model, mesh=fsdp_mesh)
            checkpoint = list(
                new_weights(model_dir, seed)
            )  # a tied lm_head is not in it
            # Elements of each tensor verl sends that this rank does not hold. verl also sends the tied
            # lm_head.weight (in its last bucket): the engine writes it into the embedding it aliases, so
            # the embedding's missing half counts twice, once per call that names it.
            missing = {
                n: p.numel() - p.to_local().numel()
                for n, p in model.state_dict().items()
                if isinstance(p, DTensor)
            }
            gathered = sum(missing.values()) * 4  # by full_tensor() per entry, fp32
            before = _forbidden_calls(job["forbidden_log"])
            del trainer_lines[:]
            os.environ["VERL_ROLLOUT_LOCAL_SHARDS"] = "1" if kind == "patched" else "0"
            produced = verl_producer(
                job["verl_sources"][kind], model.state_dict(), model.config.model_type
            )
            update = adapter.update_weights(produced, global_steps=step)
            if kind == "stock":
                with gathers_allowed():
                    asyncio.run(update)
            else:
                asyncio.run(
                    update
                )  # trainer ranks refuse full_tensor/gather_object here
            dist.barrier()
            record = dict(
                kind=kind,
                seed=seed,
                engine_forbidden=_forbidden_calls(job["forbidden_log"]) - before,
                full_tensor_bytes=gathered if kind == "stock" else 0,
                trainer_received=[list(line) for line in trainer_lines],
                trainer_lower_bound=sum(missing.values()) * 2,
            )  # bf16 engine: the one beside, TP 1
            if leader:
                params = {
                    "max_new_tokens": MAX_NEW,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                out = server.generate(
                    input_ids=job["prompts"][seed], sampling_params=params
                )
                record["generation"] = [o["output_ids"] for o in out]
                record["params"] = (
                    checksums(server) if tp > 1 else params_at_tp1(port, checkpoint)
                )
                record["steps_reported"] = list(actor.steps)
                seen = {row[0] for r in records for row in r["figures"]}
                record["figures"] = [
                    row
                    for row in engine_figures(job["figures_log"])
                    if row[0] not in seen
                ]
            records.append(record)
    finally:
        dist.barrier()
        if server is not None:
            server.shutdown()
    return records


def test_patch_applies_to_verl_0_9_1(tmp_path):
    patched = verl_sources(tmp_path)["patched"]
    compile(patched, "transformer_impl.py", "exec")
    assert "param.to(device, non_blocking=True) if local_shards" in patched


def _run_verl(tmp_path, kind: str, tp: int, world: int = 2):
    """verl's stock and patched steps against ``world // tp`` servers of TP ``tp``; checks
    parameters and generation of every server after every step; returns every rank's records."""
    model_dir, config = tiny_models.make_tiny_model(
        kind, tmp_path / kind, vocab_size=2048
    )
    give_tokenizer(model_dir, tmp_path)
    prompts = {
        seed: stable_prompts(
            [(model_dir, new_weights(model_dir, seed))], 3, MAX_NEW, vocab_size=2048
        )
        for _, seed in STEPS
    }
    for name in ("forbidden", "figures"):
        (tmp_path / name).mkdir()
    job = dict(
        model_dir=str(model_dir),
        tp=tp,
        ports=free_ports(world // tp),
        steps=STEPS,
        prompts=prompts,
        verl_sources=verl_sources(tmp_path),
        forbidden_log=str(tmp_path / "forbidden"),
        figures_log=str(tmp_path / "figures"),
    )
    results = run_ranks(world, verl_job, job, timeout=1500, start_method="spawn")
    for server in range(world // tp):
        for step, record in enumerate(results[server * tp], start=1):
            check_server(
                record,
                model_dir,
                config,
                tp,
                prompts,
                f"{record['kind']}: server {server}",
            )
            assert (
                record["steps_reported"][-1] == step
            )  # verl's leader reported the step after its flush
        assert results[server * tp][1]["engine_forbidden"] == 0, (
            "the engine called full_tensor/gather_object"
        )
    return results


def test_verl_server_adapter_update_weights(tmp_path):
    """One server of TP 2 fed by FSDP2 over its two ranks: the engine reshards."""
    results = _run_verl(tmp_path, "qwen2", tp=2)
    stock, patched = leader = results[0]
    for record in (
        leader
    ):  # every engine rank of every bucket received exactly the bytes it lacked
        assert record["figures"] and all(
            received == lower for _, _, received, lower, _ in record["figures"]
        ), record
    gathered = [
        r[0]["full_tensor_bytes"] for r in results
    ]  # trainer ranks refused full_tensor in the patched step
    moved = {
        kind: sum(row[2] for row in record["figures"])
        for kind, record in zip(("stock", "patched"), leader)
    }
    assert moved["stock"] == 0 < moved["patched"] and all(gathered), (moved, gathered)
    print(
        f"verl 0.9.1, FSDP2 2 ranks -> SGLang TP 2: stock producer: full_tensor() all-gathered {gathered} bytes "
        f"into the trainer ranks, engine ranks received 0; patched: no full_tensor, engine ranks received "
        f"{moved['patched']} bytes in all (= lower bound), {len(patched['figures'])} (rank, bucket) records"
    )


def test_verl_server_adapter_two_servers_of_tp1(tmp_path):
    """FSDP2 over two ranks, one TP-1 server per rank (Llama: ``/get_weights_by_name`` serves
    it on every base): with the patch the trainer ranks reshard in one hop, each receiving, in
    bf16, exactly the half of every tensor verl names that its server lacks (the tied
    ``lm_head.weight`` names the embedding a second time); the servers only copy."""
    results = _run_verl(tmp_path, "llama", tp=1)
    for rank, (stock, patched) in enumerate(results):
        assert stock["full_tensor_bytes"] > 0 and not stock["trainer_received"], stock[
            "trainer_received"
        ]
        assert patched["trainer_received"], (
            f"rank {rank}: the patched step did not reshard on the trainer side"
        )
        received = sum(r for r, _ in patched["trainer_received"])
        assert all(r == lower for r, lower in patched["trainer_received"]), patched[
            "trainer_received"
        ]
        assert received == patched["trainer_lower_bound"] > 0, (
            rank,
            received,
            patched["trainer_lower_bound"],
        )
        assert not patched.get("figures") or all(
            row[2] == 0 for row in patched["figures"]
        ), patched["figures"]
    print(
        "verl 0.9.1, FSDP2 2 ranks -> 2 SGLang servers of TP 1: stock producer: full_tensor() all-gathered "
        f"{[r[0]['full_tensor_bytes'] for r in results]} bytes; patched: trainer-side one hop, trainer ranks "
        f"received {[sum(x for x, _ in r[1]['trainer_received']) for r in results]} bytes (= lower bound)"
    )
