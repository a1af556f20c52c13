"""The GPU tier's engine arguments, the engine context manager and the skip rule (imported
by ``conftest.py`` and the tests; a module of its own, since several ``conftest`` modules
share that name under ``test/``)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, List, Sequence

import torch

# The tier's tiny Qwen2s: head_dim 64, the size SGLang's CUDA rotary kernel takes.
QWEN2_SHAPE = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
)
# The tests that need two GPUs run on CPU instead (gloo, CPU engines) when this is set:
# test/e2e/test_multi_gpu_rehearsal.py rehearses them.
ON_CPU = os.environ.get("SGLANG_TEST_MULTI_GPU_ON_CPU") == "1"

GPU_ENGINE_ARGS = dict(
    tp_size=1,
    attention_backend="triton",  # pure Triton: no flashinfer / sgl-kernel attention build needed
    sampling_backend="pytorch",
    grammar_backend="none",  # xgrammar is not carried (scripts/gpu_carry.sh)
    skip_tokenizer_init=True,
    mem_fraction_static=0.3,
    cuda_graph_max_bs=4,  # decode CUDA graphs on (captured over the parameters' addresses)
    disable_piecewise_cuda_graph=True,  # torch.compile'd prefill graphs need sgl-kernel's weak refs
    random_seed=0,
    log_level="error",
)


def gpu_skip_reason(devices: int = 1) -> str:
    """Why this machine cannot run a GPU test needing ``devices`` GPUs ("" if it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device: test/gpu runs on a GPU machine (docs/gpu.md, scripts/gpu_run.sh)"
    if os.environ.get("SGLANG_TEST_GPU") != "1":
        return "SGLANG_TEST_GPU is not 1: run test/gpu through scripts/gpu_run.sh"
    if torch.cuda.device_count() < devices:
        return f"needs {devices} GPUs, this machine has {torch.cuda.device_count()}"
    return ""


def engine_args(**extra) -> dict:
    """An engine's arguments in this tier: ``GPU_ENGINE_ARGS`` (the CPU suite's engines' with
    ``ON_CPU``) and the tests' SIGQUIT handler, overridden by ``extra``. Upstream's handler
    kills the whole process tree, pytest included, when a scheduler fails to start; with the
    tests' the engine raises on its own."""
    from engine import WORKER_ENGINE_ARGS, _launch_sigquit_handler

    base = WORKER_ENGINE_ARGS if ON_CPU else GPU_ENGINE_ARGS
    return {**base, "custom_sigquit_handler": _launch_sigquit_handler, **extra}


@contextlib.contextmanager
def gpu_engine(model_dir, **kwargs) -> Iterator[object]:
    """``sglang.Engine`` on the current GPU with ``engine_args(**kwargs)``."""
    import sglang

    engine = sglang.Engine(model_path=str(model_dir), **engine_args(**kwargs))
    try:
        yield engine
    finally:
        engine.shutdown()


def greedy_each(engine, prompts: Sequence[List[int]], max_new: int) -> List[List[int]]:
    """Greedy tokens of each prompt, one request at a time: every engine then runs the same
    batch shapes (a one-prompt prefill, the batch-1 decode graph). Prompts batched together
    split into prefill and decode batches by the requests' arrival, and in bf16 another batch
    shape rounds the GEMMs differently, which can flip a near-tie argmax between engines
    holding the same weights."""
    from engine import engine_greedy

    return [engine_greedy(engine, [p], max_new)[0] for p in prompts]
