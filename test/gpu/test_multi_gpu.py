"""Two or four GPUs: FSDP2 trainer ranks on each, updating engines that span them.

Each test runs on every rank of a ``torchrun`` world of 2 or 4 (one process per GPU,
colocated with the engine ranks as verl places them). At 4 the model's 2 kv heads are
replicated over pairs of the TP-4 engine's ranks: moves with several receivers, and ranks
that hold nothing another needs (``--torchrun 4``; the CPU rehearsal runs 2). Run on a machine with two GPUs, from the
repository root with ``.gpu/`` in it::

    bash scripts/gpu_run.sh --torchrun 2

which installs the carry and runs ``torchrun --nproc-per-node 2 -m pytest
test/gpu/test_multi_gpu.py`` with the tier's environment and NCCL's watchdog delays
shortened (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=2000``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=20``),
so that the failure test decides after both have passed. Under plain pytest, or on one GPU,
each test is skipped with that line as its reason.

The CPU suite rehearses this file (``test/e2e/test_multi_gpu_rehearsal.py``): with
``SGLANG_TEST_MULTI_GPU_ON_CPU=1`` the same tests run on two gloo ranks with CPU engines, so
what is not about the device (the launch under ``torchrun``, the engines' start, the update
calls, the comparisons) has run before a two-GPU machine is spent on it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from gpu_engines import ON_CPU, QWEN2_SHAPE, engine_args, greedy_each
from peer_death import watchdog_delay_s
from plan_samples import whole_tensor_plan
from tiny_models import qwen2, write_modified_checkpoint
from update_cases import VerlLikeClient, as_layout, checksums, new_weights

WORLDS = ("2", "4")
RUN = "bash scripts/gpu_run.sh --torchrun 2 (or 4)"
PROMPTS = [[11, 12, 13, 14, 15], [101, 7, 9]]
MAX_NEW = 8
DEVICE = "cpu" if ON_CPU else "cuda"

pytestmark = [
    pytest.mark.gpus(int(os.environ.get("WORLD_SIZE", "2"))),
    pytest.mark.cpu_rehearsal,
    pytest.mark.skipif(
        os.environ.get("WORLD_SIZE") not in WORLDS,
        reason=f"runs on every rank of a torchrun world of 2 or 4: {RUN}",
    ),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """This rank's GPU and the trainer's process group; the model written by rank 0."""
    rank = int(os.environ["RANK"])
    if ON_CPU:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    shared = os.environ.get("SGLANG_GPU_SHARED_DIR", "/tmp/sglang-gpu-multi")
    model_dir = os.path.join(shared, "qwen2")
    if rank == 0:
        qwen2(model_dir, seed=0, **QWEN2_SHAPE)
    dist.barrier()
    yield rank, model_dir
    dist.destroy_process_group()


def world_size() -> int:
    """This torchrun world's size (2 or 4: the tests are skipped outside such a world)."""
    return int(os.environ["WORLD_SIZE"])


def _engine_args(**extra) -> dict:
    """The engines' arguments, without ``tp_size`` (``HostedEngine`` sets it; the caller of a
    plain ``Engine`` passes it)."""
    args = engine_args(**({} if ON_CPU else {"mem_fraction_static": 0.2}), **extra)
    args.pop("tp_size", None)  # GPU_ENGINE_ARGS has one
    return args


def _greedy(engine):
    return greedy_each(engine, PROMPTS, MAX_NEW)


def _hosted_greedy(host):
    """``greedy_each`` through ``HostedEngine.generate``, which every rank calls and every
    rank gets the answer of."""
    return [
        host.generate(
            input_ids=[p],
            sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0},
        )[0]["output_ids"]
        for p in PROMPTS
    ]


def test_fsdp2_on_two_gpus_updates_a_tp2_engine(world):
    """FSDP2-style fp32 Shard(0) DTensors on every GPU -> one engine of TP 2 (or 4) over the
    same GPUs (``HostedEngine``: trainer_flow's update, as ``VerlEngine`` drives it;
    engine-side resharding: NCCL point-to-point between the engine's ranks). Every parameter equals SGLang's own load of the same values (checksums
    of every TP rank), and greedy generation a freshly loaded engine's."""
    from hosted_engine import HostedEngine
    from torch.distributed.device_mesh import init_device_mesh

    rank, model_dir = world
    cpu_mesh = init_device_mesh("cpu", (world_size(),), mesh_dim_names=("tp",))
    trainer_mesh = init_device_mesh(DEVICE, (world_size(),), mesh_dim_names=("fsdp",))
    weights = new_weights(model_dir, seed=3)
    shards = as_layout(weights, "fsdp32", trainer_mesh)  # on the mesh's device
    expected = {n: t.float().to(torch.bfloat16) for n, t in weights.items()}
    reference_dir = os.path.join(os.path.dirname(model_dir), "reference")
    if rank == 0:
        write_modified_checkpoint(model_dir, reference_dir, expected)

    host = HostedEngine(cpu_mesh, model_path=model_dir, **_engine_args())
    try:
        host.update(shards)
        host.call("flush_cache")
        got = _hosted_greedy(host)
        # every TP rank's parameters, from the engine's leader (the checker gathers them)
        updated = checksums(host.engine) if host.engine is not None else None
        dist.barrier()
    finally:
        host.shutdown()
    dist.barrier()
    fresh = HostedEngine(cpu_mesh, model_path=reference_dir, **_engine_args())
    try:
        want = _hosted_greedy(fresh)
        loaded = checksums(fresh.engine) if fresh.engine is not None else None
        dist.barrier()
    finally:
        fresh.shutdown()
    assert updated == loaded, "a parameter differs from SGLang's own load"
    assert got == want


