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
import subprocess
import time
from pathlib import Path

import tiny_models
import torch
from engine import WORKER_ENGINE_ARGS, hf_greedy, stable_prompts
from ports import free_ports
from ranks import run_ranks
from test_distributed_update import expected_checksums
from update_cases import MAX_NEW, checksum, new_weights

PATCH = (
    Path(__file__).resolve().parents[2]
    / "integrations"
    / "verl"
    / "0001-fsdp-rollout-local-shards.patch"
)
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
    src = (
        Path(verl.__file__).parent
        / "workers"
        / "engine"
        / "fsdp"
        / "transformer_impl.py"
    )
    return {
        "stock": src.read_text(),
        "patched": patched_copy(
            src, "verl/workers/engine/fsdp", tmp_path, PATCH, "verl 0.9.1"
        ),
    }


def patched_copy(
    src: Path, package_dir: str, tmp_path: Path, patch: Path, what: str
) -> str:
    """``src`` (a framework's installed file, at ``package_dir`` in its tree) with ``patch``
    applied to a copy with ``--fuzz=0``; fails when it does not apply."""
    copy = tmp_path / package_dir
    copy.mkdir(parents=True)
    shutil.copy(src, copy)
    applied = subprocess.run(
        ["patch", "-d", str(tmp_path), "-p1", "--fuzz=0", "-i", str(patch)],
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, (
        f"{patch.name} does not apply to {what}:\n{applied.stdout}{applied.stderr}"
    )
    return (copy / src.name).read_text()


def _verl_producer(source: str, params: dict, model_type: str):
    """(name, tensor) pairs as ``FSDPEngine.get_per_tensor_param`` of ``source`` makes them for a
    plain (non-LoRA) model: the statements of that branch, compiled from verl's file and run here."""
    import ast
    import importlib.util
    from types import SimpleNamespace

    import verl
    from torch.distributed.tensor import DTensor

    engine = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "FSDPEngine"
    )
    method = next(
        n
        for n in engine.body
        if isinstance(n, ast.FunctionDef) and n.name == "get_per_tensor_param"
    )
    branch = next(
        n.orelse
        for n in ast.walk(method)
        if isinstance(n, ast.If)
        and any(
            isinstance(s, ast.Assign)
            and getattr(s.targets[0], "id", None) == "per_tensor_param"
            for s in n.orelse
        )
    )
    code = compile(
        ast.Module(body=branch, type_ignores=[]),
        "verl/workers/engine/fsdp/transformer_impl.py",
        "exec",
    )
    utils = Path(verl.__file__).parent / "workers" / "engine" / "fsdp" / "utils.py"
    spec = importlib.util.spec_from_file_location("verl_fsdp_engine_utils", utils)
    fsdp_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(
        fsdp_utils
    )  # the file alone: its package __init__ is the heavy import
    scope = dict(
        os=os,
        DTensor=DTensor,
        params=params,
        get_device_id=lambda: "cpu",
        unfuse_moe_params=fsdp_utils.unfuse_moe_params,
        self=SimpleNamespace(
            _qat_enabled=False,
            model_config=SimpleNamespace(
                hf_config=SimpleNamespace(model_type=model_type)
            ),
        ),
    )
    exec(code, scope)
    return scope["per_tensor_param"]


def _wait_healthy(port: int, timeout: float = 900) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if (
                requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
                == 200
            ):
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"no SGLang server on port {port} after {timeout} s")


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
    from update_cases import _checksums, _forbidden_calls

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
        _wait_healthy(
            port
        )  # over HTTP, not a gloo barrier: the server may take minutes to start here

        from verl.workers.config import (
            CheckpointEngineConfig,
            HFModelConfig,
            RolloutConfig,
        )
        from verl.workers.rollout.sglang_rollout import sglang_rollout

        actor = _ServerActor(port)
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
            produced = _verl_producer(
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
                    _checksums(server) if tp > 1 else _params_at_tp1(port, checkpoint)
                )
                record["steps_reported"] = list(actor.steps)
                seen = {row[0] for r in records for row in r["figures"]}
                record["figures"] = [
                    row
                    for row in _figures(Path(job["figures_log"]))
                    if row[0] not in seen
                ]
            records.append(record)
    finally:
        dist.barrier()
        if server is not None:
            server.shutdown()
    return records


def _params_at_tp1(port: int, names) -> dict:
    """Every HF tensor of a TP-1 server, read back with SGLang's ``/get_weights_by_name`` (its
    parameter, or its region of a fused one, in fp32: exact for bf16), as tensor hashes."""
    import requests

    out = {}
    for name in names:
        reply = requests.post(
            f"http://127.0.0.1:{port}/get_weights_by_name",
            json={"name": name, "truncate_size": 1 << 30},
            timeout=60,
        )
        assert reply.status_code == 200, (
            f"/get_weights_by_name {name}: {reply.status_code} {reply.text[:200]}"
        )
        out[name] = checksum(torch.tensor(reply.json(), dtype=torch.float32))
    return {0: out}


def check_server(
    record: dict, model_dir, config, tp: int, prompts: dict, what: str
) -> None:
    """A server after the update of ``record["seed"]``'s weights: every rank's parameters
    (``record["params"]``: ``_checksums`` at TP > 1, ``_params_at_tp1`` at TP 1) equal
    SGLang's slicing bit for bit, and greedy generation equals HF transformers'."""
    weights = new_weights(model_dir, record["seed"])
    if tp > 1:
        expected = expected_checksums(config, weights, tp, 1)
    else:
        expected = {
            0: {n: checksum(t.to(torch.bfloat16).float()) for n, t in weights.items()}
        }
    for r in range(tp):
        wrong = sorted(
            n for n in expected[r] if record["params"][r][n] != expected[r][n]
        )
        assert not wrong, (
            f"{what}: rank {r} parameters differ from SGLang's slicing: {wrong[:5]}"
        )
    assert record["generation"] == hf_greedy(
        model_dir, prompts[record["seed"]], MAX_NEW, weights=weights
    ), f"{what}: generation differs from HF transformers"


def _figures(directory: Path):
    rows = []
    for f in directory.iterdir():
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def test_patch_applies_to_verl_0_9_1(tmp_path):
    patched = _verl_sources(tmp_path)["patched"]
    compile(patched, "transformer_impl.py", "exec")
    assert "param.to(device, non_blocking=True) if local_shards" in patched


def _give_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    """verl's ``HFModelConfig`` loads a tokenizer, which the tiny checkpoints lack (the servers take
    token ids): save the one ``transformers`` builds for a tiny Qwen2 directory (for a tiny Llama
    it builds none); nothing here uses it."""
    from transformers import AutoTokenizer

    qwen2_dir, _ = tiny_models.make_tiny_model(
        "qwen2", tmp_path / "tokenizer", vocab_size=2048
    )
    AutoTokenizer.from_pretrained(qwen2_dir).save_pretrained(model_dir)


def _run_verl(tmp_path, kind: str, tp: int, world: int = 2):
    """verl's stock and patched steps against ``world // tp`` servers of TP ``tp``; checks
    parameters and generation of every server after every step; returns every rank's records."""
    model_dir, config = tiny_models.make_tiny_model(
        kind, tmp_path / kind, vocab_size=2048
    )
    _give_tokenizer(model_dir, tmp_path)
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
        verl_sources=_verl_sources(tmp_path),
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
