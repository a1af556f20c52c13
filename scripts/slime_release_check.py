"""slime's released update code, run unchanged against this wheel on CPU (by hand, not in CI).

    python scripts/slime_release_check.py --slime /tmp/slime-src               # as released
    python scripts/slime_release_check.py --slime /tmp/slime-patched --companion

``--slime`` is a checkout of THUDM/slime (issue 40 names ``624b824``) outside this repository;
it goes on ``sys.path`` and its modules are imported from there, never copied. ``--companion``
needs ``integrations/slime/0001-megatron-weight-sync.patch`` applied to that checkout (as
``docs/frameworks/slime.md`` tells a user) and sets ``SLIME_SGLANG_WEIGHT_SYNC=1``.

Two trainer ranks (gloo) each hold a real megatron-core ``GPTModel`` at TP 2 (tiny Qwen2,
``test/e2e/megatron_cases.py``); rank 0 starts a TP-2 CPU server with slime's own
``SGLangEngine.init`` (``_compute_server_args`` through ``dataclasses.fields(ServerArgs)``, the
CPU settings passed as slime's ``--sglang-*`` arguments, ``launch_server_process``). Then, one
version each, the weights the model holds before the update being a new "trained" step:

* ``tensor``: slime's ``UpdateWeightFromTensor`` (``connect_rollout_engines``, ``update_weights``:
  pause, flush, its HF iterator's TP all-gather and ``convert_to_hf``, ``FlattenedTensorBucket``,
  ``gather_object``, ``update_weights_from_tensor(load_format="flattened_bucket")``, continue);
* ``distributed``: slime's ``UpdateWeightFromDistributed`` (``init_weights_update_group`` through
  slime's ``init_process_group``, ``all_gather_param``, rank 0's broadcast with
  ``update_weights_from_distributed``, ``disconnect_rollout_engines``);
* ``disk``: slime's ``UpdateWeightFromDisk`` (``save_hf_model_to_path``) and then
  ``RayTrainGroup._reload_rollout_weights_from_disk`` (pause, flush,
  ``update_weights_from_disk``, its ``--ci-test`` version check, continue).

With ``--companion`` the same two updaters run their patched lines (``SlimeColocatedSync``,
``slime_remote_sync``) and the disk path stays as released.

Checked after each: every TP rank's parameter checksums (SGLang's own weight checker) and greedy
generation equal those of a freshly started server of the same weights (slime's launcher again,
from a checkpoint of them), ``SGLangEngine.get_weight_version()`` equal to the version slime
sent. With ``--companion``: no ``gather_object``/``all_gather_object``/``full_tensor`` and no
``all_gather`` byte on any trainer rank during the update (the trainer ranks refuse the former
and count the latter), and each engine rank received exactly its lower bound of bytes.

Stand-ins, only at the boundaries slime cannot cross on a CPU machine:

* Ray: engine handles are the real ``SGLangEngine`` objects behind a shim whose
  ``method.remote(...)`` runs the method in a thread; ``ray.get`` waits for those calls;
  ``get_node_ip_address`` answers 127.0.0.1; the rollout lock and rollout manager are plain
  objects. Rank 1 holds a handle that refuses every call: slime calls engines from rank 0 only.
* slime's accelerator: it registers CUDA and MUSA only; a CPU backend is registered through its
  own ``register_accelerator`` (``SLIME_ACCELERATOR=cpu``, gloo as the weight-update backend).
* ``TensorBackuper``: its ``backup`` pins host memory (CUDA only); ``weights_getter`` returns the
  same dict, ``named_params_and_buffers(convert_to_global_name=True)`` copied unpinned.
* CUDA IPC: CPU tensors are shared through torch's ``file_system`` strategy, and SGLang's
  ``monkey_patch_torch_reductions`` (which slime calls; it swaps a CUDA tensor's device index
  for its GPU's UUID and fails on a CPU tensor) is marked as already applied.
* slime's Megatron actor (training, ``MegatronTrainRayActor.init``): the model is built and
  loaded as ``test/e2e/megatron_cases.py`` does (Megatron-LM's ``get_model``, which slime
  calls, is not in megatron-core: its default tensor-parallel attributes are set as it sets
  them), with TransformerEngine's parameter names
  (``layer_norm_weight`` fused into ``linear_qkv``/``linear_fc1``: slime converts only those;
  a CPU module in TE's place, ``_te_named_spec``), in a wrapper with megatron DDP's ``module``
  and ``config`` (slime's names start ``module.module.``) but not its gradient buffers; the
  updaters get what the actor hands them.

Prints one JSON object (per path: seconds, bytes, checks) and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

__all__ = ("main",)

ROOT = Path(__file__).resolve().parent.parent
TP = 2
PADDED_VOCAB = 520  # megatron-core pads the tiny Qwen2's 512 rows to a multiple of TP
SEEDS = {
    "tensor": 1,
    "distributed": 2,
    "disk": 1,
}  # two weights, each path changes the last
BUFFER_BYTES = 1 << 17  # --update-weight-buffer-size: several chunks of the tiny model


def _support_paths() -> None:
    for folder in (ROOT / "test" / "e2e", ROOT / "test" / "support"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    if str(ROOT) not in sys.path:  # benchmark.weight_sync.hand_rules, for update_checks
        sys.path.append(str(ROOT))


# --- stand-ins (see the module docstring) ---------------------------------------------------


class _Remote:
    """``handle.method``: ``.remote(...)`` runs it in a thread and returns a future."""

    def __init__(self, fn: Callable, pool: ThreadPoolExecutor):
        self._fn, self._pool = fn, pool

    def remote(self, *args, **kwargs) -> Future:
        return self._pool.submit(self._fn, *args, **kwargs)


class _Handle:
    """A Ray actor handle's calling convention over a local object (None: refuses calls)."""

    def __init__(self, obj: Any, pool: ThreadPoolExecutor, owner: str):
        self._obj, self._pool, self._owner = obj, pool, owner

    def __getattr__(self, name: str) -> _Remote:
        if self._obj is None:
            raise AssertionError(
                f"{self._owner} called engine.{name}: slime calls engines from rank 0"
            )
        return _Remote(getattr(self._obj, name), self._pool)