def test_trainer_side_one_hop_into_two_tp1_engines(world, monkeypatch):
    """The same trainer feeding one TP-1 engine per GPU (``weight_sync.utils.update_weights``
    with an ("dp", "infer_tp") mesh of (2, 1)): each engine receives the whole model from both
    trainer ranks over NCCL in one hop, resharded on the trainer side."""
    from torch.distributed.device_mesh import init_device_mesh

    import sglang
    from sglang.srt.weight_sync.utils import update_weights

    rank, model_dir = world
    trainer_mesh = init_device_mesh(DEVICE, (world_size(),), mesh_dim_names=("fsdp",))
    engines = init_device_mesh(
        DEVICE, (world_size(), 1), mesh_dim_names=("dp", "infer_tp")
    )
    weights = new_weights(model_dir, seed=4)
    shards = as_layout(weights, "fsdp32", trainer_mesh)
    own_gpu = {} if ON_CPU else {"base_gpu_id": rank}
    # a plain Engine started from a torchrun worker hangs at startup with torchrun's
    # agent-store flag in its processes' environment (docs/usage.md); HostedEngine drops it
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    engine = sglang.Engine(model_path=model_dir, tp_size=1, **_engine_args(**own_gpu))
    try:
        out = engine.loop.run_until_complete(
            update_weights(VerlLikeClient(engine), shards, "infer_tp", engines)
        )
        assert out[0], out
        got = _greedy(engine)
        updated = checksums(engine)
    finally:
        engine.shutdown()
    reference_dir = os.path.join(os.path.dirname(model_dir), f"reference-{rank}")
    write_modified_checkpoint(
        model_dir,
        reference_dir,
        {n: t.float().to(torch.bfloat16) for n, t in weights.items()},
    )
    fresh = sglang.Engine(
        model_path=reference_dir, tp_size=1, **_engine_args(**own_gpu)
    )
    try:
        # every parameter equal to SGLang's own load of the same values, then generation
        assert updated == checksums(fresh)
        assert got == _greedy(fresh)
    finally:
        fresh.shutdown()


def test_a_timed_out_wait_on_the_data_group_spares_the_process_and_serving(world):
    """NCCL's failure mode: a wait on a data-plane group that outlives its bound. One update
    runs (the communicator and the ranks' point-to-point connection exist); in the next,
    rank 1 withholds its send. Rank 0's receive fails within the bound (``PeerLost``), and
    both ranks then abandon the group, as the engine does (``DataGroup.abandon``: the
    communicator is aborted). With work still pending, NCCL's watchdog would end the process
    once the group's own timeout passed, or its dump delay after a wait that tore the
    communicator down: both ranks outlive both, the default group (SGLang's
    serving group stands for it) still reduces on the device, and a new data group delivers
    the tensor exactly."""
    from sglang.srt.weight_sync.control_plane import PeerLost
    from sglang.srt.weight_sync.executor import DataGroup, execute

    rank, _ = world
    group_timeout_s, bound_s = 10.0, 2.0
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    shards = {"w": full.to(DEVICE)} if rank == 1 else {}
    # one receive on rank 0, one send on rank 1
    the_plan = whole_tensor_plan(1, {0}, world_size())

    def params():
        return {"p": torch.zeros(6, 4, device=DEVICE)} if rank == 0 else {}

    data = DataGroup.over_ranks_of(
        None, group_timeout_s, DataGroup.number_proposal(None, 0)
    )
    execute(the_plan, rank, shards, params(), group=data, timeout_s=60.0)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match=r"did not answer within 2s"):
            execute(the_plan, 0, shards, params(), group=data, timeout_s=bound_s)
        assert time.monotonic() - t0 < bound_s + 10
    dist.barrier()  # rank 1 aborts only after rank 0's wait has run out
    data.abandon()
    # past the abandoned group's timeout and the watchdog's dump delay and heartbeat
    # timeout (``scripts/gpu_run.sh --torchrun`` shortens both), NCCL's watchdog would have
    # ended a process whose work on it were still pending or whose wait tore it down (gloo
    # has no watchdog: nothing to outlive on CPU)
    time.sleep(0 if ON_CPU else max(group_timeout_s + 5, watchdog_delay_s(os.environ)))

    flag = torch.ones(1, device=DEVICE)
    dist.all_reduce(flag)
    assert flag.item() == world_size(), "the default group no longer reduces"
    fresh = DataGroup.over_ranks_of(
        None, group_timeout_s, DataGroup.number_proposal(None, 0)
    )
    assert fresh.group is not data.group
    landed = params()
    execute(the_plan, rank, shards, landed, group=fresh, timeout_s=60.0)
    if rank == 0:
        assert torch.equal(landed["p"].cpu(), full)
    dist.barrier()
