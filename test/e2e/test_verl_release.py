"""verl 0.9.1's released ``ServerAdapter.update_weights`` against a real CPU HTTP server from this wheel.

Installed from PyPI (``scripts/requirements-verl.txt``, ``--no-deps``), verl's own code runs
unchanged: ``ServerAdapter`` builds its ``AsyncHttpServerAdapter`` (which 0.5.23's abstract
``begin/end_weight_update`` used to break), buckets the weights, calls
``sglang.srt.weight_sync.utils.update_weights(device_mesh_key="infer_tp")`` on every trainer
rank without opening a session (the server runs it in a one-shot session), and its leader
flushes the cache. Trainer ranks are FSDP2 (``fully_shard``, ``Shard(0)``) over gloo.

Two producers feed it, as ``FSDPEngine.get_per_tensor_param`` does: stock verl 0.9.1
(``full_tensor()`` per DTensor) and verl with ``integrations/verl/0001-fsdp-rollout-local-shards.patch``
(DTensors handed over). After each update the server's parameters must equal SGLang's slicing
bit for bit and its greedy generation must equal HF's; with the patch no process may call
``full_tensor``/``gather_object`` and every engine rank must receive exactly the lower bound.

Stand-ins, only for what cannot run here:
* ``_ServerActor``: verl finds its SGLang server as a Ray actor (``ray.get_actor``) and reports
  the step to it; the stand-in answers with the server's address.
* verl's device id: verl 0.9.1 has no CPU platform, so ``sglang_rollout.get_device_id`` is "cpu".
* verl's FSDP engine object: importing ``verl.workers.engine`` pulls in torchtitan, datasets and
  peft, so ``_verl_producer`` takes the statements of ``FSDPEngine.get_per_tensor_param`` that turn
  the FSDP state dict into (name, tensor) pairs (``device = get_device_id()`` ...
  ``unfuse_moe_params(...)``) from the installed ``transformer_impl.py``, stock or with the patch
  applied (``--fuzz=0``), and runs them unchanged with the module's state dict as ``params`` and a
  stand-in ``self`` (no QAT, the model's ``model_type``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import torch

import tiny_models
from engine import hf_greedy, stable_prompts
from ranks import run_ranks
from test_distributed_update import expected_checksums
from update_cases import MAX_NEW, new_weights

PATCH = Path(__file__).resolve().parents[2] / "integrations" / "verl" / "0001-fsdp-rollout-local-shards.patch"
STEPS = [("stock", 1), ("patched", 2)]


class _Remote:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)

        return call()


class _ServerActor:
    """Stand-in for verl's SGLang server Ray actor."""

    def __init__(self, port: int):
        self.steps = []
        self.get_server_address = _Remote(lambda: ("127.0.0.1", port))
        self.set_global_steps = _Remote(self.steps.append)


def _verl_sources(tmp_path: Path) -> dict:
    """verl 0.9.1's installed ``transformer_impl.py``, as released ("stock") and with the companion
    patch applied with ``--fuzz=0`` ("patched")."""
    import verl

    assert verl.__version__ == "0.9.1", verl.__version__
    src = Path(verl.__file__).parent / "workers" / "engine" / "fsdp" / "transformer_impl.py"
    copy = tmp_path / "verl" / "workers" / "engine" / "fsdp"
    copy.mkdir(parents=True)
    shutil.copy(src, copy)
    applied = subprocess.run(["patch", "-d", str(tmp_path), "-p1", "--fuzz=0", "-i", str(PATCH)],
                             capture_output=True, text=True)
    assert applied.returncode == 0, f"{PATCH.name} does not apply to verl 0.9.1:\n{applied.stdout}{applied.stderr}"
    return {"stock": src.read_text(), "patched": (copy / "transformer_impl.py").read_text()}


def _verl_producer(source: str, params: dict, model_type: str):
    """(name, tensor) pairs as ``FSDPEngine.get_per_tensor_param`` of ``source`` makes them for a
    plain (non-LoRA) model: the statements of that branch, compiled from verl's file and run here."""
    import ast
    import importlib.util
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    import verl

    engine = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "FSDPEngine")
    method = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "get_per_tensor_param")
    branch = next(n.orelse for n in ast.walk(method) if isinstance(n, ast.If) and any(
        isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == "per_tensor_param" for s in n.orelse))
    code = compile(ast.Module(body=branch, type_ignores=[]), "verl/workers/engine/fsdp/transformer_impl.py", "exec")
    utils = Path(verl.__file__).parent / "workers" / "engine" / "fsdp" / "utils.py"
    spec = importlib.util.spec_from_file_location("verl_fsdp_engine_utils", utils)
    fsdp_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsdp_utils)  # the file alone: its package __init__ is the heavy import
    scope = dict(os=os, DTensor=DTensor, params=params, get_device_id=lambda: "cpu",
                 unfuse_moe_params=fsdp_utils.unfuse_moe_params,
                 self=SimpleNamespace(_qat_enabled=False,
                                      model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))))
    exec(code, scope)
    return scope["per_tensor_param"]


def _wait_healthy(port: int, timeout: float = 900) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"no SGLang server on port {port} after {timeout} s")


