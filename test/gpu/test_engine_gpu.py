"""One engine on one GPU, updated through CUDA IPC from a trainer in this process.

What the CPU suite cannot show: SGLang's CUDA branches (Triton attention, CUDA graphs captured
over the parameters' addresses), payloads mapped through CUDA IPC, the device's asynchronous
copies, the memory saver's release and resume. Models are tiny Qwen2s with head_dim 64 (the
size SGLang's CUDA rotary kernel takes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from engine import engine_greedy, weight_update_session
from gpu_engines import QWEN2_SHAPE, gpu_engine, greedy_each
from ports import free_port
from tiny_models import qwen2, write_modified_checkpoint
from update_cases import VerlLikeClient, _saved_checksums, new_weights

PROMPTS = [[11, 12, 13, 14, 15], [101, 7, 9], [3, 5, 8, 13, 21, 34, 55]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return qwen2(tmp_path_factory.mktemp("qwen2_gpu"), seed=0, **QWEN2_SHAPE)[0]


@pytest.fixture(scope="module")
def trainer_group():
    """A one-rank trainer world (gloo for control, NCCL for CUDA tensors) and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )
    yield init_device_mesh("cuda", (1,), mesh_dim_names=("infer_tp",))


def _greedy(engine) -> List[List[int]]:
    return greedy_each(engine, PROMPTS, MAX_NEW)