def _ray_get(refs):
    return [r.result() for r in refs] if isinstance(refs, list) else refs.result()


class _Lock:
    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        return None


class _RolloutManager:
    def __init__(self, engines: List[_Handle], lock: _Handle):
        self._engines, self._lock = engines, lock

    def get_updatable_engines_and_lock(self):
        return self._engines, self._lock

    def onload_weights(self) -> None:
        return None


def _install_stand_ins() -> None:
    """Ray's calls, slime's CPU accelerator and the CPU form of CUDA IPC, in this process."""
    import ray
    import ray._private.services
    import torch
    import torch.multiprocessing
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator
    from torch.multiprocessing import reductions

    class CpuAccelerator(Accelerator):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            return None

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            return None

        def current_stream(self, device=None):
            return None

        def empty_cache(self) -> None:
            return None

        def ipc_collect(self) -> None:
            return None

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

    os.environ["SLIME_ACCELERATOR"] = "cpu"
    accelerator.register_accelerator(
        "cpu", CpuAccelerator, lambda: True, communication_backends=("gloo",)
    )
    accelerator.reset_accelerator()
    ray.get = _ray_get
    ray._private.services.get_node_ip_address = lambda *a, **k: "127.0.0.1"
    torch.multiprocessing.set_sharing_strategy("file_system")
    # SGLang's monkey_patch_torch_reductions (slime calls it) rewrites a CUDA tensor's device
    # index into its GPU's UUID and fails on a CPU tensor's shorter reduction: mark it done
    reductions._reduce_tensor_original = reductions.reduce_tensor


# --- slime's arguments -------------------------------------------------------------------------


