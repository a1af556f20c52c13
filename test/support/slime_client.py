"""slime's SGLang calls as its released code makes them (THUDM/slime at 624b824, which pins
SGLang 0.5.15.post1), for ``test/e2e/test_slime_paths.py``. slime is not on PyPI: this module
was written from reading its public source, not copied; each piece names what it stands for.

* ``SlimeEngine``: the HTTP requests of ``slime/backends/sglang_utils/sglang_engine.py``'s
  ``SGLangEngine`` on node rank 0: the same routes, methods and JSON bodies (``_make_request``
  POSTs ``payload or {}``; ``flush_cache`` GETs until 200; ``get_weight_version`` GETs
  ``/get_weight_version``; the update calls add ``weight_version``/``load_format`` only when set).
* ``slime_server_args`` / ``launch_server_process``: ``_compute_server_args`` (its kwargs, then
  every key filtered by ``dataclasses.fields(ServerArgs)``, then the ``--sglang-config``
  overrides) and ``launch_server_process`` (``launch_server`` in a spawned process, then
  ``/health_generate`` until 200).
* ``send_to_colocated_engine``: ``update_weight_from_tensor._send_to_colocated_engine``: each
  trainer rank of an engine packs its HF tensors in ``FlattenedTensorBucket``s (one per dtype
  unless the bucket takes several), serializes them with SGLang's ``MultiprocessingSerializer``
  (``output_str=True``), ``gather_object``s them to the engine's first rank, which sends one
  ``update_weights_from_tensor(load_format="flattened_bucket")`` per bucket with one entry per
  engine TP rank.
* ``colocated_update``: ``UpdateWeightFromTensor.update_weights`` around it: rank 0 pauses and
  flushes, every rank sends each chunk, rank 0 continues.
* ``connect_rollout_engines_from_distributed`` / ``update_weights_from_distributed``: the same
  functions of ``update_weight_from_distributed.py``: every engine joins a group of its GPU count
  plus trainer rank 0 (``init_weights_update_group``, ``rank_offset`` 1 + the GPUs before it),
  then per chunk every engine is asked to receive (names, dtype strings, shapes, group name,
  weight version) while rank 0 broadcasts each tensor from rank 0.
* ``start_server``: slime's launcher where ``ServerArgs`` is a dataclass (0.5.15.post1 and
  older); on 0.5.23, whose ``ServerArgs`` is a msgspec struct and stops slime's launcher with
  ``TypeError``, SGLang's ``HttpServerEngineAdapter`` (the update calls that follow are the same).
* ``reload_from_disk``: ``RayTrainGroup._reload_rollout_weights_from_disk`` (full mode, no
  local checkpoint dir): pause, flush, ``update_weights_from_disk(model_path, weight_version)``,
  the version check of ``--ci-test``, continue.

Stand-ins, only for what cannot run here: Ray (a thread per ``.remote`` call that answers in
order, the calls made as slime makes them), CUDA IPC (CPU tensors are shared through the
``file_system`` strategy, the CPU form of a handle any process can open) and NCCL (gloo, as
slime's ``accelerator.weight_update_backend`` is on a CPU platform).
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import requests
import torch

__all__ = [
    "ServerAddress",
    "SlimeEngine",
    "chunks",
    "colocated_update",
    "connect_rollout_engines_from_distributed",
    "launch_server_process",
    "reload_from_disk",
    "send_to_colocated_engine",
    "slime_server_args",
    "start_server",
    "update_weights_from_distributed",
]

_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="slime-ray-stand-in")


def remote(fn, *args, **kwargs) -> Future:
    """Stand-in for ``actor.method.remote(...)``: the call runs beside the caller."""
    return _POOL.submit(fn, *args, **kwargs)


class SlimeEngine:
    """``SGLangEngine``'s HTTP requests to its server (node rank 0)."""

    def __init__(self, host: str, port: int):
        self.server_host, self.server_port = host, port

    def _url(self, endpoint: str) -> str:
        return f"http://{self.server_host}:{self.server_port}/{endpoint}"

    def _make_request(self, endpoint: str, payload: Optional[dict] = None):
        response = requests.post(self._url(endpoint), json=payload or {})
        try:
            response.raise_for_status()
        except requests.exceptions.HTTPError as e:
            e.add_note(f"{response.text=}")
            raise
        return response.json()

    def health_generate(self, timeout: float = 5.0) -> bool:
        requests.get(self._url("health_generate"), timeout=timeout).raise_for_status()
        return True

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: List[str],
        load_format: Optional[str] = None,
        flush_cache: bool = False,
        weight_version: Optional[str] = None,
    ):
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_tensor", payload)

    def flush_cache(self) -> None:
        for _ in range(60):
            try:
                if requests.get(self._url("flush_cache")).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError("Timeout while flushing cache.")

    def get_weight_version(self):
        response = requests.get(self._url("get_weight_version"))
        response.raise_for_status()
        return response.json()["weight_version"]

    def pull_weights(
        self, target_version: int, local_checkpoint_dir: str, source_dir: str
    ):
        """slime's args ``update_weight_local_checkpoint_dir`` and ``update_weight_disk_dir``."""
        return self._make_request(
            "pull_weights",
            {
                "local_checkpoint_dir": local_checkpoint_dir,
                "source_dir": source_dir,
                "target_version": target_version,
            },
        )

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: Optional[str] = None,
        weight_version: Optional[str] = None,
    ):
        payload: dict = {"model_path": model_path}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_disk", payload)

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend
    ):
        return self._make_request(
            "init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def destroy_weights_update_group(self, group_name: str):
        try:
            return self._make_request(
                "destroy_weights_update_group", {"group_name": group_name}
            )
        except requests.exceptions.RequestException:
            pass

    def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name,
        flush_cache=False,
        weight_version: Optional[str] = None,
        load_format: Optional[str] = None,
    ):
        payload = {
            "names": names,
            "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return self._make_request("update_weights_from_distributed", payload)

    def pause_generation(self):
        response = requests.post(self._url("pause_generation"), json={})
        response.raise_for_status()
        return response

    def continue_generation(self):
        response = requests.post(self._url("continue_generation"), json={})
        response.raise_for_status()
        return response

    def post_process_weights(
        self,
        restore_weights_before_load: bool = False,
        post_process_quantization: bool = False,
    ):
        return self._make_request(
            "post_process_weights",
            {
                "restore_weights_before_load": restore_weights_before_load,
                "post_process_quantization": post_process_quantization,
            },
        )


def slime_server_args(
    model_path: str,
    host: str,
    port: int,
    nccl_port: int,
    dist_port: int,
    tp_size: int,
    seed: int,
    overrides: Dict[str, Any],
):
    """``ServerArgs`` as ``_compute_server_args`` builds them for one engine on one node (no
    memory saver, no disaggregation), ``overrides`` standing for ``--sglang-config``. Raises
    ``TypeError`` where ``ServerArgs`` is no dataclass, as slime does (0.5.23)."""
    from sglang.srt.server_args import ServerArgs

    kwargs = {
        "model_path": model_path,
        "trust_remote_code": True,
        "random_seed": seed,
        "enable_memory_saver": False,
        "host": host,
        "port": port,
        "nccl_port": nccl_port,
        "nnodes": 1,
        "node_rank": 0,
        "dist_init_addr": f"{host}:{dist_port}",
        "gpu_id_step": 1,
        "base_gpu_id": 0,
        "tp_size": tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "skip_server_warmup": True,
        "enable_draft_weights_cpu_backup": True,
        "enable_metrics": True,
    }
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    kwargs.update(overrides)
    unused = set(kwargs) - names
    for key in unused:  # "not supported in the current sglang": dropped, as slime does
        kwargs.pop(key)
    return ServerArgs(**kwargs)


def launch_server_process(server_args, timeout: float = 900):
    """``launch_server`` in a spawned process, then ``/health_generate`` until 200."""
    import multiprocessing

    from sglang.srt.entrypoints.http_server import launch_server

    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=launch_server, args=(server_args,))
    process.start()
    deadline = time.time() + timeout
    while True:
        try:
            if requests.get(f"{server_args.url()}/health_generate").status_code == 200:
                return process
        except requests.RequestException:
            pass
        if not process.is_alive():
            raise RuntimeError("Server process terminated unexpectedly.")
        if time.time() > deadline:
            raise TimeoutError(f"no healthy server at {server_args.url()}")
        time.sleep(2)


