"""Two GPUs: a trainer on one GPU updates an engine on the other through a weight-sync group
whose data group is NCCL (``remote.trainer.RemoteSync``, ``docs/remote.md``).

NCCL refuses two ranks of one communicator on one device, so this needs two GPUs: the
trainer (this process, a one-rank world on GPU 0) and the engine's TP rank (GPU 1), driven
in this process through ``LocalEndpoint``. On one GPU it is skipped with that reason; run it
on two with ``bash scripts/gpu_run.sh test/gpu/test_remote_gpu.py``.

With ``SGLANG_TEST_MULTI_GPU_ON_CPU=1`` the same test runs on CPU (gloo, a CPU engine):
``test/e2e/test_multi_gpu_rehearsal.py`` rehearses it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_engines import ON_CPU, QWEN2_SHAPE, engine_args, greedy_each
from ports import free_port
from tiny_models import qwen2, write_modified_checkpoint
from update_cases import checksums, new_weights

PROMPTS = [[11, 12, 13, 14, 15], [101, 7, 9]]
MAX_NEW = 8
DEVICE = "cpu" if ON_CPU else "cuda:0"

pytestmark = [pytest.mark.gpus(2), pytest.mark.cpu_rehearsal]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return qwen2(tmp_path_factory.mktemp("qwen2_remote"), seed=0, **QWEN2_SHAPE)[0]


@pytest.fixture(scope="module")
def trainer_world(tmp_path_factory):
    """This process as a one-rank trainer world (bound to GPU 0). A file store: the CPU suite's
    zygote cannot fork schedulers for a process that made a TCP store (see the rehearsal)."""
    if not dist.is_initialized():
        if not ON_CPU:
            torch.cuda.set_device(0)
        store = tmp_path_factory.mktemp("trainer_world") / "store"
        # bound to its GPU, as verl's trainers are: the weight-sync group's NCCL data group
        # must not be split from this world's communicator (issue 38, item 2)
        bound = {} if ON_CPU else {"device_id": torch.device("cuda", 0)}
        dist.init_process_group(
            "gloo" if ON_CPU else "cpu:gloo,cuda:nccl",
            init_method=f"file://{store}",
            rank=0,
            world_size=1,
            **bound,
        )
    yield


def _engine(model_dir):
    """A TP-1 engine on GPU 1 (on CPU: the suite's CPU engine)."""
    import sglang

    on_gpu1 = {} if ON_CPU else {"base_gpu_id": 1}
    return sglang.Engine(model_path=str(model_dir), **engine_args(tp_size=1, **on_gpu1))


def _greedy(engine):
    return greedy_each(engine, PROMPTS, MAX_NEW)


def test_a_trainer_on_one_gpu_updates_an_engine_on_another(
    model_dir, trainer_world, tmp_path
):
    """fp32 trainer tensors on GPU 0 -> the engine's bf16 parameters on GPU 1, over the
    group's NCCL data group: the engine rank receives exactly its parameters' bytes (its
    lower bound: it holds none of the trainer's data), its parameters equal SGLang's own load
    of the same values, and its greedy generation equals a freshly loaded engine's."""
    from sglang.srt.weight_sync.remote.endpoints import LocalEndpoint
    from sglang.srt.weight_sync.remote.trainer import RemoteSync

    weights = new_weights(model_dir, seed=5)
    params = [(n, t.float().to(DEVICE)) for n, t in sorted(weights.items())]
    engine = _engine(model_dir)
    try:
        endpoint = LocalEndpoint(engine, name="engine-on-gpu1")
        sync = RemoteSync("gpu-remote", "127.0.0.1", free_port(), [endpoint])
        assert sync.backend == ("gloo" if ON_CPU else "nccl")
        try:
            sync.join()
            report = sync.update(params)
        finally:
            sync.close()
        assert report.success, report.message
        reply = report.engines[endpoint.name]
        assert reply["bytes_received"] == reply["lower_bound_bytes"], reply
        assert reply["bytes_received"][0] > 0 and report.bytes_sent == [
            reply["bytes_received"][0]
        ], (report.bytes_sent, reply)
        updated = checksums(engine)
        got = _greedy(engine)
    finally:
        engine.shutdown()
    expected = {n: t.float().to(torch.bfloat16) for n, t in weights.items()}
    reference_dir = write_modified_checkpoint(model_dir, tmp_path / "ref", expected)
    reference = _engine(reference_dir)
    try:
        assert updated == checksums(reference)
        assert got == _greedy(reference)
    finally:
        reference.shutdown()