def _slime_args(job: dict, hf_checkpoint: str) -> SimpleNamespace:
    """The fields of slime's parsed arguments its engine and updaters read, for this run."""
    import tiny_models
    from engine import WORKER_ENGINE_ARGS

    config = tiny_models.tiny_config("qwen2")
    args = SimpleNamespace(
        hf_checkpoint=hf_checkpoint,
        model_name=None,
        seed=0,
        colocate=True,
        debug_rollout_only=False,
        num_gpus_per_node=TP,
        rollout_num_gpus_per_engine=TP,
        actor_num_nodes=1,
        actor_num_gpus_per_node=TP,
        offload_rollout=False,
        rollout_external=False,
        sglang_router_ip=None,
        sglang_router_port=None,
        sglang_pp_size=1,
        sglang_dp_size=1,
        sglang_ep_size=1,
        use_rollout_routing_replay=False,
        fp16=False,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        q_lora_rank=None,
        num_experts=None,
        update_weight_buffer_size=BUFFER_BYTES,
        update_weight_mode="full",
        update_weight_disk_dir=job["disk_dir"],
        update_weight_local_checkpoint_dir=None,
        update_weight_disk_keep_files=False,
        custom_update_weight_post_write_path=None,
        ci_test=True,
    )
    for name, value in WORKER_ENGINE_ARGS.items():  # slime's --sglang-<field> arguments
        setattr(
            args, f"sglang_{name}", value
        )  # (random_seed: slime sets it from --seed)
    return args


def _start_engine(args, ports: List[int]):
    """slime's ``SGLangEngine`` started by its own ``init`` (rank 0 of one engine)."""
    from engine import omp_bind
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(TP)
    engine = SGLangEngine(args, rank=0)
    port, nccl_port, dist_port = ports
    engine.init(
        dist_init_addr=f"127.0.0.1:{dist_port}",
        port=port,
        nccl_port=nccl_port,
        host="127.0.0.1",
    )
    return engine


def _server_state(engine, prompts) -> dict:
    """Checksums of every TP rank's parameters, greedy generation, the reported version."""
    import requests
    from slime_client import ServerAddress
    from update_cases import MAX_NEW, checksums

    url = engine.get_url()
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    out = requests.post(
        f"{url}/generate",
        json={"input_ids": prompts, "sampling_params": params},
        timeout=300,
    )
    out.raise_for_status()
    return dict(
        params=checksums(ServerAddress(SimpleNamespace(url=lambda: url))),
        generation=[o["output_ids"] for o in out.json()],
        weight_version=engine.get_weight_version(),
    )


# --- what each trainer rank runs ---------------------------------------------------------------


class _Counters:
    """Bytes each trainer rank's ``all_gather`` brought in, of its ``broadcast`` calls (any
    group, sent or received), and of the flattened buckets slime built, while counting is on
    (spies: the calls still run)."""

    def __init__(self):
        import torch.distributed as dist
        from slime.backends.megatron_utils.update_weight import (
            update_weight_from_tensor as uwt,
        )

        self.on, self.gathered, self.broadcast, self.bucketed = False, 0, 0, 0
        gather, broadcast, build = (
            dist.all_gather,
            dist.broadcast,
            uwt._build_flattened_tensor_data,
        )

        def all_gather(outputs, tensor, *a, **k):
            if self.on:
                self.gathered += (
                    sum(t.numel() * t.element_size() for t in outputs)
                    - tensor.numel() * tensor.element_size()
                )
            return gather(outputs, tensor, *a, **k)

        def bcast(tensor, *a, **k):
            if self.on:
                self.broadcast += tensor.numel() * tensor.element_size()
            return broadcast(tensor, *a, **k)

        def build_bucket(named):
            data = build(named)
            if self.on:
                self.bucketed += (
                    data["flattened_tensor"].numel()
                    * data["flattened_tensor"].element_size()
                )
            return data

        dist.all_gather, dist.broadcast, uwt._build_flattened_tensor_data = (
            all_gather,
            bcast,
            build_bucket,
        )

    def start(self) -> None:
        self.on, self.gathered, self.broadcast, self.bucketed = True, 0, 0, 0

    def stop(self) -> dict:
        self.on = False
        return dict(
            all_gather_bytes=self.gathered,
            broadcast_bytes=self.broadcast,
            bucket_bytes=self.bucketed,
        )