class ServerAddress:
    """What ``update_cases.checksums`` reads of a server: its ``server_args`` (``url()``)."""

    def __init__(self, server_args):
        self.server_args = server_args


def start_server(model_dir: str, ports: Sequence[int], tp_size: int, engine_args: dict):
    """A server of ``model_dir`` at ``tp_size`` on ``ports`` (HTTP, NCCL, dist init), started
    as slime starts it where it can: (stop, its ``ServerAddress``)."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    port, nccl_port, dist_port = ports
    if dataclasses.is_dataclass(ServerArgs):
        args = slime_server_args(
            model_dir, "127.0.0.1", port, nccl_port, dist_port, tp_size, 0, engine_args
        )
        process = launch_server_process(args)
        return (lambda: kill_process_tree(process.pid)), ServerAddress(args)
    from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter

    server = HttpServerEngineAdapter(
        model_path=model_dir,
        tp_size=tp_size,
        host="127.0.0.1",
        port=port,
        **engine_args,
    )
    return server.shutdown, ServerAddress(server.server_args)


def chunks(
    named: Sequence[Tuple[str, torch.Tensor]], buffer_bytes: int
) -> List[List[Tuple[str, torch.Tensor]]]:
    """Named tensors in chunks of at most ``buffer_bytes`` (one tensor at least), as slime's
    iterators cut them by ``--update-weight-buffer-size``."""
    out, buffer, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if buffer and size + nbytes > buffer_bytes:
            out.append(buffer)
            buffer, size = [], 0
        buffer.append((name, tensor))
        size += nbytes
    if buffer:
        out.append(buffer)
    return out


def _flattened(named: Sequence[Tuple[str, torch.Tensor]]) -> dict:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not named:
        return {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    bucket = FlattenedTensorBucket(named_tensors=list(named))
    return {
        "flattened_tensor": bucket.get_flattened_tensor(),
        "metadata": bucket.get_metadata(),
    }


def send_to_colocated_engine(
    hf_named_tensors: Sequence[Tuple[str, torch.Tensor]],
    *,
    ipc_engine: Optional[SlimeEngine],
    ipc_gather_src: int,
    ipc_gather_group,
    weight_version: int,
) -> Tuple[List[Future], list]:
    """One chunk from every trainer rank of one engine: (the engine's reply futures on the
    gathering rank, the tensors the serialized handles point at, to keep alive until then)."""
    import torch.distributed as dist
    import torch.multiprocessing

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    torch.multiprocessing.set_sharing_strategy("file_system")  # stand-in for CUDA IPC
    long_live = []
    if getattr(FlattenedTensorBucket, "supports_multi_dtypes", False):
        by_dtype = {"dtype": list(hf_named_tensors)} if hf_named_tensors else {}
    else:
        by_dtype: Dict[Any, list] = {}
        for name, tensor in hf_named_tensors:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    serialized = []
    for named in by_dtype.values():
        data = _flattened(named)
        long_live.append(data)
        serialized.append(MultiprocessingSerializer.serialize(data, output_str=True))
    gathered = (
        [None] * dist.get_world_size(ipc_gather_group)
        if ipc_gather_src == dist.get_rank()
        else None
    )
    dist.gather_object(
        serialized,
        object_gather_list=gathered,
        dst=ipc_gather_src,
        group=ipc_gather_group,
    )
    refs = []
    if dist.get_rank() == ipc_gather_src:
        empty = None
        for i in range(max(len(t) for t in gathered)):
            per_rank = []
            for tensors in gathered:
                if i < len(tensors):
                    per_rank.append(tensors[i])
                    continue
                if empty is None:
                    data = _flattened([])
                    long_live.append(data)
                    empty = MultiprocessingSerializer.serialize(data, output_str=True)
                per_rank.append(empty)
            refs.append(
                remote(
                    ipc_engine.update_weights_from_tensor,
                    serialized_named_tensors=per_rank,
                    load_format="flattened_bucket",
                    weight_version=str(weight_version),
                )
            )
    return refs, long_live


def colocated_update(
    rank: int,
    engine: SlimeEngine,
    group,
    weights: Dict[str, torch.Tensor],
    version: int,
    buffer_bytes: int,
) -> None:
    """slime's colocated update of one engine by the trainer ranks of ``group`` (its first
    rank gathers); ``weights``: the HF tensors its Megatron conversion yields on each rank."""
    import torch.distributed as dist
    from ranks import gathers_allowed

    if rank == 0:
        engine.pause_generation()
        engine.flush_cache()
    dist.barrier()
    with (
        gathers_allowed()
    ):  # slime gathers the serialized buckets to the engine's first rank
        for chunk in chunks(sorted(weights.items()), buffer_bytes):
            refs, keep = send_to_colocated_engine(
                chunk,
                ipc_engine=engine,
                ipc_gather_src=dist.get_process_group_ranks(group)[0],
                ipc_gather_group=group,
                weight_version=version,
            )
            for ref in refs:
                assert ref.result()["success"], ref.result()
            # stand-in for CUDA IPC's producer-side lifetime: every rank's buckets live until
            # the engine has copied them
            dist.barrier()
            del keep
    dist.barrier()
    if rank == 0:
        engine.continue_generation()
    dist.barrier()


def connect_rollout_engines_from_distributed(
    group_name: str,
    engines: Sequence[SlimeEngine],
    engine_gpu_counts: Sequence[int],
    master_port: int,
    backend: str = "gloo",
    master_address: str = "127.0.0.1",
):
    """Trainer rank 0 and every engine GPU in one group named ``group_name``; returns it."""
    from sglang.srt.utils import init_custom_process_group

    world_size = sum(engine_gpu_counts) + 1
    cumulative = [0]
    for count in engine_gpu_counts:
        cumulative.append(cumulative[-1] + count)
    refs = [
        remote(
            engine.init_weights_update_group,
            master_address=master_address,
            master_port=master_port,
            rank_offset=cumulative[i] + 1,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        for i, engine in enumerate(engines)
    ]
    group = init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{master_address}:{master_port}",
        world_size=world_size,
        rank=0,
        group_name=group_name,
    )
    for ref in refs:
        ref.result()
    return group


def update_weights_from_distributed(
    group_name: str,
    group,
    weight_version: int,
    engines: Sequence[SlimeEngine],
    named: Sequence[Tuple[str, torch.Tensor]],
    load_format: Optional[str] = None,
) -> List[Future]:
    """Every engine asked to receive ``named`` while rank 0 broadcasts each tensor."""
    import torch.distributed as dist

    refs = [
        remote(
            engine.update_weights_from_distributed,
            names=[name for name, _ in named],
            dtypes=[param.dtype for _, param in named],
            shapes=[param.shape for _, param in named],
            group_name=group_name,
            weight_version=str(weight_version),
            load_format=load_format,
        )
        for engine in engines
    ]
    handles = [
        dist.broadcast(param.data, 0, group=group, async_op=True) for _, param in named
    ]
    for handle in handles:
        handle.wait()
    return refs


def reload_from_disk(
    engines: Sequence[SlimeEngine], model_path: str, weight_version: str
) -> None:
    """The engines reload the checkpoint slime wrote at ``model_path`` (full mode)."""
    for engine in engines:
        engine.pause_generation()
    for engine in engines:
        engine.flush_cache()
    for ref in [
        remote(
            engine.update_weights_from_disk,
            model_path=model_path,
            weight_version=weight_version,
        )
        for engine in engines
    ]:
        ref.result()
    versions = [engine.get_weight_version() for engine in engines]
    mismatches = [v for v in versions if str(v) != str(weight_version)]
    if mismatches:
        raise RuntimeError(
            f"Weight version mismatch after disk reload! Expected: {weight_version}; {versions}"
        )
    for engine in engines:
        engine.continue_generation()