@torch.no_grad()
def _hf_greedy_fp32(model_dir: Path) -> List[List[int]]:
    """HF transformers' greedy tokens, fp32 on the GPU, no KV cache (the reference the CPU
    suite uses, on this device)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).cuda()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        for _ in range(MAX_NEW):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def test_engine_starts_with_cuda_graphs_and_generates_as_hf(model_dir):
    with gpu_engine(model_dir, dtype="float32") as engine:
        info = engine.get_server_info()
        assert info["disable_cuda_graph"] is False
        assert info["attention_backend"] == "triton"
        got = _greedy(engine)
    assert got == _hf_greedy_fp32(model_dir)


def _ptrs(engine, tag: str) -> Dict[str, list]:
    engine.collective_rpc("test_dump_param_ptrs", tag=tag)
    path = Path(os.environ["SGLANG_TEST_PARAM_PTRS"]) / f"{tag}.rank0.json"
    return json.loads(path.read_text())


def _trainer_params(model_dir: Path, seed: int) -> Dict[str, torch.Tensor]:
    """fp32 trainer parameters on the GPU, off the bf16 grid (so the engine's cast rounds),
    one of them a non-contiguous view."""
    generator = torch.Generator().manual_seed(seed)
    params = {
        n: (t.float() + 1e-3 * torch.randn(t.shape, generator=generator)).cuda()
        for n, t in sorted(new_weights(model_dir, seed).items())
    }
    name = "model.layers.0.mlp.down_proj.weight"
    params[name] = params[name].t().contiguous().t()
    assert not params[name].is_contiguous()
    return params


def _update(engine, mesh, params: Dict[str, torch.Tensor]):
    from sglang.srt.weight_sync.utils import update_weights

    # flush_cache: the radix cache holds KV computed with the old weights (verl flushes too)
    call = update_weights(
        VerlLikeClient(engine), list(params.items()), "infer_tp", mesh
    )
    with weight_update_session(engine):
        return engine.loop.run_until_complete(call)


def test_update_through_cuda_ipc_in_place_bit_exact(
    model_dir, trainer_group, tmp_path, monkeypatch
):
    """fp32 trainer tensors (one non-contiguous) -> a bf16 engine with CUDA graphs: every
    parameter equals SGLang's own load of the same values cast to bf16, no parameter moved,
    and greedy generation (replaying graphs captured before the update) equals a freshly
    loaded engine's. The trainer overwrites its tensors right after the reply: if the engine
    replied before its device copies had read them, it would hold the overwritten values.
    Then the trainer frees them, the engine still running: the memory must come back, which
    it does not while the engine still maps it (torch keeps a block shared through CUDA IPC
    allocated until every process that opened it has let it go)."""
    monkeypatch.setenv("SGLANG_TEST_PARAM_PTRS", str(tmp_path))
    params = _trainer_params(model_dir, seed=1)
    expected = {n: t.to(torch.bfloat16).cpu() for n, t in params.items()}
    reference_dir = write_modified_checkpoint(model_dir, tmp_path / "ref", expected)
    with gpu_engine(model_dir) as engine:
        before = _ptrs(engine, "before")
        old = _greedy(engine)
        success, message = _update(engine, trainer_group, params)[:2]
        for t in params.values():  # the next optimizer step, on the trainer's stream
            t.fill_(float("nan"))
        assert success, message
        assert _ptrs(engine, "after") == before
        updated = _saved_checksums(engine)
        got = _greedy(engine)
        sent = sum(t.untyped_storage().nbytes() for t in params.values())
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        del params, t
        torch.cuda.ipc_collect()  # frees what the engine has let go of since
        freed = allocated - torch.cuda.memory_allocated()
        print(f"trainer bytes sent {sent}, freed after the reply {freed}")
    with gpu_engine(reference_dir) as reference:
        assert updated == _saved_checksums(reference)
        want = _greedy(reference)
    assert got == want
    assert got != old, (
        "the update did not change generation: the check would not see one"
    )
    assert freed >= sent, (
        f"the trainer freed {sent} bytes it had sent and {freed} came back while the engine "
        "ran: the rest of the update's payload is still held after the reply (mapped by the "
        "engine, or kept by the trainer's sender)"
    )


def test_memory_cycle_keeps_memory_flat(model_dir, trainer_group, tmp_path):
    """verl's cycle, 20 times: release everything, resume weights, update, resume the KV
    cache, generate. After ``WARMUP`` cycles (allocator caches filling: the engine's and this
    trainer's) device memory stays flat, and the last update's weights are the ones served."""
    cycles, warmup = 20, 3
    with gpu_engine(model_dir, enable_memory_saver=True) as engine:
        used: List[int] = []
        for step in range(cycles):
            engine.release_memory_occupation()
            engine.resume_memory_occupation(tags=["weights"])
            params = _trainer_params(model_dir, seed=100 + step)
            success, message = _update(engine, trainer_group, params)[:2]
            assert success, f"cycle {step}: {message}"
            del params
            engine.resume_memory_occupation(tags=["kv_cache"])
            engine_greedy(engine, PROMPTS, 2)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # this (trainer) process's cache is not the engine's
            free, total = torch.cuda.mem_get_info()
            used.append(total - free)
        last = {
            n: t.to(torch.bfloat16).cpu()
            for n, t in _trainer_params(model_dir, seed=100 + cycles - 1).items()
        }
        served = _saved_checksums(engine)
    mib = [u >> 20 for u in used]
    print(f"device memory in use after each cycle (MiB): {mib}")
    growth = max(used[warmup:]) - used[warmup]
    assert growth <= 16 << 20, f"grew by {growth >> 20} MiB after warm-up: {mib}"
    reference_dir = write_modified_checkpoint(model_dir, tmp_path / "last", last)
    with gpu_engine(reference_dir) as reference:
        assert served == _saved_checksums(reference)


def test_update_refused_while_weights_released(model_dir, trainer_group):
    """An update while the memory saver holds the weights released is refused, naming the
    call that brings them back, and the engine serves its weights once resumed.

    Without ``enable_weights_cpu_backup`` SGLang's resume maps fresh memory whose contents are
    undefined (verl's cycle writes new weights right after it); the backup makes "serves its
    old weights" a property of the refused update rather than of luck."""
    with gpu_engine(
        model_dir, enable_memory_saver=True, enable_weights_cpu_backup=True
    ) as engine:
        old = _greedy(engine)
        engine.release_memory_occupation(tags=["weights"])
        success, message = _update(
            engine, trainer_group, _trainer_params(model_dir, 7)
        )[:2]
        assert not success
        assert "resume_memory_occupation" in message
        engine.resume_memory_occupation(tags=["weights"])
        engine.flush_cache()  # full prefills again, as for ``old``, not cached prefixes
        assert _greedy(engine) == old