def _te_named_spec():
    """The local layer spec with TransformerEngine's parameter names: the input and pre-MLP
    norms fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight`` (slime's
    ``convert_qwen2_to_hf`` knows only these names; TE itself needs CUDA)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TE's ``TELayerNormColumnParallelLinear`` on CPU: RMSNorm, then the column-parallel matmul."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(
                torch.ones(input_size, dtype=config.params_dtype)
            )
            self.layer_norm_weight.tensor_model_parallel = False
            self.eps = config.layernorm_epsilon

        def forward(self, x, *args, **kwargs):
            variance = x.float().pow(2).mean(-1, keepdim=True)
            x = (x.float() * torch.rsqrt(variance + self.eps)).to(
                x.dtype
            ) * self.layer_norm_weight
            return super().forward(x, *args, **kwargs)

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = LayerNormColumnParallelLinear
    layer.mlp.submodules.linear_fc1 = LayerNormColumnParallelLinear
    return spec


def _DDPLike(gpt):
    """The model chunk as Megatron-LM's ``get_model`` hands it to slime: every parameter given
    the default tensor-parallel attributes, wrapped as its DDP wraps it (``module.module.``
    names, ``.config``), without DDP's gradient buffers."""
    import torch
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )

    for param in gpt.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    class DDPLike(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.config = module, module.config

    return DDPLike(gpt)


def slime_job(rank: int, world: int, job: dict) -> dict:
    """One trainer rank: slime's engine (rank 0) and its three updaters, one version each."""
    sys.path.insert(0, job["slime"])
    _support_paths()
    _install_stand_ins()
    import tiny_models
    import torch.distributed as dist
    from megatron_cases import build_gpt, load_hf_weights
    from ranks import gathers_allowed
    from slime.backends.megatron_utils.update_weight.common import (
        named_params_and_buffers,
    )
    from slime.backends.megatron_utils.update_weight.update_weight_from_disk import (
        UpdateWeightFromDisk,
    )
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import (
        UpdateWeightFromDistributed,
    )
    from slime.backends.megatron_utils.update_weight.update_weight_from_tensor import (
        UpdateWeightFromTensor,
    )
    from slime.ray.actor_group import RayTrainGroup
    from slime.utils.distributed_utils import init_gloo_group
    from update_cases import _forbidden_calls, new_weights
    from update_checks import engine_figures

    os.environ.update(
        SGLANG_TEST_FORBIDDEN_LOG=job["forbidden_log"],
        SGLANG_TEST_FIGURES_LOG=job["figures_log"],
    )
    with gathers_allowed():
        init_gloo_group()
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ray-stand-in")
    model_dir = job["model_dir"]
    config = tiny_models.tiny_config("qwen2")
    args = _slime_args(job, model_dir)
    model = _DDPLike(
        build_gpt(config, TP, 1, PADDED_VOCAB, layer_spec=_te_named_spec())
    )
    load_hf_weights(model, tiny_models.load_checkpoint(model_dir), config.vocab_size)
    counters = _Counters()
    engine = None
    record: Dict[str, Any] = {"paths": {}}
    try:
        if rank == 0:
            started = time.perf_counter()
            engine = _start_engine(args, job["ports"][:3])
            record["launch_s"] = time.perf_counter() - started
        dist.barrier()
        handle = _Handle(engine, pool, f"rank {rank}")
        lock = _Handle(_Lock(), pool, "lock")

        def weights_getter():  # TensorBackuper.get("actor"), unpinned
            return {
                n: p.detach().clone()
                for n, p in named_params_and_buffers(
                    args, [model], convert_to_global_name=True
                )
            }

        version = 0
        for kind, seed in SEEDS.items():
            load_hf_weights(
                model, new_weights(model_dir, seed), config.vocab_size
            )  # the "trained" step
            cls = {
                "tensor": UpdateWeightFromTensor,
                "distributed": UpdateWeightFromDistributed,
                "disk": UpdateWeightFromDisk,
            }[kind]
            with gathers_allowed():  # slime's construction exchanges parameter metadata
                updater = cls(
                    args,
                    [model],
                    weights_getter,
                    model_name="qwen2",
                    quantization_config=None,
                )
                updater.weight_version = (
                    version  # update_weight_start_version, as the actor sets it
                )
                updater.connect_rollout_engines([handle], lock, engine_gpu_counts=[TP])
            dist.barrier()
            spied = _spy_report(updater)
            before = _forbidden_calls(job["forbidden_log"])
            figures_before = len(engine_figures(job["figures_log"])) if rank == 0 else 0
            released = not job["companion"] or kind == "disk"
            counters.start()
            started = time.perf_counter()
            if released:
                with gathers_allowed():  # slime's released paths gather on purpose
                    updater.update_weights()
            else:
                updater.update_weights()  # trainer ranks refuse gather_object / full_tensor here
            if kind == "disk" and rank == 0:
                version_dir = (
                    Path(args.update_weight_disk_dir)
                    / f"weight_v{updater.weight_version:06d}"
                )
                written = sum(
                    f.stat().st_size for f in version_dir.glob("*.safetensors")
                )
                fake_group = SimpleNamespace(
                    args=args,
                    _rollout_manager=_Handle(
                        _RolloutManager([handle], lock), pool, "manager"
                    ),
                )
                RayTrainGroup._reload_rollout_weights_from_disk(
                    fake_group, version_dir, str(updater.weight_version)
                )
            dist.barrier()
            seconds = time.perf_counter() - started
            moved = counters.stop()
            version = updater.weight_version
            forbidden = _forbidden_calls(job["forbidden_log"]) - before
            path = dict(
                seed=seed,
                version=str(version),
                seconds=seconds,
                forbidden_calls=forbidden,
                **moved,
            )
            if kind == "distributed":
                if job["companion"]:
                    path["report"] = spied.get("report")
                updater.disconnect_rollout_engines()  # patched: leaves SGLang's group
            if rank == 0:
                path["state"] = _server_state(engine, job["prompts"][seed])
                if kind == "disk":
                    path["written_bytes"] = written
                path["figures"] = engine_figures(job["figures_log"])[figures_before:]
            record["paths"][kind] = path
            dist.barrier()
        if rank == 0:
            record["routes"] = _slime_build_routes(engine, args)
            engine.shutdown()
            engine = None
            record["fresh"] = _fresh_states(job, args)
        dist.barrier()
    finally:
        if engine is not None:
            engine.shutdown()
        pool.shutdown(wait=False)
    return record


def _slime_build_routes(engine, args) -> dict:
    """The routes of slime's own SGLang build, through its ``SGLangEngine`` methods:
    ``post_process_weights`` (compressed-tensors models) and ``pull_weights`` (delta sync)."""
    import requests

    post = engine.post_process_weights(
        restore_weights_before_load=True, post_process_quantization=False
    )
    args.update_weight_local_checkpoint_dir = str(
        Path(args.update_weight_disk_dir) / "local"
    )
    try:
        engine.pull_weights(1)
        pull = None
    except requests.HTTPError as e:
        pull = (
            e.response.status_code,
            e.response.json().get("message", e.response.text),
        )
    finally:
        args.update_weight_local_checkpoint_dir = None
    return dict(post_process_weights=post, pull_weights=pull)


def _spy_report(updater) -> dict:
    """The report the companion's ``update_megatron`` returns inside ``update_weights`` (which
    drops it after checking ``success``): kept for its per-engine bytes."""
    seen: dict = {}
    sync = getattr(updater, "_sglang_sync", None)
    if sync is None or not hasattr(sync, "update_megatron"):
        return seen
    call = sync.update_megatron

    def update_megatron(*args, **kwargs):
        report = call(*args, **kwargs)
        seen["report"] = dict(
            success=report.success,
            message=report.message,
            engines=report.engines,
            seconds=report.seconds,
        )
        return report

    sync.update_megatron = update_megatron
    return seen


def _fresh_states(job: dict, args) -> dict:
    """Each seed's weights in a checkpoint, loaded by a fresh server that slime's launcher
    starts: the reference every path is compared with."""
    import tiny_models
    from update_cases import new_weights

    out = {}
    for seed in sorted(set(SEEDS.values())):
        directory = Path(job["fresh_dir"]) / f"seed{seed}"
        tiny_models.write_modified_checkpoint(
            job["model_dir"], directory, new_weights(job["model_dir"], seed)
        )
        fresh_args = SimpleNamespace(**{**vars(args), "hf_checkpoint": str(directory)})
        engine = _start_engine(fresh_args, job["ports"][3:6])
        try:
            out[seed] = _server_state(engine, job["prompts"][seed])
        finally:
            engine.shutdown()
    return out


# --- the checks --------------------------------------------------------------------------------


def _checks(first: dict, second: dict, companion: bool) -> Dict[str, List[str]]:
    """What failed, per path (empty lists: all held)."""
    failures: Dict[str, List[str]] = {}
    fresh_params = [first["fresh"][seed]["params"] for seed in sorted(first["fresh"])]
    if any(fresh_params[0][r] == p[r] for p in fresh_params[1:] for r in range(TP)):
        failures["reference"] = [
            "fresh servers of different weights report equal checksums"
        ]
    for kind, path in first["paths"].items():
        wrong = []
        state, fresh = path["state"], first["fresh"][path["seed"]]
        for r in range(TP):
            if not fresh["params"][r] or set(fresh["params"][r]) != set(
                state["params"][r]
            ):
                wrong.append(f"TP rank {r}: parameter names differ from a fresh load's")
            differ = sorted(
                n
                for n in fresh["params"][r]
                if state["params"][r].get(n) != fresh["params"][r][n]
            )
            if differ:
                wrong.append(
                    f"TP rank {r}: {len(differ)} parameters differ from a fresh load, e.g. {differ[:3]}"
                )
        if state["generation"] != fresh["generation"]:
            wrong.append(
                f"greedy generation {state['generation']} != fresh {fresh['generation']}"
            )
        if str(state["weight_version"]) != path["version"]:
            wrong.append(
                f"weight version {state['weight_version']!r} != {path['version']!r}"
            )
        if companion and kind != "disk":
            other = second["paths"][kind]
            if path[
                "forbidden_calls"
            ]:  # engine processes (the trainer ranks refuse them)
                wrong.append(
                    "a gather_object/all_gather_object/full_tensor ran during the update"
                )
            if path["all_gather_bytes"] or other["all_gather_bytes"]:
                wrong.append(
                    f"trainer ranks all-gathered {path['all_gather_bytes']}, {other['all_gather_bytes']} bytes"
                )
            wrong += _bound_failures(kind, path)
        failures[kind] = wrong
    routes, wrong = first["routes"], []
    if not routes["post_process_weights"].get("success"):
        wrong.append(f"post_process_weights: {routes['post_process_weights']}")
    if (
        not routes["pull_weights"]
        or routes["pull_weights"][0] != 501
        or "/update_weights_from_disk" not in routes["pull_weights"][1]
    ):
        wrong.append(
            f"pull_weights: {routes['pull_weights']} (expected 501 naming /update_weights_from_disk)"
        )
    failures["routes"] = wrong
    return failures


def _bound_failures(kind: str, path: dict) -> List[str]:
    if kind == "tensor":
        rows = path["figures"]
        if {row[1] for row in rows} != set(range(TP)):
            return [f"engine figures cover ranks {sorted({row[1] for row in rows})}"]
        return [
            f"engine rank {row[1]} received {row[2]} != lower bound {row[3]}"
            for row in rows
            if row[2] != row[3]
        ]
    report = path.get("report") or {}
    if not report.get("success"):
        return [f"update_megatron did not succeed: {report}"]
    return [
        f"engine {url}: received {r['bytes_received']} != lower bound {r['lower_bound_bytes']}"
        for url, r in report["engines"].items()
        if r["bytes_received"] != r["lower_bound_bytes"]
    ]


def _summary(first: dict, second: dict) -> dict:
    rows = {}
    for kind, path in first["paths"].items():
        row = dict(
            version=path["version"],
            seconds=round(path["seconds"], 2),
            all_gather_bytes_per_trainer_rank=[
                path["all_gather_bytes"],
                second["paths"][kind]["all_gather_bytes"],
            ],
        )
        row["engine_gather_calls"] = path["forbidden_calls"]
        if path["broadcast_bytes"]:
            row["rank0_broadcast_bytes"] = path["broadcast_bytes"]
        if path["bucket_bytes"] or second["paths"][kind]["bucket_bytes"]:
            row["flattened_bucket_bytes_per_trainer_rank"] = [
                path["bucket_bytes"],
                second["paths"][kind]["bucket_bytes"],
            ]
        if "written_bytes" in path:
            row["checkpoint_bytes_written"] = path["written_bytes"]
        if path.get("figures"):
            row["engine_rank_received_vs_lower_bound"] = [
                (r[1], r[2], r[3]) for r in path["figures"]
            ]
        if path.get("report"):
            row["engine_received_vs_lower_bound"] = {
                url: (r["bytes_received"], r["lower_bound_bytes"])
                for url, r in path["report"]["engines"].items()
            }
            row["group_seconds"] = round(path["report"]["seconds"], 2)
        rows[kind] = row
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--slime",
        required=True,
        help="a checkout of THUDM/slime, outside this repository",
    )
    parser.add_argument(
        "--companion",
        action="store_true",
        help="the checkout carries integrations/slime's patch",
    )
    parser.add_argument("--timeout", type=float, default=1500)
    opts = parser.parse_args(argv)
    slime = Path(opts.slime).resolve()
    if ROOT in slime.parents or slime == ROOT:
        parser.error("--slime must be outside this repository")
    tensor_py = (
        slime
        / "slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py"
    )
    if not tensor_py.is_file():
        parser.error(
            f"{slime} is no slime checkout (no {tensor_py.relative_to(slime)})"
        )
    patched = "SLIME_SGLANG_WEIGHT_SYNC" in tensor_py.read_text()
    if patched != opts.companion:
        parser.error(
            f"{slime} {'carries' if patched else 'lacks'} the companion patch; "
            + (
                "drop --companion or use a clean checkout"
                if patched
                else "apply it: patch -p1 --fuzz=0 < integrations/slime/0001-megatron-weight-sync.patch"
            )
        )
    if opts.companion:
        os.environ["SLIME_SGLANG_WEIGHT_SYNC"] = "1"
    _support_paths()
    sys.path.insert(0, str(slime))
    from engine import configure_cpu_env, stable_prompts

    configure_cpu_env()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(slime), os.environ.get("PYTHONPATH", "")]
    )
    import tiny_models
    from ports import free_ports
    from ranks import run_ranks
    from update_cases import MAX_NEW, new_weights

    import sglang

    with tempfile.TemporaryDirectory(prefix="slime-release-") as tmp:
        model_dir, _ = tiny_models.make_tiny_model("qwen2", Path(tmp) / "qwen2")
        prompts = {
            seed: stable_prompts(
                [(model_dir, new_weights(model_dir, seed))], 3, MAX_NEW
            )
            for seed in sorted(set(SEEDS.values()))
        }
        for name in ("forbidden", "figures", "disk", "fresh"):
            (Path(tmp) / name).mkdir()
        job = dict(
            slime=str(slime),
            companion=opts.companion,
            model_dir=str(model_dir),
            ports=free_ports(6),
            prompts=prompts,
            disk_dir=str(Path(tmp) / "disk"),
            fresh_dir=str(Path(tmp) / "fresh"),
            forbidden_log=str(Path(tmp) / "forbidden"),
            figures_log=str(Path(tmp) / "figures"),
        )
        started = time.perf_counter()
        first, second = run_ranks(TP, slime_job, job, timeout=opts.timeout)
        total = time.perf_counter() - started
        shutil.rmtree(tmp, ignore_errors=True)
    failures = _checks(first, second, opts.companion)
    print(
        json.dumps(
            dict(
                sglang=sglang.__version__,
                slime=str(slime),
                mode="companion" if opts.companion else "released",
                launch_s=round(first["launch_s"], 1),
                total_s=round(total, 1),
                paths=_summary(first, second),
                routes=first["routes"],
                failures=failures,
            ),
            indent=1,
        )
    )
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