def verl_job(rank: int, world: int, job: dict):
    import asyncio

    import ray
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from engine import omp_bind
    from ranks import gathers_allowed
    from update_cases import _checksums, _forbidden_calls

    os.environ.update(RANK=str(rank), RAY_LOCAL_WORLD_SIZE=str(world), SGLANG_TEST_FORBIDDEN_LOG=job["forbidden_log"],
                      SGLANG_TEST_FIGURES_LOG=job["figures_log"], SGLANG_CPU_OMP_THREADS_BIND=omp_bind(world))
    model_dir, port = job["model_dir"], job["port"]
    server = None
    if rank == 0:
        from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter

        server = HttpServerEngineAdapter(
            model_path=model_dir, tp_size=world, host="127.0.0.1", port=port, device="cpu",
            attention_backend="torch_native", skip_tokenizer_init=True, mem_fraction_static=0.05,
            max_total_tokens=4096, disable_cuda_graph=True, random_seed=0, log_level="error")
    _wait_healthy(port)  # over HTTP, not a gloo barrier: the server may take minutes to start here

    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.sglang_rollout import sglang_rollout

    actor = _ServerActor(port)
    ray.get_actor = lambda name: actor  # stand-in: the Ray actor
    sglang_rollout.get_device_id = lambda: "cpu"  # stand-in: verl has no CPU platform
    config = RolloutConfig(name="sglang", mode="async", tensor_model_parallel_size=world,
                           checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=1))
    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))
    adapter = sglang_rollout.ServerAdapter(config, HFModelConfig(path=model_dir), mesh)

    records = []
    try:
        for step, (kind, seed) in enumerate(job["steps"], start=1):
            model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            model.load_state_dict({n: t.float() for n, t in new_weights(model_dir, seed).items()}, strict=False)
            fsdp_mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=fsdp_mesh)
            fully_shard(model, mesh=fsdp_mesh)
            gathered = sum((p.numel() - p.to_local().numel()) * p.element_size()
                           for p in model.state_dict().values() if isinstance(p, DTensor))
            before = _forbidden_calls(job["forbidden_log"])
            os.environ["VERL_ROLLOUT_LOCAL_SHARDS"] = "1" if kind == "patched" else "0"
            produced = _verl_producer(job["verl_sources"][kind], model.state_dict(), model.config.model_type)
            update = adapter.update_weights(produced, global_steps=step)
            if kind == "stock":
                with gathers_allowed():
                    asyncio.run(update)
            else:
                asyncio.run(update)  # trainer ranks refuse full_tensor/gather_object here
            dist.barrier()
            record = dict(kind=kind, seed=seed, engine_forbidden=_forbidden_calls(job["forbidden_log"]) - before,
                          full_tensor_bytes=gathered if kind == "stock" else 0)
            if rank == 0:
                params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
                out = server.generate(input_ids=job["prompts"][seed], sampling_params=params)
                record["generation"] = [o["output_ids"] for o in out]
                record["checksums"] = _checksums(server)
                record["steps_reported"] = list(actor.steps)
                seen = {row[0] for r in records for row in r["figures"]}
                record["figures"] = [row for row in _figures(Path(job["figures_log"])) if row[0] not in seen]
            records.append(record)
    finally:
        dist.barrier()
        if server is not None:
            server.shutdown()
    return records


def _figures(directory: Path):
    rows = []
    for f in directory.iterdir():
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def test_patch_applies_to_verl_0_9_1(tmp_path):
    patched = _verl_sources(tmp_path)["patched"]
    compile(patched, "transformer_impl.py", "exec")
    assert "param.to(device, non_blocking=True) if local_shards" in patched


def test_verl_server_adapter_update_weights(tmp_path):
    model_dir, config = tiny_models.make_tiny_model("qwen2", tmp_path / "qwen2", vocab_size=2048)
    prompts = {seed: stable_prompts([(model_dir, new_weights(model_dir, seed))], 3, MAX_NEW, vocab_size=2048)
               for _, seed in STEPS}
    for name in ("forbidden", "figures"):
        (tmp_path / name).mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = dict(model_dir=str(model_dir), port=port, steps=STEPS, prompts=prompts, verl_sources=_verl_sources(tmp_path),
               forbidden_log=str(tmp_path / "forbidden"), figures_log=str(tmp_path / "figures"))
    results = run_ranks(2, verl_job, job, timeout=1500, start_method="spawn")
    leader = results[0]
    for step, record in enumerate(leader, start=1):
        weights = new_weights(model_dir, record["seed"])
        expected = expected_checksums(config, weights, 2, 1)
        for r in range(2):
            wrong = sorted(n for n in expected[r] if record["checksums"][r][n] != expected[r][n])
            assert not wrong, f"{record['kind']}: engine rank {r} parameters differ from SGLang's slicing: {wrong[:5]}"
        assert record["generation"] == hf_greedy(model_dir, prompts[record["seed"]], MAX_NEW, weights=weights)
        assert record["steps_reported"][-1] == step  # verl's leader reported the step after its flush
    stock, patched = leader
    for record in leader:  # every engine rank of every bucket received exactly the bytes it lacked
        assert record["figures"] and all(received == lower for _, _, received, lower, _ in record["figures"]), record
    assert patched["engine_forbidden"] == 0, "the engine called full_tensor/gather_object"
    gathered = [r[0]["full_tensor_bytes"] for r in results]  # trainer ranks refused full_tensor in the patched step
    moved = {kind: sum(row[2] for row in record["figures"]) for kind, record in zip(("stock", "patched"), leader)}
    assert moved["stock"] == 0 < moved["patched"] and all(gathered), (moved, gathered)
    print(f"verl 0.9.1, FSDP2 2 ranks -> SGLang TP 2: stock producer: full_tensor() all-gathered {gathered} bytes "
          f"into the trainer ranks, engine ranks received 0; patched: no full_tensor, engine ranks received "
          f"{moved['patched']} bytes in all (= lower bound), {len(patched['figures'])} (rank, bucket) records")
