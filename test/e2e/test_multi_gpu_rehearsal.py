"""The GPU tests that need two GPUs, rehearsed on CPU.

No machine with two GPUs has been lent yet, and a test that never runs rots. Here each file
runs as it would there, with ``SGLANG_TEST_MULTI_GPU_ON_CPU=1``: gloo instead of NCCL and
CPU engines, everything else the same.

* ``test/gpu/test_multi_gpu.py`` under ``torchrun --nproc-per-node 2``: the launch,
  an engine at TP 2 over both ranks that they host (``hosted_engine.HostedEngine``), one
  TP-1 engine per rank fed by the trainer-side path, the comparisons with freshly loaded
  engines. Its first rehearsal found that an SGLang engine started from a ``torchrun``
  worker hangs at startup while its processes inherit ``TORCHELASTIC_USE_AGENT_STORE``:
  ``VerlEngine`` (and ``HostedEngine``, as it) now starts its engine without it, and the
  plain engines of the second test drop it as ``docs/usage.md`` tells users to.
  Its third test times out a wait on the data plane's own group and checks that the
  process, the default group and a new data group all go on.
* ``test/gpu/test_remote_gpu.py``: a one-rank trainer updating an engine through a
  weight-sync group and ``LocalEndpoint`` (an engine in the trainer's process).

Under torchrun the engines spawn their schedulers (``SGLANG_TEST_FRESH_SPAWN``), as on the
GPU tier, which has no zygote: a scheduler forked from this suite's zygote fails to make its
gloo group ("Bad file descriptor" from its TCP store) while the process that starts it holds
a process group met through a TCP store (torchrun's ``env://``, or ``tcp://``). After a
``file://`` one, as in ``test_remote_gpu.py``, the zygote serves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

from engine import omp_bind
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs"]


def _rehearse(
    args: List[str], tmp_path: Path, timeout: float, spawn: bool = False
) -> str:
    """Run ``python args`` from the repository root in rehearsal mode (``spawn``: the
    engines' processes spawned, not forked from the zygote); its output."""
    env = {
        **os.environ,
        "SGLANG_TEST_MULTI_GPU_ON_CPU": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": omp_bind(WORLD),
        "SGLANG_GPU_SHARED_DIR": str(tmp_path),
    }
    if spawn:
        env["SGLANG_TEST_FRESH_SPAWN"] = "1"
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def test_the_two_gpu_tests_pass_on_two_cpu_ranks_under_torchrun(tmp_path):
    out = _rehearse(
        [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={WORLD}",
            f"--master-port={free_port()}",
            *PYTEST,
            "test/gpu/test_multi_gpu.py",
            "--timeout=180",  # a test takes about 25 s here; a hang fails it
        ],
        tmp_path,
        timeout=420,
        spawn=True,
    )
    # one pytest per rank, each running every test (a skip would still exit 0)
    assert out.count("3 passed") == WORLD, out[-8000:]


def test_the_remote_two_gpu_test_passes_on_cpu(tmp_path):
    out = _rehearse(
        [*PYTEST, "test/gpu/test_remote_gpu.py", "--timeout=180"],
        tmp_path,
        timeout=240,
    )
    assert "1 passed" in out, out[-8000:]
