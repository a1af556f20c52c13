"""The two-GPU tests (``test/gpu/test_multi_gpu.py``) rehearsed on two CPU ranks.

No machine with two GPUs has been lent yet, and a test that never runs rots. Here the file
runs as it would there, under ``torchrun --nproc-per-node 2``, with
``SGLANG_TEST_MULTI_GPU_ON_CPU=1``: gloo instead of NCCL and CPU engines, everything else the
same (the launch, ``VerlEngine`` at TP 2 over both ranks, one TP-1 engine per rank fed by
the trainer-side path, the comparisons with freshly loaded engines). It found that an
SGLang engine started from a ``torchrun`` worker hangs at startup while its processes
inherit ``TORCHELASTIC_USE_AGENT_STORE``: ``VerlEngine`` now starts its engine without it,
and the plain engines of the second test drop it as ``docs/usage.md`` tells users to.

The engines spawn their schedulers (``SGLANG_TEST_FRESH_SPAWN``), as on the GPU: the zygote
is this suite's, not the GPU tier's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine import omp_bind
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def test_the_two_gpu_tests_pass_on_two_cpu_ranks_under_torchrun(tmp_path):
    env = {
        **os.environ,
        "SGLANG_TEST_MULTI_GPU_ON_CPU": "1",
        "SGLANG_TEST_FRESH_SPAWN": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": omp_bind(WORLD),
        "SGLANG_GPU_SHARED_DIR": str(tmp_path),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        f"--master-port={free_port()}",
        "-m",
        "pytest",
        "test/gpu/test_multi_gpu.py",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "--timeout=180",  # a test takes about 25 s here; a hang fails it
    ]
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    # one pytest per rank, each running both tests (a skip would still exit 0)
    assert out.count("2 passed") == WORLD, out[-8000:]
